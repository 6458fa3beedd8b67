"""``trainer.follow_threads``: the trainer's torch threads follow the cores its rollout workers leave idle.

With ``buffer.mode=async`` or ``stream`` (local workers) the rollout workers generate beside the trainer and wait
for orders or weights a good part of the time; a fixed ``trainer.threads`` leaves those idle cores unused, or, set
higher, crowds the workers while they generate.  After every step the follower sets the count for the next one from
two things the step measured (:func:`next_state`, pure; :class:`ThreadFollower` applies it):

1. **What the workers leave idle** (a ceiling).  The step's busy share of the workers (:func:`busy_share`)

       b = worker_generate_s / (workers * wall_s)            clipped to [0, 1]

   (``async/worker_generate_s``: their seconds generating since the previous step, summed over the workers;
   ``perf/time_step_s``: the step's wall seconds), smoothed by an exponential moving average (:func:`smooth`)
   ``s_t = a * b_t + (1 - a) * s_{t-1}``, ``s_1 = b_1`` (``a = FollowPolicy.smoothing``; the first
   ``FollowPolicy.warmup`` steps, the workers' start, are not counted).  With ``C = cores // processes`` (the CPUs
   of ``os.sched_getaffinity`` shared among this machine's trainer processes, each with its own workers) and
   ``W = rollout.workers * rollout.worker_threads`` (the threads the workers run), the idle cores give
   (:func:`idle_threads`)

       target(x) = min(C, max(1, floor(C - W * s + x)))
       ceiling   = target(r - h)  if it exceeds the current count n,
                   target(r + h)  if that is below n,          n otherwise

   with the tolerance ``r`` (the share of a core the trainer's threads may overlap with a busy worker) and the
   hysteresis ``h`` against flapping.  On 2 cores with one 1-thread worker (``r = 0.75``, ``h = 0.1``): a second
   thread may be tried while the smoothed share is at most 0.65, and is given up once it is above 0.85.

2. **Whether more threads measured faster** (a guard).  The average share cannot say whether a second thread pays:
   what matters is whether the worker generates *while* the trainer computes, and a trainer slowed by crowding makes
   the worker look idler still (measured on 2 cores: a stream step at 2 threads took 1.4-8x the 1-thread step while
   the worker's share fell from 0.63 to 0.33, and an asynchronous k = 1 step at a share of 0.3-0.5 ran 0.76-1.22x
   as fast at 2 threads as at 1, with the load).  So the follower keeps a moving average of each count's cost, ``c[n]`` = seconds per trained token of
   its steps (``(perf/time_step_s - perf/time_eval_s) / async/trained_tokens``, :func:`step_cost`), and raises the
   count one at a time, once the count it leaves, ``m``, was measured for ``FollowPolicy.trial_steps`` steps, as a
   **trial** of as many steps:

   * it gives the trial up, back to ``m``, as soon as ``c[n] > c[m] * (1 + abort)`` (a crowded step), or at the
     end of the trial unless ``c[n] <= c[m] * (1 - margin)`` (a thread more must buy at least ``margin``: it takes
     a core from the workers and from whatever else runs); no new trial then for ``backoff`` steps, a wait that
     doubles with every trial given up in a row (``FollowPolicy.backoff`` .. ``max_backoff``);
   * a count kept goes on being measured: when ``c[n]`` rises above ``c[j] * (1 + drift)`` for the best lower
     count ``j`` measured, it goes back to ``j`` (a change of load on the machine), with the same wait (``drift``
     is wide: one step's cost varies by some 20% on a shared machine);
   * it goes down at once, with no trial, when the ceiling falls below the count.

So the count is always in ``[1, C]``, and above the count the run started with (``trainer.threads`` as resolved) only
after a trial measured it faster.  :class:`ThreadFollower` calls ``torch.set_num_threads`` only when the count changes; the
trainer calls it after every step with the step's metrics and logs ``perf/trainer_threads``, the count the step
ran with.  An intra-op thread count can change the summation order of a float matmul or reduction, so a run that
follows is not bit-reproducible where its tensors are large enough to be split among threads (docs/async.md).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Optional

import torch

__all__ = ["FollowPolicy", "FollowState", "ThreadFollower", "busy_share", "step_cost", "smooth", "idle_threads",
           "next_state", "follower_for", "usable_cores", "GENERATE_KEY", "WALL_KEY", "TOKENS_KEY", "EVAL_KEY",
           "THREADS_KEY"]

#: the step metric with the workers' generation seconds since the previous step (the batch sources report it)
GENERATE_KEY = "async/worker_generate_s"
#: the step metric with the step's wall seconds (the loop sets it)
WALL_KEY = "perf/time_step_s"
#: the step metric with the response tokens the step trained (the batch sources report it)
TOKENS_KEY = "async/trained_tokens"
#: the step metric with the seconds the step spent evaluating (left out of the step's cost)
EVAL_KEY = "perf/time_eval_s"
#: the metric the trainer logs: the torch threads the step ran with
THREADS_KEY = "perf/trainer_threads"


@dataclass(frozen=True)
class FollowPolicy:
    """The machine and the rule's constants (module docstring: ``C``, ``W``, ``r``, ``h``, ``a``, the trial)."""

    cores: int                  # CPUs this process may run on (len(os.sched_getaffinity(0)))
    workers: int = 1            # this trainer process's rollout workers (rollout.workers)
    worker_threads: int = 1     # torch threads of each (rollout.worker_threads)
    processes: int = 1          # trainer processes on this machine, each with its own workers
    tolerance: float = 0.75     # r: share of a core the trainer's threads may overlap with busy workers
    hysteresis: float = 0.1     # h: the ceiling moves only this far past a boundary
    smoothing: float = 0.5      # a: weight of the newest step in the moving averages
    warmup: int = 1             # first steps not counted (the workers' start)
    trial_steps: int = 2        # steps a raised count is tried before it is kept
    margin: float = 0.05        # a tried count is kept when its cost is at most (1 - margin) x the lower count's
    abort: float = 0.5          # a trial ends at once when a step costs more than (1 + abort) x the lower count's
    drift: float = 0.25         # a kept count is left when it costs more than (1 + drift) x a lower count's
    backoff: int = 8            # steps without a new trial after one was given up (doubling in a row) ...
    max_backoff: int = 256      # ... up to this many

    def __post_init__(self) -> None:
        if min(self.cores, self.workers, self.worker_threads, self.processes, self.trial_steps, self.backoff) < 1:
            raise ValueError(f"FollowPolicy: cores, workers, worker_threads, processes, trial_steps and backoff must "
                             f"be >= 1: {self}")
        if not 0.0 <= self.tolerance < 1.0 or not 0.0 <= self.hysteresis <= min(self.tolerance, 1 - self.tolerance):
            raise ValueError(f"FollowPolicy: tolerance ({self.tolerance}) must be in [0, 1) and hysteresis "
                             f"({self.hysteresis}) in [0, min(tolerance, 1 - tolerance)]")
        if not 0.0 < self.smoothing <= 1.0 or self.warmup < 0 or not 0.0 <= self.margin < 1.0:
            raise ValueError(f"FollowPolicy: smoothing ({self.smoothing}) must be in (0, 1], warmup ({self.warmup}) "
                             f">= 0 and margin ({self.margin}) in [0, 1)")
        if self.abort < 0 or self.drift < 0:
            raise ValueError(f"FollowPolicy: abort ({self.abort}) and drift ({self.drift}) must be >= 0")
        if self.max_backoff < self.backoff:
            raise ValueError(f"FollowPolicy: max_backoff ({self.max_backoff}) < backoff ({self.backoff})")

    @property
    def worker_cores(self) -> int:
        """``W``: the threads this trainer process's workers run together."""
        return self.workers * self.worker_threads

    @property
    def max_threads(self) -> int:
        """``C``: the cores of this trainer process (at least 1)."""
        return max(1, self.cores // self.processes)


@dataclass(frozen=True)
class FollowState:
    """What the follower knows after a step: the count the next step runs with, the smoothed share, each count's
    smoothed cost, the trial under way (``trial_from``: the count it left, None without one) and the wait."""

    threads: int
    share: Optional[float] = None
    cost: Mapping[int, float] = field(default_factory=dict)
    trial_from: Optional[int] = None
    trial_steps: int = 0
    step: int = 0                   # steps counted (after the warm-up)
    no_trial_before: int = 0        # the step from which a new trial may start (FollowState.start: trial_steps)
    wait: int = 0                   # the wait the next trial given up gets (0: the policy's backoff)

    @classmethod
    def start(cls, policy: FollowPolicy, threads: int) -> "FollowState":
        """The state before the first step: ``threads`` (the run's count), no trial before the count has been
        measured for ``policy.trial_steps`` steps."""
        return cls(threads=int(threads), no_trial_before=policy.trial_steps)


def busy_share(metrics: Mapping[str, float], workers: int) -> Optional[float]:
    """``b = worker_generate_s / (workers * wall_s)`` of one step, clipped to ``[0, 1]``; None when the step's
    metrics lack either figure (a skipped non-finite batch) or its wall time is not positive."""
    generate, wall = metrics.get(GENERATE_KEY), metrics.get(WALL_KEY)
    if generate is None or wall is None or not math.isfinite(generate) or not math.isfinite(wall) or wall <= 0:
        return None
    return min(1.0, max(0.0, float(generate) / (max(1, workers) * float(wall))))


def step_cost(metrics: Mapping[str, float]) -> Optional[float]:
    """Seconds per trained token of one step, ``(wall_s - eval_s) / trained_tokens``; None without both figures,
    without tokens, or when it is not positive."""
    wall, tokens = metrics.get(WALL_KEY), metrics.get(TOKENS_KEY)
    if wall is None or tokens is None or not math.isfinite(wall) or not math.isfinite(tokens) or tokens <= 0:
        return None
    busy = float(wall) - float(metrics.get(EVAL_KEY, 0.0) or 0.0)
    return busy / float(tokens) if busy > 0 and math.isfinite(busy) else None


def smooth(previous: Optional[float], value: float, smoothing: float) -> float:
    """The moving average ``a * value + (1 - a) * previous`` (``value`` itself when there is no previous)."""
    return value if previous is None else smoothing * value + (1.0 - smoothing) * previous


def _target(policy: FollowPolicy, share: float, rounding: float) -> int:
    """``min(C, max(1, floor(C - W * s + rounding)))`` (1e-9 absorbs float rounding at the boundaries)."""
    free = policy.max_threads - policy.worker_cores * share
    return min(policy.max_threads, max(1, math.floor(free + rounding + 1e-9)))


def idle_threads(policy: FollowPolicy, share: float, current: int) -> int:
    """The ceiling the idle cores give (module docstring, part 1): from the workers' smoothed busy share ``share``
    and the count ``current``: ``target(r - h)`` when it exceeds ``current``, ``target(r + h)`` when that is below
    it, else ``current`` (clamped to ``[1, C]``)."""
    s = min(1.0, max(0.0, float(share)))
    up = _target(policy, s, policy.tolerance - policy.hysteresis)
    if up > current:
        return up
    down = _target(policy, s, policy.tolerance + policy.hysteresis)
    return down if down < current else min(policy.max_threads, max(1, int(current)))


def _back_off(policy: FollowPolicy, state: FollowState, to: int, **changes: Any) -> FollowState:
    """Go back to ``to`` threads; no trial for the current wait, which doubles for the next time."""
    wait = state.wait or policy.backoff
    return replace(state, threads=to, trial_from=None, trial_steps=0, no_trial_before=state.step + wait,
                   wait=min(policy.max_backoff, 2 * wait), **changes)


def _judge_trial(policy: FollowPolicy, state: FollowState) -> FollowState:
    """A trial's step: given up (back to the count it left) on a crowded step or, at its end, unless it measured
    ``margin`` cheaper than the count it left; kept otherwise."""
    steps = state.trial_steps + 1
    base, mine = state.cost.get(state.trial_from), state.cost.get(state.threads)
    if base is not None and mine is not None:
        last_steps = steps >= policy.trial_steps
        if mine > base * (1 + policy.abort) or (last_steps and mine > base * (1 - policy.margin)):
            return _back_off(policy, state, state.trial_from)
    if steps >= policy.trial_steps:
        return replace(state, trial_from=None, trial_steps=0, wait=0)
    return replace(state, trial_steps=steps)


def next_state(policy: FollowPolicy, state: FollowState, share: Optional[float],
               cost: Optional[float]) -> FollowState:
    """The follower after one more step (module docstring): the step's busy share and cost (None when the step did
    not measure them) folded into the moving averages, then the count for the next step: a trial judged, or the
    count lowered to the ceiling, or a count that measured slower than a lower one left, or a trial started (once
    the count was measured and the wait is over)."""
    if share is None:
        return state
    costs = dict(state.cost)
    if cost is not None:
        costs[state.threads] = smooth(costs.get(state.threads), cost, policy.smoothing)
    state = replace(state, share=smooth(state.share, share, policy.smoothing), cost=costs, step=state.step + 1)
    if state.trial_from is not None:
        return _judge_trial(policy, state)
    ceiling = idle_threads(policy, state.share, state.threads)
    if ceiling < state.threads:
        return replace(state, threads=ceiling)
    mine = costs.get(state.threads)
    lower = {n: c for n, c in costs.items() if n < state.threads}
    if mine is not None and lower:
        best = min(lower, key=lambda n: (lower[n], n))
        if mine > lower[best] * (1 + policy.drift):
            return _back_off(policy, state, best)
    if ceiling > state.threads and mine is not None and state.step >= state.no_trial_before:
        raised = state.threads + 1
        costs.pop(raised, None)             # the trial measures the count afresh
        return replace(state, threads=raised, trial_from=state.threads, trial_steps=0, cost=costs)
    return state


def usable_cores() -> int:
    """CPUs this process may run on: ``len(os.sched_getaffinity(0))`` where the platform has it, else
    ``os.cpu_count()``."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:      # not on Linux
        return max(1, os.cpu_count() or 1)


class ThreadFollower:
    """Applies :func:`next_state` after every step: :meth:`observe` takes the step's metrics and calls
    ``set_threads`` (default: ``torch.set_num_threads``, looked up at each call) only when the count changes;
    :meth:`restore` puts back the count it started from (``get_threads``' answer, default
    ``torch.get_num_threads()``).  ``changes``: how many times it set a new count."""

    def __init__(self, policy: FollowPolicy, *, set_threads: Optional[Callable[[int], None]] = None,
                 get_threads: Optional[Callable[[], int]] = None):
        self.policy = policy
        self._set = set_threads
        self.initial = int(get_threads() if get_threads is not None else torch.get_num_threads())
        self.state = FollowState.start(policy, self.initial)
        self.seen = 0                        # steps with a share, the warm-up's included
        self.changes = 0

    @property
    def threads(self) -> int:
        """The count the next step runs with."""
        return self.state.threads

    def observe(self, metrics: Mapping[str, float]) -> int:
        """Fold one step's measurements in and set the next step's count; returns it."""
        share = busy_share(metrics, self.policy.workers)
        if share is None:
            return self.threads
        self.seen += 1
        if self.seen <= self.policy.warmup:
            return self.threads
        before = self.threads
        self.state = next_state(self.policy, self.state, share, step_cost(metrics))
        self._apply(before, self.threads)
        return self.threads

    def restore(self) -> None:
        """Set the thread count back to the one the follower started from (the process outlives the run)."""
        before = self.threads
        self.state = replace(self.state, threads=self.initial)
        self._apply(before, self.initial)

    def _apply(self, before: int, threads: int) -> None:
        if threads != before:
            (self._set or torch.set_num_threads)(int(threads))
            self.changes += 1


def follower_for(cfg: Any) -> Optional[ThreadFollower]:
    """The run's follower when ``trainer.follow_threads`` is on (the config checks allow it only with local
    workers, ``buffer.mode=async`` or ``stream``), else None; the trainer processes of this machine from
    ``LOCAL_WORLD_SIZE`` (set by torchrun / accelerate launch)."""
    if not getattr(cfg.trainer, "follow_threads", False):
        return None
    ro = cfg.rollout
    policy = FollowPolicy(cores=usable_cores(), workers=max(1, int(ro.workers)),
                          worker_threads=max(1, int(ro.worker_threads)),
                          processes=max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    return ThreadFollower(policy)
