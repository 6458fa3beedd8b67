"""Which complete groups a streaming step trains, as pure functions (docs/async.md, "Streaming").

A streaming worker emits each group (one prompt's ``G`` samples) when its last sample finishes, so groups arrive
out of order and short answers first.  Every group carries a *deadline*: the published version ``p`` when it was
issued, plus ``k = buffer.staleness``.  Its first token is sampled by a version ``>= p`` (the worker loads the newest
weights before it admits a sample), so a group trained at a step ``<= p + k`` has every token within ``k`` versions.
The source keeps at most ``P (k + 1)`` groups outstanding (issued, neither trained nor dropped; ``P`` =
``rollout.prompts_per_step``), issued only when a version is published.

* :func:`deadline_choice` (``buffer.admission=deadline``) is earliest-deadline-first, lazily: at step ``t`` it must
  train the ``m`` earliest-deadline groups, where ``m = max_j (R_j - P j)`` and ``R_j`` counts the outstanding groups
  due by step ``t + j`` (the later steps can take only ``P j`` of them), waiting for those that are still being
  generated; the rest of the step's ``P`` are complete groups, earliest deadline first.  No group is dropped and
  none misses its deadline, so a late long group is trained (staler, corrected per token) rather than lost.
* :func:`first_finished_choice` (``buffer.admission=first_finished``) is the naive rule: the first ``P`` groups to
  complete; a group whose oldest token would lag more than ``k`` is dropped.  Long answers finish last and are the
  ones dropped, so the trained lengths are biased short (:func:`ks_distance` measures it).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

__all__ = ["Ticket", "Choice", "deadline_choice", "first_finished_choice", "may_issue", "ks_distance"]


@dataclass(frozen=True)
class Ticket:
    """An outstanding group: its index, its deadline step, and when it completed (``done``: the order of arrival;
    None while it is generated) with the version of its oldest token."""

    group: int
    deadline: int
    done: Optional[int] = None
    oldest_version: Optional[int] = None


@dataclass(frozen=True)
class Choice:
    """What a step does: train ``train`` (group indices) when ``wait`` is False; ``drop`` the groups past the
    bound; ``wait`` for more groups to complete first."""

    train: tuple[int, ...]
    wait: bool
    drop: tuple[int, ...] = ()


def may_issue(outstanding: int, per_step: int, staleness: int) -> int:
    """How many new groups may be issued: ``P (k + 1) - outstanding`` (never negative)."""
    return max(per_step * (staleness + 1) - outstanding, 0)


def _order(t: Ticket) -> tuple:
    # earliest deadline first; within a deadline, complete groups by arrival, then the ones still generating
    return (t.deadline, t.done is None, t.done if t.done is not None else 0, t.group)


def deadline_choice(tickets: Sequence[Ticket], step: int, per_step: int) -> Choice:
    """Lazy earliest-deadline-first (module docstring): the groups step ``step`` trains, or ``wait`` when a group it
    must train is still being generated or fewer than ``per_step`` groups are complete.  :class:`ValueError` when a
    deadline has passed or the groups due cannot all be trained in time (the issue rule prevents both)."""
    ordered = sorted(tickets, key=_order)
    if ordered and ordered[0].deadline < step:
        raise ValueError(f"group {ordered[0].group} was due at step {ordered[0].deadline}, now step {step}")
    must = 0
    for i, t in enumerate(ordered):       # R_j - P j at each deadline t + j present
        last_of_deadline = i + 1 == len(ordered) or ordered[i + 1].deadline != t.deadline
        if last_of_deadline:
            must = max(must, (i + 1) - per_step * (t.deadline - step))
    if must > per_step:
        raise ValueError(f"{must} groups are due by their deadlines but a step trains {per_step}")
    mandatory = ordered[:must]
    rest = [t for t in ordered[must:] if t.done is not None]
    chosen = mandatory + rest[:per_step - must]
    wait = len(chosen) < per_step or any(t.done is None for t in mandatory)
    return Choice(tuple(t.group for t in chosen), wait)


def first_finished_choice(tickets: Sequence[Ticket], step: int, per_step: int, staleness: int) -> Choice:
    """The naive rule (module docstring): the first ``per_step`` complete groups in order of arrival, dropping a
    complete group whose oldest token lags more than ``staleness`` at ``step``; ``wait`` when fewer are complete."""
    done = sorted((t for t in tickets if t.done is not None), key=lambda t: t.done)
    late = tuple(t.group for t in done if step - int(t.oldest_version) > staleness)
    fresh = [t.group for t in done if t.group not in late]
    return Choice(tuple(fresh[:per_step]), len(fresh) < per_step, late)


def ks_distance(a: Sequence[float], b: Sequence[float]) -> float:
    """Two-sample Kolmogorov-Smirnov distance ``sup_x |F_a(x) - F_b(x)|`` of the empirical distributions of ``a``
    and ``b`` (0 when either is empty)."""
    if not a or not b:
        return 0.0
    xs, ys = sorted(a), sorted(b)
    i = j = 0
    best = 0.0
    while i < len(xs) and j < len(ys):
        x = min(xs[i], ys[j])
        while i < len(xs) and xs[i] <= x:
            i += 1
        while j < len(ys) and ys[j] <= x:
            j += 1
        best = max(best, abs(i / len(xs) - j / len(ys)))
    return best
