"""The scheduling rules of the asynchronous pipeline, as pure functions (docs/async.md, "Bounded lag").

Trainer step ``t`` consumes generation iteration ``t`` (in order, one batch a step, no warm-up) and afterwards
publishes policy version ``t + 1``.  A token sampled by version ``v`` and trained on at step ``t`` has lag
``t - v``; ``buffer.staleness = k`` bounds it:

* ``on_stale = "wait"``: iteration ``i`` is handed to a worker only once version ``i - k`` is published, and a
  worker always samples with the newest published weights, so every token of iteration ``i`` has a version
  ``>= i - k``: its lag at step ``i`` is ``<= k`` by construction.  Workers idle (wait) when they would run ahead.
* ``on_stale = "drop"``: iterations are handed out up to ``ahead`` further (workers never wait for weights, they
  generate speculatively with the weights they have); a batch whose OLDEST token would lag more than ``k`` at its
  step is dropped (counted) and the same iteration (same prompts, same seed) is generated again.

Both the real pipeline (:mod:`~offpolicy_moe.engine.pipeline.source`) and the property tests' event simulation
call these functions, so the tested rules are the running ones.
"""
from __future__ import annotations

__all__ = ["STALE_POLICIES", "issue_limit", "min_version", "lag", "is_stale"]

STALE_POLICIES = ("wait", "drop")


def issue_limit(published: int, staleness: int, policy: str = "wait", ahead: int = 0) -> int:
    """The largest iteration that may be handed to a worker while version ``published`` is the newest:
    ``published + k`` (``wait``) or ``published + k + ahead`` (``drop``)."""
    if policy not in STALE_POLICIES:
        raise ValueError(f"buffer.on_stale must be one of {STALE_POLICIES}, got {policy!r}")
    if staleness < 0 or ahead < 0:
        raise ValueError(f"staleness ({staleness}) and ahead ({ahead}) must be >= 0")
    return published + staleness + (ahead if policy == "drop" else 0)


def min_version(iteration: int, staleness: int) -> int:
    """The oldest policy version allowed to sample iteration ``iteration``: ``max(0, iteration - k)``."""
    return max(0, iteration - staleness)


def lag(step: int, version: int) -> int:
    """Lag in policy versions of a token sampled by ``version`` and trained on at step ``step``: ``step - version``."""
    return step - version


def is_stale(step: int, oldest_version: int, staleness: int) -> bool:
    """True when a batch whose oldest token was sampled by ``oldest_version`` would exceed the bound at ``step``."""
    return lag(step, oldest_version) > staleness
