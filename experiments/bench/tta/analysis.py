"""Pure functions of bench_tta.py: arm names, time to accuracy from metric rows, the target rule, paired ratios.

No file access, no processes; tests/test_bench_tta.py checks each on hand-made inputs.
"""
from __future__ import annotations

import math
import re
import statistics
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

from offpolicy_moe.report.stats import Comparison, compare

#: the staleness values and losses ``async`` expands to (issue 25; vespo and gmpo: the two best of the stale race,
#: issue 29, docs/results.md)
ASYNC_STALENESS = (1, 2, 4)
LOSSES = ("grpo", "m2po", "m2po_tis", "vespo", "gmpo")
#: the algorithm presets each loss name stands for (offpolicy_moe/mechanisms/*.yaml); ``unclipped`` (no trust
#: region, importance-weighted policy gradient) is never part of ``async``: it isolates what clipping does (item 4)
LOSS_PRESETS = {"grpo": "grpo", "m2po": "m2po", "m2po_tis": "m2po,tis", "vespo": "vespo", "gmpo": "gmpo",
                "unclipped": "unclipped"}
ASYNC_ARM = re.compile(r"(async|ray|fixed|stream)-k(\d+)-([a-z0-9_+]+)")
#: the default target: the on-policy (sync) arm's median final accuracy minus this
TARGET_MARGIN = 0.03


@dataclass(frozen=True)
class Arm:
    """One arm: ``trl`` (TRL's GRPOTrainer), ``sync`` (ours, on-policy), ours asynchronous at staleness ``k``,
    with a local worker process (``backend="local"``) or a rollout actor of a Ray cluster (``backend="ray"``: a local
    cluster started by the run unless ``RAY_ADDRESS`` names one; needs the ``[ray]`` extra), or ours in one process
    trained on batches exactly ``k`` versions old (``mode="fixed"``, ``k >= 1``: the staleness of an asynchronous
    arm without its worker process, its process's random streams or its timing)."""

    name: str
    system: str                 # trl | ours
    mode: str = "fixed"         # ours: buffer.mode (fixed | async | stream)
    staleness: int = 0
    loss: str = "grpo"
    backend: str = "local"      # ours, async: rollout.backend (local | ray)

    def overrides(self) -> list[str]:
        """Trainer overrides that make this arm (ours only; TRL has its own config)."""
        if self.system != "ours":
            raise ValueError(f"arm {self.name!r} is not one of ours")
        out = [f"preset=[{LOSS_PRESETS[self.loss]}]", f"buffer.mode={self.mode}", f"buffer.staleness={self.staleness}"]
        if self.mode in ("async", "stream"):
            out += ["rollout.workers=1", "rollout.worker_threads=1"]
        if self.backend != "local":
            out.append(f"rollout.backend={self.backend}")
        return out


def fixed_arm(k: int, loss: str) -> Arm:
    """Ours in one process, each batch trained exactly ``k`` versions after the weights that generated it
    (``buffer.mode=fixed buffer.staleness=k``): ``fixed-k<k>-<loss>``."""
    return Arm(f"fixed-k{k}-{loss}", "ours", "fixed", k, loss)


def async_arm(k: int, loss: str, backend: str = "local") -> Arm:
    """Ours asynchronous at staleness ``k`` with ``loss``: ``async-k<k>-<loss>`` (local worker process) or
    ``ray-k<k>-<loss>`` (a Ray rollout actor)."""
    prefix = "async" if backend == "local" else backend
    return Arm(f"{prefix}-k{k}-{loss}", "ours", "async", k, loss, backend)


def stream_arm(k: int, loss: str) -> Arm:
    """Ours streaming at staleness ``k`` with ``loss`` (``buffer.mode=stream``: one worker with continuous
    batching, groups trained as they complete under the deadline rule): ``stream-k<k>-<loss>``."""
    return Arm(f"stream-k{k}-{loss}", "ours", "stream", k, loss)


def parse_arms(text: str) -> list[Arm]:
    """``--arms`` comma list -> arms, in order, duplicates dropped.  ``async`` expands to ``async-k<K>-<loss>`` for
    K in :data:`ASYNC_STALENESS` x loss in :data:`LOSSES`; a single one is named ``async-k2-m2po_tis`` (``+`` for
    ``_`` accepted); ``ray-k<K>-<loss>`` is the same arm with its worker a Ray actor; ``stream`` is
    ``stream-k1-grpo``.  :class:`ValueError` with one
    line naming the arm for anything else."""
    arms: list[Arm] = []
    names = [t.strip() for t in text.split(",")]
    if not any(names):
        raise ValueError("--arms is empty: expected a comma list of trl, sync, async, async-k<K>-<loss>")
    for name in names:
        if name == "trl":
            new = [Arm("trl", "trl")]
        elif name == "sync":
            new = [Arm("sync", "ours", "fixed", 0, "grpo")]
        elif name == "async":
            new = [async_arm(k, loss) for k in ASYNC_STALENESS for loss in LOSSES]
        elif name == "stream":
            new = [stream_arm(1, "grpo")]
        else:
            m = ASYNC_ARM.fullmatch(name)
            loss = m.group(3).replace("+", "_") if m else None
            if m is None or loss not in LOSS_PRESETS or int(m.group(2)) < 1:
                raise ValueError(f"unknown arm {name!r} in --arms: expected trl, sync, async, stream, "
                                 f"async-k<K>-<loss>, ray-k<K>-<loss>, fixed-k<K>-<loss> or stream-k<K>-<loss> with "
                                 f"K >= 1 and loss in "
                                 f"{', '.join(LOSS_PRESETS)}")
            k = int(m.group(2))
            kind = m.group(1)
            new = [fixed_arm(k, loss) if kind == "fixed" else stream_arm(k, loss) if kind == "stream"
                   else async_arm(k, loss, "local" if kind == "async" else "ray")]
        arms += [a for a in new if a.name not in {b.name for b in arms}]
    return arms


def rotated(arms: Sequence, i: int) -> list:
    """The run order of seed index ``i``: the arms rotated left by ``i`` (seed-major interleaving, so a drift of the
    machine's load reaches every arm alike and no arm always runs first)."""
    if not arms:
        return []
    r = i % len(arms)
    return list(arms[r:]) + list(arms[:r])


@dataclass(frozen=True)
class Curve:
    """A run's held-out accuracy against its training clock, and what its time to the target is measured from."""

    steps: list[int]
    accuracy: list[float]
    time_s: list[float]             # evaluation time charged (every earlier evaluation, not the measuring one)
    time_no_eval_s: list[float]     # evaluation time excluded
    end_s: float                    # the run's loop end (from the end of step 1), evaluation included
    end_no_eval_s: float
    clock: str                      # perf/elapsed_s | cumsum perf/time_step_s
    final_accuracy: float
    eval_s: float                   # evaluation time after step 1
    first_step_s: float             # the loop's first step (start-up: async workers start on the first batch)
    phases: dict = field(default_factory=dict)     # sums over steps 2..N of the perf/* and async/* times logged
    # the clock from process start (experiments/bench/tta/clock.py), per eval point; empty when not watched
    time_process_s: list = field(default_factory=list)          # earlier evaluations charged
    time_process_no_eval_s: list = field(default_factory=list)  # every evaluation (step 0's too) excluded
    cpu_s: list = field(default_factory=list)                   # CPU seconds of the process tree at the point
    end_process_s: Optional[float] = None                       # the process's wall seconds (censoring)
    end_process_no_eval_s: Optional[float] = None
    cpu_end_s: Optional[float] = None


def curve(rows: Sequence[Mapping], metric: str = "eval/accuracy") -> Curve:
    """The eval points of one run from its metric rows (``metrics.jsonl``: one row per logged step); ``metric``: the
    accuracy (``eval/accuracy``: exact match; ``eval/reward``: the task's own reward, e.g. the final answer's).

    Clock ``C(s)`` of step s: ``perf/elapsed_s`` (wall seconds since the training loop started, evaluation
    included) when every trained row has it, else the cumulative sum of ``perf/time_step_s`` (which also includes
    the step's evaluation), which needs every step 1..N logged.  The first trained step is start-up for every arm
    (our asynchronous workers start on the first batch request; TRL and ours warm up), so time runs from its end:
    at an eval row of step s > 1, ``time_s = C(s) − C(1) − E(s)`` (the measuring evaluation E(s) is not charged,
    every earlier one is) and ``time_no_eval_s = C(s) − C(1) − Σ_{1 < s' ≤ s} E(s')``; steps 0 and 1 are at 0 s.
    """
    rows = sorted(rows, key=lambda r: r["step"])
    trained = [r for r in rows if r["step"] > 0]
    if not trained:
        raise ValueError("no trained step in the metric rows")
    if all("perf/elapsed_s" in r for r in trained):
        clock_of = {r["step"]: float(r["perf/elapsed_s"]) for r in trained}
        clock = "perf/elapsed_s"
    else:
        steps = [r["step"] for r in trained]
        if steps != list(range(1, len(steps) + 1)):
            raise ValueError("rows lack perf/elapsed_s and do not log every step 1..N: cannot sum perf/time_step_s")
        acc, clock_of = 0.0, {}
        for r in trained:
            acc += float(r["perf/time_step_s"])
            clock_of[r["step"]] = acc
        clock = "cumsum perf/time_step_s"
    first = trained[0]["step"]
    origin = clock_of[first]
    cs, ca, ct, cn = [], [], [], []
    eval_cum = 0.0
    for r in rows:
        ev = float(r.get("perf/time_eval_s", 0.0)) if r["step"] > first else 0.0
        eval_cum += ev
        if r.get(metric) is None:
            continue
        late = r["step"] > first
        c = clock_of.get(r["step"], origin) - origin
        cs.append(int(r["step"]))
        ca.append(float(r[metric]))
        ct.append(max(c - ev, 0.0) if late else 0.0)
        cn.append(max(c - eval_cum, 0.0) if late else 0.0)
    if not cs:
        raise ValueError(f"no {metric} in the metric rows")
    end = clock_of[trained[-1]["step"]] - origin
    phases = {k: sum(float(r.get(k, 0.0)) for r in trained[1:])
              for k in ("perf/time_generate_s", "perf/time_old_logp_s", "perf/time_update_s", "async/trainer_wait_s",
                        "async/worker_generate_s", "async/weight_sync_s", "async/worker_wait_s", "async/worker_send_s",
                        "async/worker_wall_s", "perf/time_batch_s", "perf/time_publish_s", "perf/time_other_s",
                        "perf/time_step_s", "perf/time_eval_s")
              if any(k in r for r in trained)}
    return Curve(cs, ca, ct, cn, end, end - eval_cum, clock, ca[-1], eval_cum, origin, phases)


@dataclass(frozen=True)
class TTA:
    """Seconds to the target: at the first eval with accuracy >= target, else censored at the run's end.  The
    ``process`` fields are from process start (None when the run was not watched), ``cpu_s`` the CPU seconds of
    the run's process tree by then."""

    seconds: float
    seconds_no_eval: float
    reached: bool
    step: Optional[int]
    seconds_process: Optional[float] = None
    seconds_process_no_eval: Optional[float] = None
    cpu_s: Optional[float] = None


def time_to_accuracy(c: Curve, target: float) -> TTA:
    """First eval point with ``accuracy >= target``: its ``time_s`` (and ``time_no_eval_s``, and from process start
    ``time_process_s``, ``time_process_no_eval_s``, ``cpu_s``).  A run that never reaches it is censored at its end
    (``end_s``, ``end_no_eval_s``, ``end_process_s``, ...), ``reached=False``: its true time is longer."""
    if not math.isfinite(target):
        raise ValueError(f"target must be finite, got {target!r}")
    watched = len(c.time_process_s) == len(c.steps)
    for i, (s, a) in enumerate(zip(c.steps, c.accuracy)):
        if a >= target:
            if watched:
                return TTA(c.time_s[i], c.time_no_eval_s[i], True, s, c.time_process_s[i],
                           c.time_process_no_eval_s[i], c.cpu_s[i])
            return TTA(c.time_s[i], c.time_no_eval_s[i], True, s)
    if watched:
        # the end's CPU: at least the last reading of the live tree (a worker that its parent never reaps is
        # missing from the rusage total)
        seen = [x for x in c.cpu_s if x == x]
        cpu_end = max([c.cpu_end_s] + seen) if c.cpu_end_s is not None else None
        return TTA(c.end_s, c.end_no_eval_s, False, None, c.end_process_s, c.end_process_no_eval_s, cpu_end)
    return TTA(c.end_s, c.end_no_eval_s, False, None)


def default_target(final_accuracies: Sequence[float], margin: float = TARGET_MARGIN) -> float:
    """``median(final accuracies of the on-policy sync runs) − margin``."""
    if not final_accuracies:
        raise ValueError("the default target needs the sync arm's runs (run --arms with sync, or pass --target)")
    return statistics.median(final_accuracies) - margin


def gain_target(step0_accuracies: Sequence[float], gain: float) -> float:
    """``median(step-0 accuracies of every run) + gain``: the target as a rise over the accuracy before training
    (``--target-gain``; with one shared warm start every run's step-0 accuracy is the same, so no run can meet it
    at step 0 when ``gain > 0``)."""
    if not step0_accuracies:
        raise ValueError("--target-gain needs each run's step-0 evaluation (trainer.eval_every > 0 evaluates step 0)")
    if not math.isfinite(gain) or gain <= 0:
        raise ValueError(f"--target-gain must be a finite number > 0, got {gain}")
    return statistics.median(step0_accuracies) + gain


@dataclass(frozen=True)
class Ceiling:
    """What the clock from process start allows an arm against a reference when both need the same number of
    steps: ``process(N) = start-up + N * step cost`` (the cost with evaluation included), medians over runs."""

    reference: str
    arm: str
    startup_reference_s: float
    startup_arm_s: float
    step_reference_s: float         # seconds per step, evaluation included
    step_arm_s: float
    steps: int

    @property
    def at_steps(self) -> float:
        """``(S_ref + N c_ref) / (S_arm + N c_arm)`` at this job's ``N`` steps."""
        return ((self.startup_reference_s + self.steps * self.step_reference_s)
                / (self.startup_arm_s + self.steps * self.step_arm_s))

    @property
    def limit(self) -> float:
        """``c_ref / c_arm``: the ratio as ``N`` grows (start-up no longer counts)."""
        return self.step_reference_s / self.step_arm_s


def equal_steps_ceiling(reference: str, arm: str, startup: Mapping[str, Sequence[float]],
                        loop: Mapping[str, Sequence[float]], steps: int) -> Ceiling:
    """The :class:`Ceiling` of ``arm`` against ``reference`` from each arm's runs: ``startup`` (process wall minus
    the loop, s) and ``loop`` (the loop from the end of step 1 with its evaluations, s, over ``steps - 1`` steps).
    An arm can beat ``at_steps`` (and ``limit``) only by needing fewer steps to the target than the reference."""
    if steps < 2:
        raise ValueError(f"the ceiling needs a job of >= 2 steps, got {steps}")
    for name in (reference, arm):
        if not startup.get(name) or not loop.get(name):
            raise ValueError(f"the ceiling needs runs of arm {name!r}")
    per_step = {n: statistics.median(loop[n]) / (steps - 1) for n in (reference, arm)}
    return Ceiling(reference, arm, statistics.median(startup[reference]), statistics.median(startup[arm]),
                   per_step[reference], per_step[arm], steps)


def speedup(reference: Mapping[int, float], arm: Mapping[int, float]) -> Optional[Comparison]:
    """Paired speed-up of ``arm`` over ``reference`` by seed: ``reference_TTA / arm_TTA`` (> 1: the arm is sooner),
    the geometric mean over seeds with its 95% Student-t interval on the log scale
    (:func:`offpolicy_moe.report.stats.compare`, scale ``log``).  Seeds whose TTA is 0 in either (the target met
    before training) have no ratio and are left out; None when no seed is left."""
    ref = {s: v for s, v in reference.items() if v > 0 and s in arm and arm[s] > 0}
    if not ref:
        return None
    return compare(ref, {s: arm[s] for s in ref}, scale="log")


def per_seed_ratios(reference: Mapping[int, float], arm: Mapping[int, float]) -> dict[int, float]:
    """``reference[s] / arm[s]`` for every seed both have with positive times."""
    return {s: reference[s] / arm[s] for s in sorted(reference) if s in arm and reference[s] > 0 and arm[s] > 0}


@dataclass(frozen=True)
class Flow:
    """How one run's generation flowed into its trainer (steps 2..N): ``gen_tokens_per_s`` = response tokens
    generated / seconds spent generating them (the worker's decode time beside an asynchronous trainer, the
    generation phase in a one-process loop); ``idle_share`` = the share of the trainer's step wall time not spent
    on its old-log-prob pass or its update (waiting for data, or generating itself); ``lag_share[j]`` = the share
    of trained response tokens ``j`` versions behind the weights they trained (``offpolicy/lag_tokens_<j>``, every
    step). None where the run's metrics do not say (TRL logs none of them)."""

    gen_tokens_per_s: Optional[float]
    idle_share: Optional[float]
    lag_share: dict = field(default_factory=dict)


def _total(rows: Sequence[Mapping], key: str) -> Optional[float]:
    vals = [float(r[key]) for r in rows if r.get(key) is not None]
    return sum(vals) if vals else None


def flow(rows: Sequence[Mapping], rows_per_step: int) -> Flow:
    """:class:`Flow` of one run from its ``metrics.jsonl`` rows; ``rows_per_step`` = sequences a step trains
    (prompts x group), which turns ``reward/response_len`` (mean tokens a row) into tokens where no token count is
    logged."""
    train = [r for r in rows if r.get("perf/time_step_s") is not None and r.get("step") is not None]
    timed = [r for r in train if int(r["step"]) >= 2]
    gen_s = _total(timed, "async/worker_generate_s")
    if gen_s is None:
        gen_s = _total(timed, "perf/time_generate_s")
    tokens = _total(timed, "stream/worker_tokens")
    if tokens is None:
        tokens = _total(timed, "async/trained_tokens")
    if tokens is None:
        lens = _total(timed, "reward/response_len")
        tokens = None if lens is None else lens * rows_per_step
    rate = tokens / gen_s if tokens is not None and gen_s else None
    step_s = _total(timed, "perf/time_step_s")
    work = [_total(timed, k) for k in ("perf/time_old_logp_s", "perf/time_update_s")]
    idle = None
    if step_s and all(w is not None for w in work):
        idle = max(0.0, 1.0 - sum(work) / step_s)
    lags: dict[int, float] = {}
    for r in train:
        for k, v in r.items():
            m = re.fullmatch(r"offpolicy/lag_tokens_(\d+)", k)
            if m and v is not None:
                lags[int(m.group(1))] = lags.get(int(m.group(1)), 0.0) + float(v)
    total = sum(lags.values())
    share = {j: lags[j] / total for j in sorted(lags)} if total > 0 else {}
    return Flow(rate, idle, share)
