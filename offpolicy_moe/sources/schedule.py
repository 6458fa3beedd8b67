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

:class:`Dispatcher` is the pipeline's bookkeeping on top of these rules, free of processes: the real pipeline
(:mod:`~offpolicy_moe.sources.asynchronous`) drives it with pipes, the property tests with a simulated clock, so
the tested rules are the running ones.
"""
from __future__ import annotations

from dataclasses import dataclass

from offpolicy_moe.config.schema import STALE_POLICIES

__all__ = ["issue_limit", "min_version", "lag", "is_stale", "Assignment", "Dispatcher"]



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


@dataclass(frozen=True)
class Assignment:
    """Send iteration ``iteration`` (attempt ``attempt``) to worker ``worker``; it may sample with versions
    ``>= min_version`` only."""

    worker: int
    iteration: int
    attempt: int
    min_version: int


class Dispatcher:
    """The pipeline's bookkeeping without processes: which iteration goes to which worker and when, which answers
    are kept, dropped or stale duplicates, and what a dead worker had in flight.  The trainer consumes iterations
    ``0 .. total-1`` in order (:meth:`release`)."""

    def __init__(self, *, staleness: int, policy: str, ahead: int, total: int, workers: int):
        issue_limit(0, staleness, policy, ahead)          # validates the arguments
        if workers < 1:
            raise ValueError(f"the pipeline needs at least one worker, got {workers}")
        self.k, self.policy, self.ahead, self.total = int(staleness), policy, int(ahead), int(total)
        self.cursor = 0                 # next iteration the trainer takes
        self.next_issue = 0             # next iteration never handed out
        self.reissue: list[int] = []    # dropped or lost iterations to hand out again (sorted)
        self.attempts: dict[int, int] = {}
        self.inflight: dict[int, list[int]] = {w: [] for w in range(workers)}
        self.dropped = 0

    def issue(self, published: int) -> list[Assignment]:
        """Hand out every iteration that version ``published`` allows (re-issues first), each to the worker with
        the fewest iterations in flight."""
        limit = min(issue_limit(published, self.k, self.policy, self.ahead), self.total - 1)
        out = []
        while True:
            if self.reissue and self.reissue[0] <= limit:
                it = self.reissue.pop(0)
            elif self.next_issue <= limit:
                it, self.next_issue = self.next_issue, self.next_issue + 1
            else:
                return out
            w = min(self.inflight, key=lambda j: (len(self.inflight[j]), j))
            attempt = self.attempts.get(it, -1) + 1
            self.attempts[it] = attempt
            self.inflight[w].append(it)
            out.append(Assignment(w, it, attempt, min_version(it, self.k) if self.policy == "wait" else 0))

    def accept(self, worker: int, iteration: int, attempt: int, oldest_version: int) -> bool:
        """A worker answered; True when the batch is to be kept.  An answer to a superseded attempt or an already
        consumed iteration is ignored; a batch that would exceed the bound at its step is dropped (counted) and its
        iteration re-issued at the next :meth:`issue`."""
        if iteration in self.inflight.get(worker, []):
            self.inflight[worker].remove(iteration)
        if attempt != self.attempts.get(iteration) or iteration < self.cursor:
            return False
        if is_stale(iteration, oldest_version, self.k):
            self.dropped += 1
            self.requeue([iteration])
            return False
        return True

    def worker_lost(self, worker: int) -> list[int]:
        """Worker ``worker`` died: its iterations in flight are re-issued (returned); it has nothing in flight."""
        lost = self.inflight.get(worker, [])
        self.inflight[worker] = []
        self.requeue(lost)
        return list(lost)

    def retire(self, worker: int) -> None:
        """Worker ``worker`` is gone for good (its node left): nothing is handed to it any more.  Its iterations in
        flight must have been taken back first (:meth:`worker_lost`); :class:`ValueError` otherwise."""
        if self.inflight.get(worker):
            raise ValueError(f"worker {worker} still has iteration(s) {self.inflight[worker]} in flight")
        self.inflight.pop(worker, None)

    def release(self, step: int) -> None:
        """The trainer took iteration ``step`` (it must be the next one)."""
        if step != self.cursor:
            raise RuntimeError(f"async pipeline: the trainer asks for iteration {step}, the next one is {self.cursor}")
        self.cursor = step + 1

    def restore(self, cursor: int, received: list[int], dropped: int = 0) -> None:
        """Resume at ``cursor`` with iterations ``received`` already in hand (the rest are issued again) and
        ``dropped`` stale batches counted so far."""
        self.cursor = int(cursor)
        self.dropped = int(dropped)
        self.next_issue = max([self.cursor - 1, *received]) + 1
        self.requeue([i for i in range(self.cursor, self.next_issue) if i not in received])

    def requeue(self, iterations: list[int]) -> None:
        """Issue ``iterations`` again (at the next :meth:`issue`)."""
        self.reissue = sorted(set(self.reissue) | set(iterations))
