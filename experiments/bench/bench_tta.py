"""Time to accuracy: wall-clock seconds from launching the command until a held-out accuracy (greedy by default, or a
sampled one: ``--metric``) first reaches a target (issues 25, 35 and 56).

    python experiments/bench/bench_tta.py --arms trl,sync,async-k1-grpo --headline async-k1-grpo --seeds 5
    python experiments/bench/bench_tta.py --job long --arms trl,sync,async-k1-grpo --headline async-k1-grpo --seeds 5
    python experiments/bench/bench_tta.py --quick --headline sync                      # checks the machinery

**Headline arm** (``--headline``, required): one arm of ours, named on the command line before the run and marked
in the table; the last line reports it whatever the other arms do, so a best-of-N arm (a winner's curse) is never
the headline.  The last line printed: ``time to accuracy (from process start): <arm> <x>x TRL, <y>x ours sync``
(x, y: the geometric-mean paired ratios on the clock from process start; ``n/a`` where no seed has a ratio).

**Arms** (``--arms``, comma list): ``trl`` = TRL's GRPOTrainer, synchronous (experiments/bench/tta/trl_arm.py);
``sync`` = ours, ``buffer.mode=fixed buffer.staleness=0``, GRPO; ``async`` = ours with ``buffer.mode=async
rollout.workers=1`` at staleness k in {1, 2, 4} x loss in {grpo, m2po, m2po_tis, vespo, gmpo} (presets ``[grpo]``,
``[m2po]``, ``[m2po,tis]``, ``[vespo]``, ``[gmpo]``); a single one is named ``async-k2-m2po_tis``.  ``async`` is 15
arms.  ``ray-k<K>-<loss>``: the asynchronous arm with its worker a Ray actor (``rollout.backend=ray``; needs
``pip install -e ".[ray]"``).  ``fixed-k<K>-<loss>``: ours in one process, each batch trained exactly K versions
after the weights that generated it (``buffer.mode=fixed buffer.staleness=K``): an asynchronous arm's staleness
without its worker process.  The loss ``unclipped`` (no trust region) is accepted by name, never part of ``async``.
Ours run through the CLI (``python -m offpolicy_moe train ... --run-dir``) in a subprocess each; TRL in a subprocess
of this script.

**Threads** (``--threads N``, default 1): torch threads (and ``OMP_NUM_THREADS``) of trl and sync, the two
one-process arms; an asynchronous arm's trainer and worker get one each (2 cores in all).  TRL's best count is
measured before the run (1 vs 2 threads on the same job, experiments/results/tta/threads/: 2 on both jobs on the
2-core VM, 2026-11-26) and our sync arm gets the same, so the recorded runs pass ``--threads 2``.  TRL runs without gradient checkpointing (``--trl-gradient-checkpointing 0``, the default here: TRL
1.16's own default recomputes the forward in the backward, which no user of a model this size wants).

**The jobs** (``--job``): ``default`` = the embedded tiny Qwen3-MoE (2 layers, hidden 64, 8 experts, top-2) on the
default task (1-digit, 3-term sums), answers <= 2 characters + eos (``max_new_tokens=3``), SFT warm start 60 steps,
lr 3e-4, 500 steps, accuracy ``eval/accuracy`` (exact match).  ``long`` = the same model on the chain task
(``task.name=chain``, 7 one-digit terms with worked steps, ``3+8+5=`` -> ``11+5=16``; answers of 41-47 characters +
eos, ``max_new_tokens=48``), SFT warm start 400 steps, lr 3e-5 (at 1e-4 on-policy GRPO first lowers the greedy
accuracy, at 3e-4 it collapses: docs/benchmarks.md), 120 steps, evaluation every 15, accuracy ``eval/reward`` (greedy final-answer accuracy, what
the RL reward checks; ``eval/accuracy`` there is the exact match of every worked step).  ``longtail`` = the same
model on the long-tailed chain task (``task.name=longtail``: 4 to 15 one-digit terms, the number of terms drawn from
a truncated Zipf law with exponent 2, references of 11 to 224 characters with a median of 14, docs/tasks.md;
``max_new_tokens=225``) with ``task.estimate_share=0.5`` (half the warm start's demonstrations estimate the answer,
``"=20"``, instead of working it), SFT warm start 800 steps, lr 3e-5, 120 steps, evaluation every 15,
``eval/reward``: synchronous GRPO teaches the warm start, which estimates most problems at greedy decoding, to work
them out (experiments/results/tta/longtail/probes.md, sixth round, 5 seeds).  Without the estimating teacher five
rounds of probes never raised the held-out accuracy by 0.10 (best +0.09 at one evaluation): the final answer was
too loosely tied to the worked steps for the reward to teach better sums.  All three: 16
prompts x 8 samples per step, temperature 1, top-p 1, grad clip 1, 1 update per batch, fp32 generation, no routing replay,
routing and mismatch metrics off (TRL has neither), evaluation every ``--eval-every`` steps on 256 held-out
problems (plus as many training prompts, as our trainer does).

**Warm start**: once per seed, ``train`` with the SFT warm start and one RL step, checkpointing step 0 (the SFT
weights), then ``export --step 0``; every arm of that seed starts from it (``model.path=...``,
``trainer.sft_warmup_steps=0``; TRL loads it with ``load_policy``).  Its wall time is reported apart.  ``--warm-seed
N``: one warm start, seed N's, shared by every seed (the seeds then vary the RL run alone: its sampling, as in an
ablation that starts every run from one checkpoint), so the runs start from one step-0 accuracy and a warm start
that happens to begin above the target cannot decide a seed.

**Clocks** (experiments/bench/tta/clock.py): each run's command is launched and watched; every metric row is
stamped with the seconds since launch when it appears in ``metrics.jsonl`` (20 ms polling).  **From process
start** (the headline): the stamp of the first eval row at or above the target minus that evaluation (every earlier
evaluation, the step-0 one included, is charged; so are imports, model load, the asynchronous worker's start and
the first step).  **Loop** (beside it, the old clock): ``perf/elapsed_s`` from the end of the first trained step
(experiments/bench/tta/analysis.py ``curve``).  Both also without any evaluation time (in runs.json).  **CPU**: the
CPU seconds (user + system) of the run's process and its descendants (the worker) when that row appears.  A run
that never reaches the target is **censored** at its end (process wall time, total CPU) and counted in
``reached``; a censored time is a lower bound.

**Metric** (``--metric``, default the job's greedy one, above): the accuracy every clock, target and ratio is read in.
A sampled metric, ``eval/avg@N``, or ``eval/pass@K`` / ``eval/maj@K`` with ``--eval-samples N`` (N >= K for K a power
of two, N = K otherwise), sets ``eval.samples`` of every arm: ours log it at each evaluation, and the TRL child
evaluates its current weights with our trainer's sampled evaluator (``offpolicy_moe/trainer/sampled_eval.py``: the
same engine, seed and answer check); the warm start does not sample.  The sampled evaluation's seconds are part of
each evaluation's, charged as any evaluation is.  A combination that cannot log the metric is refused before any run.

**Target**: ``--target A``; or ``--target-gain G``: the median step-0 accuracy of the runs plus G (a rise over the
accuracy before training, named before the run); else the sync arm's median final accuracy over the seeds of this
invocation minus 0.03.  The headline's ratios are also given at the target -/+ 0.05 (target sensitivity).

**Ratios**: per seed, ``TTA(reference) / TTA(arm)`` (> 1: the arm is sooner) for reference ``trl`` and ``sync``;
the table gives their geometric mean with the paired 95% Student-t interval on the log scale
(offpolicy_moe/report/stats.py ``compare(scale="log")``).  Final accuracy: median over seeds, and the paired mean
difference to sync with its 95% interval.  A seed whose TTA is 0 in either arm of a pair (target met at step 0) has
no ratio (counted as ``met_at_start``).

**Seeds and order**: seeds ``--first-seed`` .. ``--first-seed + --seeds - 1``; seed-major, within the i-th seed
the arms are rotated left by i, so load drift hits every arm alike.  The load average is recorded at the start,
the end, and around every run; per-run means of a few training diagnostics (clip fraction, staleness, reward) are
kept in runs.json.

**Equal-steps ceiling** (in the table): with the medians of each arm's start-up S and loop cost c per step
(evaluation included), ``(S_ref + N c_ref) / (S_arm + N c_arm)`` at the job's N steps and its limit ``c_ref / c_arm``:
the ratio from process start the clock allows if both arms need the same number of steps to the target; an arm
beats it only by needing fewer.

**Generation and staleness** (in the table, per arm; tta/analysis.py ``flow``): generation tokens/s (response
tokens generated / seconds generating them: the worker's decode time beside an asynchronous trainer, the
generation phase in one process), the trainer's idle share (the share of its step not spent on the old-log-prob
pass or the update), and the per-token lag histogram (``offpolicy/lag_tokens_<j>``: the share of trained tokens
``j`` versions behind).

**Every arm's bound** (in the table, per arm; tta/bounds.py has the formulas): the step time the arm's parts
allow, G the generation floor, O its old-log-prob pass and U its update as the run measured them (seconds a step,
steps 2..N): sync ``G + U``; fixed-k ``G + O + U``; async and stream ``max(O + U, G)``; and ``achieved / bound``
(the run's step over it; target <= 1.2x).  G sums, over a step's decode forwards, a bare decode forward at the rows
still generating and the KV columns of that forward, read off a **decode grid** (rows x KV columns -> ms,
bench_bounds.py ``decode_ms``, bilinear between points) measured once per invocation before the first run, on the
job's model at the run's own rows and columns, for each thread count an arm generates with (``--grid-repeats``
timed forwards a cell; 0: none) and kept in the record (``decode_grids``), so ``--reanalyse`` prints it again
without measuring.  The rows alive come from each step's response length percentiles where the run records them
(``rollout/response_len_q<p>``; a lower bound of G, exact at the percentiles' ranks),
else every row at the step's mean length (``reward/response_len``; a lower bound of G); the columns from its
padded prompt width where recorded, else the task's shortest prompt.  Beside it: the trainer's idle share
(``async/trainer_wait_s`` / the step) and the worker's blocked shares (``async/worker_wait_s``,
``async/worker_send_s`` / the step with its evaluation, which the worker waits through; '—' where not recorded).

**Output** (``--out``, default experiments/results/tta/<full|long|longtail|quick>/, ``full`` for the default job):
``runs.json`` (every run: arm, seed, eval curve on every clock, TTA, phases, start-up, loads, diagnostics, flow),
``table.md`` (printed too), ``tta.png``
(accuracy against the clock from process start).  ``--reanalyse RUNS_JSON`` summarises an earlier record again
(another ``--target``) without running anything; a record from before the process clock has no process ratios.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch
import yaml

import bench_bounds
from _machine import cpu_model
from offpolicy_moe.config.load import load_config
from offpolicy_moe.models import load_policy
from offpolicy_moe.report.names import SAMPLES_KEY, logged_text, logs_sampled, sampled_metric, sampled_requirement
from offpolicy_moe.tasks import make_task
from offpolicy_moe.tasks.tokenizer import encode_texts
from tta.analysis import (TARGET_MARGIN, Arm, Curve, curve, default_target, equal_steps_ceiling, flow, gain_target,
                          parse_arms, per_seed_ratios, rotated, speedup, time_to_accuracy)
from tta.bounds import (BOUND_TARGET, RULES, ArmBound, DecodeGrid, arm_kind, generation_floor_s, grid_axes, share,
                        step_shapes)
from tta.clock import eval_seconds, process_curve, tail, watch

HERE = Path(__file__).resolve().parent
#: the repository's root (records name its files relative to it)
REPO = HERE.parent.parent
#: per-step training metrics whose run means each run records (what clipping and staleness did: issue 35, item 4)
DIAGNOSTICS = ("actor/clipfrac", "actor/clipfrac_low", "actor/clipfrac_high", "offpolicy/staleness_steps",
               "reward/mean", "reward/frac_zero_std", "actor/grad_norm", "mismatch/k3_kl")
QUICK = {"arms": "trl,sync,async-k2-m2po_tis", "seeds": 2, "steps": 200}
FULL = {"arms": "trl,sync,async", "seeds": 5}
#: the jobs (module docstring): task overrides and the defaults of --max-new-tokens, --lr, --sft-steps, --steps,
#: --eval-every, --metric
JOBS = {
    "default": {"task": [], "max_new_tokens": 3, "lr": 3e-4, "sft_steps": 60, "steps": 500, "eval_every": 25,
                "metric": "eval/accuracy"},
    "long": {"task": ["task.name=chain", "task.num_terms=7"], "max_new_tokens": 48, "lr": 3e-5, "sft_steps": 400,
             "steps": 120, "eval_every": 15, "metric": "eval/reward"},
    "longtail": {"task": ["task.name=longtail", "task.estimate_share=0.5"], "max_new_tokens": 225, "lr": 3e-5,
                 "sft_steps": 800, "steps": 120, "eval_every": 15, "metric": "eval/reward"},
}
#: target sensitivity: the headline's ratios are also reported at target -/+ this
SENSITIVITY = 0.05
#: untimed decode forwards before each cell of the decode grid (its timed ones: --grid-repeats)
GRID_WARMUP = 2


def recorded_arg(value, warm_cache: str | None):
    """An argument as the record keeps it: a path or a list of words (``argv``) through :func:`portable`, so that
    no folder of this machine is written into a result file; anything else as it is."""
    if isinstance(value, (str, Path)):
        return portable([str(value)], [warm_cache])[0]
    if isinstance(value, list) and all(isinstance(w, str) for w in value):
        return portable(value, [warm_cache])
    return value


def portable(words: list[str], scratch: list[str | Path | None]) -> list[str]:
    """A command as the record keeps it, with no path of this machine in it: the interpreter as ``python``, paths in
    the repository relative to its root and every ``scratch`` folder (the run's temporary folder, --warm-cache) as
    ``<tmp>``."""
    places = [(str(Path(d).resolve()), "<tmp>") for d in scratch if d] + [(str(Path(d)), "<tmp>") for d in scratch if d]
    places += [(f"{REPO}/", ""), (str(REPO), ".")]
    out = []
    for word in words:
        word = "python" if word == sys.executable else str(word)
        for path, label in places:
            word = word.replace(path, label)
        out.append(word)
    return out


def job_overrides(args, seed: int, warm: str | None, threads: int = 1) -> list[str]:
    """The job every arm trains (module docstring), as trainer overrides; ``warm``: the warm-start folder;
    ``threads``: the trainer's torch threads (``--threads`` for trl and sync, 1 for the asynchronous arms); with a
    sampled ``--metric``, ``eval.samples`` (``--eval-samples``)."""
    out = [*JOBS[getattr(args, "job", "default")]["task"], f"seed={seed}", f"rollout.prompts_per_step={args.prompts}", f"rollout.group_size={args.group}",
           f"rollout.max_new_tokens={args.max_new_tokens}", "rollout.temperature=1.0", "rollout.top_p=1.0",
           "rollout.dtype=float32", f"optim.lr={args.lr}", "optim.grad_clip=1.0", "optim.scheduler=constant",
           "trainer.updates_per_step=1", f"trainer.steps={args.steps}", f"trainer.eval_every={args.eval_every}",
           f"task.eval_size={args.eval_size}", f"trainer.threads={threads}", "trainer.checkpoint_every=0",
           "trainer.export_final=false", "logging.loggers=[jsonl]", "logging.progress=false",
           "algo.routing.replay=none", "algo.routing.metrics=false", "trainer.mismatch_metrics=false"]
    if warm is not None:
        out += [f"model.path={warm}", "trainer.sft_warmup_steps=0"]
    if getattr(args, "eval_samples", None):      # a sampled --metric: every arm samples the held-out problems
        out.append(f"{SAMPLES_KEY}={args.eval_samples}")
    return out


def _env(threads: int = 1) -> dict:
    return dict(os.environ, OMP_NUM_THREADS=str(threads), WANDB_MODE="disabled", HF_HUB_OFFLINE="1",
                TOKENIZERS_PARALLELISM="false")


def arm_threads(args, arm: Arm) -> int:
    """Torch threads of the arm's trainer: ``--threads`` for trl and our synchronous arms (one process), 1 for an
    asynchronous arm (its trainer and its worker get one each)."""
    return 1 if arm.mode in ("async", "stream") else args.threads


def _call(cmd: list[str], what: str) -> float:
    """Run ``cmd``; its wall seconds; RuntimeError with the output's tail when it fails."""
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=_env())
    if r.returncode != 0:
        raise RuntimeError(f"{what} failed (rc={r.returncode}): {' '.join(cmd)}\n{r.stdout[-2000:]}\n"
                           f"{r.stderr[-4000:]}")
    return time.perf_counter() - t0


def warm_start(args, seed: int, work: Path) -> tuple[str, float]:
    """The SFT warm start of ``seed`` as a Hugging Face folder (module docstring); its path and wall seconds."""
    run, out = work / f"sft-{seed}", work / f"warm-{seed}"
    base = [o for o in job_overrides(args, seed, None)      # the warm start needs no sampled evaluation
            if not o.startswith(("trainer.steps=", "trainer.checkpoint", f"{SAMPLES_KEY}="))]
    base += list(getattr(args, "model", ()))     # model.* overrides of the preset (a probe of another model size)
    base += list(getattr(args, "task_set", ()))  # task.* overrides of the job (a probe of another task law)
    wall = _call([sys.executable, "-m", "offpolicy_moe", "train", "--quiet", "--run-dir", str(run), *base,
                  "trainer.steps=1", "trainer.checkpoint_every=1", "trainer.keep_checkpoints=0",
                  f"trainer.sft_warmup_steps={args.sft_steps}"], f"warm start of seed {seed}")
    wall += _call([sys.executable, "-m", "offpolicy_moe", "export", str(run), str(out), "--step", "0"],
                  f"export of seed {seed}'s warm start")
    return str(out), wall


def run_arm(args, arm: Arm, seed: int, warm: str, work: Path) -> dict:
    """One run of ``arm`` from the warm start, watched from its launch (tta/clock.py); its eval curve (loop clock
    and process clock), TTA inputs and timings."""
    run_dir = work / f"{arm.name}-{seed}"
    threads = arm_threads(args, arm)
    common = job_overrides(args, seed, warm, threads)
    load0 = os.getloadavg()
    if arm.system == "trl":
        cmd = [sys.executable, str(HERE / "bench_tta.py"), "--trl-child", str(run_dir),
               "--trl-gradient-checkpointing", str(args.trl_gradient_checkpointing),
               "--trl-experts-implementation", args.trl_experts_implementation,
               *[w for o in args.trl_option for w in ("--trl-option", o)], "--", *common, "preset=[grpo]"]
    else:
        cmd = [sys.executable, "-m", "offpolicy_moe", "train", "--quiet", "--run-dir", str(run_dir), *common,
               *arm.overrides(), *args.set]
    run_dir.mkdir(parents=True, exist_ok=True)
    w = watch(cmd, run_dir / "metrics.jsonl", env=_env(threads), log=work / f"{arm.name}-{seed}.log",
              eval_key=args.metric)
    if w.returncode != 0:
        raise RuntimeError(f"arm {arm.name} seed {seed} failed (rc={w.returncode}): {' '.join(cmd)}\n"
                           f"{tail(work / f'{arm.name}-{seed}.log')}")
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    if not any(r.get(args.metric) is not None for r in rows):
        raise RuntimeError(f"arm {arm.name} seed {seed} logged no {args.metric} "
                           f"{logged_text(args.metric, {k for r in rows for k in r})}")
    c = curve(rows, args.metric)
    c = Curve(**{**c.__dict__, **process_curve(c.steps, eval_seconds(rows), w.seen_s, w.cpu_s, w.wall_s,
                                              w.cpu_total_s)})
    diag = {k: statistics.fmean(float(r[k]) for r in rows if r.get(k) is not None)
            for k in DIAGNOSTICS if any(r.get(k) is not None for r in rows)}
    fair = {}
    if arm.system == "trl" and (run_dir / "fairness.json").exists():
        fair = json.loads((run_dir / "fairness.json").read_text())
    return {"arm": arm.name, "seed": seed, "threads": threads, "curve": c.__dict__, "process_wall_s": w.wall_s,
            "cpu_total_s": w.cpu_total_s, "settle_s": w.settle_s, "startup_s": w.wall_s - c.end_s,
            "s_per_step": c.end_no_eval_s / max(args.steps - 1, 1), "load_before": load0,
            "load_after": os.getloadavg(), "fairness": fair, "diagnostics": diag,
            "flow": flow(rows, args.prompts * args.group).__dict__, "shapes": step_shapes(rows),
            "command": portable(cmd, [work, getattr(args, "warm_cache", None)])}


def measure_grids(args, arms: list[Arm]) -> dict:
    """The decode grid (tta/bounds.py) of this invocation, measured once before its first run: the job's model
    (random weights of the warm start's shape, float32, as the runs generate) on every thread count an arm of ours
    generates with (:func:`arm_threads`: ``--threads`` in one process, 1 in a worker), at the run's own rows (1, 2,
    4, ... up to prompts x group) and KV columns (the task's shortest padded prompt to its longest plus
    ``--max-new-tokens - 2``), each cell the median of ``--grid-repeats`` bare decode forwards
    (bench_bounds.py ``decode_ms``).  ``{}`` with ``--grid-repeats 0`` or no arm of ours."""
    threads = sorted({arm_threads(args, a) for a in arms if a.system == "ours"})
    if not threads or args.grid_repeats == 0:
        return {}
    overrides = [*job_overrides(args, args.first_seed, None), *getattr(args, "model", ()),
                 *getattr(args, "task_set", ())]
    cfg = load_config(overrides=overrides)
    task = make_task(cfg.task)
    model, tok = load_policy(cfg.model, seed=0, task=task)
    model = model.float().eval()
    widths = [len(ids) for ids in encode_texts(tok, task.train_prompts, add_bos=True)]
    rows_per_step = args.prompts * args.group
    rows, columns = grid_axes(rows_per_step, min(widths), max(widths), args.max_new_tokens)
    grids, before = {}, torch.get_num_threads()
    try:
        for n in threads:
            torch.set_num_threads(n)
            t0, load0 = time.perf_counter(), os.getloadavg()
            ms = [[bench_bounds.decode_ms(model, r, c, args.grid_repeats, GRID_WARMUP, lean=True) for c in columns]
                  for r in rows]
            grids[str(n)] = {**DecodeGrid(tuple(rows), tuple(columns), tuple(map(tuple, ms)), n).to_dict(),
                             "seconds": time.perf_counter() - t0, "load_before": load0, "load_after": os.getloadavg()}
    finally:
        torch.set_num_threads(before)
    print(f"decode grid: {len(rows)} rows x {len(columns)} KV columns on {', '.join(map(str, threads))} thread(s), "
          f"{sum(g['seconds'] for g in grids.values()):.1f} s", flush=True)
    return {"grids": grids, "rows_per_step": rows_per_step, "prompt_columns": [min(widths), max(widths)],
            "max_new_tokens": args.max_new_tokens, "repeats": args.grid_repeats, "warmup": GRID_WARMUP,
            "dtype": "float32", "cpu": cpu_model(), "torch": torch.__version__}


def _fmt_cmp(cmp) -> str:
    if cmp is None:
        return "n/a"
    if cmp.lo is None:
        return f"{cmp.estimate:.2f}x (n={cmp.n})"
    return f"{cmp.estimate:.2f}x [{cmp.lo:.2f}, {cmp.hi:.2f}]"


#: the clocks a TTA is measured on: (summary key suffix, TTA attribute); the headline is ``process``
CLOCKS = (("process", "seconds_process"), ("process_no_eval", "seconds_process_no_eval"), ("loop", "seconds"),
          ("loop_no_eval", "seconds_no_eval"), ("cpu", "cpu_s"))


def _cmp_dict(cmp) -> dict | None:
    return None if cmp is None else {"estimate": cmp.estimate, "lo": cmp.lo, "hi": cmp.hi, "n": cmp.n,
                                     "text": _fmt_cmp(cmp)}


def summarise(runs: list[dict], arms: list[Arm], target: float) -> dict:
    """Per arm: TTA on every clock of :data:`CLOCKS` (median), reached count, paired ratios against trl and sync on
    each clock, final accuracy (module docstring).  A clock a run lacks (a record from before the process clock)
    is left out."""
    from offpolicy_moe.report.stats import compare

    tta: dict[str, dict[int, object]] = {a.name: {} for a in arms}
    final: dict[str, dict[int, float]] = {a.name: {} for a in arms}
    for r in runs:
        c = Curve(**r["curve"])
        t = time_to_accuracy(c, target)
        r["tta"] = t.__dict__
        tta[r["arm"]][r["seed"]] = t
        final[r["arm"]][r["seed"]] = c.final_accuracy
    out = {}
    for a in arms:
        ts = tta[a.name]
        mine = [r for r in runs if r["arm"] == a.name]
        row = {"runs": len(ts), "reached": sum(t.reached for t in ts.values()),
               "met_at_start": sum(t.reached and t.step == 0 for t in ts.values()),
               "threads": mine[0].get("threads", 1) if mine else None,
               "median_final_accuracy": statistics.median(final[a.name].values()),
               "median_startup_s": statistics.median(r["startup_s"] for r in mine),
               "median_s_per_step": statistics.median(r["s_per_step"] for r in mine),
               "median_first_step_s": statistics.median(r["curve"]["first_step_s"] for r in mine)}
        for key, attr in CLOCKS:
            vals = [getattr(t, attr) for t in ts.values() if getattr(t, attr) is not None]
            vals = [v for v in vals if v == v]
            row[f"median_tta_{key}_s"] = statistics.median(vals) if vals else None
        row["median_tta_s"], row["median_tta_no_eval_s"] = row["median_tta_loop_s"], row["median_tta_loop_no_eval_s"]
        for ref in ("trl", "sync"):
            if ref in tta and ref != a.name:
                for key, attr in CLOCKS:
                    # a seed whose target was met before training (step 0) in either arm has no ratio on any
                    # clock: from process start it would only compare start-ups
                    rv = {s: getattr(t, attr) for s, t in tta[ref].items()
                          if getattr(t, attr) is not None and t.step != 0}
                    av = {s: getattr(t, attr) for s, t in ts.items() if getattr(t, attr) is not None and t.step != 0}
                    rv = {s: v for s, v in rv.items() if v == v}
                    av = {s: v for s, v in av.items() if v == v}
                    row[f"vs_{ref}_{key}"] = _cmp_dict(speedup(rv, av))
                    row[f"vs_{ref}_{key}_per_seed"] = per_seed_ratios(rv, av)
                row[f"vs_{ref}"], row[f"vs_{ref}_no_eval"] = row[f"vs_{ref}_loop"], row[f"vs_{ref}_loop_no_eval"]
        if "sync" in final and a.name != "sync" and final["sync"]:
            d = compare(final[a.name], final["sync"])
            row["final_minus_sync"] = {"estimate": d.estimate, "lo": d.lo, "hi": d.hi, "n": d.n}
        out[a.name] = row
    return out


def table(summary: dict, target: float, clock: str, headline: str | None = None) -> str:
    """The markdown table: per arm, TTA from process start (the headline clock) and loop-only, CPU seconds,
    ratios (> 1: sooner than the reference), final accuracy; the pre-registered ``headline`` arm marked."""
    def cmp(row, key):
        v = row.get(key)
        return v["text"] if v else "—"

    def sec(v):
        return "—" if v is None else f"{v:.1f}"

    def diff(row):
        d = row.get("final_minus_sync")
        if not d:
            return "—"
        return f"{d['estimate']:+.3f}" + (f" [{d['lo']:+.3f}, {d['hi']:+.3f}]" if d["lo"] is not None else "")

    lines = [f"target accuracy {target:.3f}; loop clock {clock}; TTA = time of the first evaluation at or above the "
             "target, earlier evaluations charged; **from process start** = from the launch of the command (imports, "
             "model load, worker start, step-0 evaluation, first step: all charged); loop = from the end of step 1; "
             "CPU = CPU seconds of the run's processes by then; censored runs count at their end; ratios > 1: sooner "
             "than the reference, geometric mean of paired per-seed ratios [95%]",
             "",
             "| arm | threads | reached | TTA from process start s | vs TRL [95%] | vs sync [95%] | TTA loop s | "
             "loop vs TRL | loop vs sync | CPU s to target | CPU vs sync | final acc (median) | final − sync [95%] | "
             "s/step | start-up s |", "|" + " --- |" * 15]
    for name, r in summary.items():
        label = f"**{name}** (pre-registered)" if name == headline else name
        lines.append(f"| {label} | {r.get('threads', '—')} | {r['reached']}/{r['runs']} | "
                     f"{sec(r.get('median_tta_process_s'))} | {cmp(r, 'vs_trl_process')} | "
                     f"{cmp(r, 'vs_sync_process')} | {sec(r.get('median_tta_loop_s'))} | {cmp(r, 'vs_trl_loop')} | "
                     f"{cmp(r, 'vs_sync_loop')} | {sec(r.get('median_tta_cpu_s'))} | {cmp(r, 'vs_sync_cpu')} | "
                     f"{r['median_final_accuracy']:.3f} | {diff(r)} | {r['median_s_per_step']:.3f} | "
                     f"{r['median_startup_s']:.1f} |")
    return "\n".join(lines)


def sensitivity(runs: list[dict], arms: list[Arm], target: float, headline: str,
                margin: float = SENSITIVITY) -> str:
    """The headline arm's ratios from process start at ``target - margin``, ``target``, ``target + margin``."""
    lines = [f"target sensitivity ({headline}, from process start):", "",
             "| target | reached (arm) | reached (trl) | reached (sync) | vs TRL [95%] | vs sync [95%] |",
             "| --- | --- | --- | --- | --- | --- |"]
    for t in (target - margin, target, target + margin):
        summ = summarise([dict(r) for r in runs], arms, t)
        h = summ.get(headline, {})

        def reached(name):
            x = summ.get(name)
            return f"{x['reached']}/{x['runs']}" if x else "—"

        def cmp(key):
            v = h.get(key)
            return v["text"] if v else "—"

        lines.append(f"| {t:.3f} | {reached(headline)} | {reached('trl')} | {reached('sync')} | "
                     f"{cmp('vs_trl_process')} | {cmp('vs_sync_process')} |")
    return "\n".join(lines)


def plot(runs: list[dict], arms: list[Arm], target: float, path: Path, metric: str = "eval/accuracy") -> None:
    """``metric`` (the record's accuracy) against the clock from process start (the loop clock for a record without
    it; earlier evaluations charged), thin per run, bold median per arm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    cmap = plt.get_cmap("tab10")
    for i, a in enumerate(arms):
        mine = [r["curve"] for r in runs if r["arm"] == a.name]
        color = cmap(i % 10)
        key = "time_process_s" if all(c.get("time_process_s") for c in mine) else "time_s"
        for c in mine:
            ax.plot(c[key], c["accuracy"], color=color, alpha=0.25, lw=0.8)
        n = min(len(c[key]) for c in mine)
        xs = [statistics.median(c[key][j] for c in mine) for j in range(n)]
        ys = [statistics.median(c["accuracy"][j] for c in mine) for j in range(n)]
        ax.plot(xs, ys, color=color, lw=2, label=a.name)
    ax.axhline(target, color="k", ls="--", lw=1, label=f"target {target:.3f}")
    ax.set_xlabel("wall-clock seconds from process start (earlier evaluations charged)")
    ax.set_ylabel(f"held-out {metric}")
    ax.set_title("time to accuracy (median over seeds bold)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


PHASES = (("generate", "perf/time_generate_s"), ("old-logp pass", "perf/time_old_logp_s"),
          ("update", "perf/time_update_s"), ("trainer wait", "async/trainer_wait_s"),
          ("worker generate (beside)", "async/worker_generate_s"), ("weight publish", "async/weight_sync_s"),
          ("unaccounted", "perf/time_other_s"))


def phase_table(runs: list[dict], arms: list[Arm], steps: int) -> str:
    """Where a step goes: per arm, the median over runs of each phase's seconds per timed step (steps 2..N, the
    run's sums / (N - 1)) and of the whole step without evaluation; ``generate share`` = generation / step (sync: in
    the trainer's process; async: the worker's generation beside the trainer, over the trainer's step)."""
    lines = ["phase breakdown (median over runs of seconds per step, steps 2..N, evaluation excluded):", "",
             "| arm | " + " | ".join(name for name, _ in PHASES) + " | whole step | generate share |",
             "|" + " --- |" * (len(PHASES) + 3)]
    n = max(steps - 1, 1)
    for a in arms:
        mine = [r for r in runs if r["arm"] == a.name]
        if not mine:
            continue
        cells = []
        for _, key in PHASES:
            vals = [r["curve"].get("phases", {}).get(key) for r in mine]
            vals = [v / n for v in vals if v is not None]
            cells.append(f"{statistics.median(vals):.4f}" if vals else "—")
        step = statistics.median(r["s_per_step"] for r in mine)
        gen_key = "async/worker_generate_s" if a.mode in ("async", "stream") else "perf/time_generate_s"
        gens = [r["curve"].get("phases", {}).get(gen_key) for r in mine]
        gens = [g / n for g in gens if g is not None]
        share = f"{statistics.median(gens) / step:.0%}" if gens and step > 0 else "—"
        lines.append(f"| {a.name} | " + " | ".join(cells) + f" | {step:.4f} | {share} |")
    return "\n".join(lines)


def flow_table(runs: list[dict], arms: list[Arm]) -> str:
    """Per arm, the medians over runs of :func:`tta.analysis.flow`: generation tokens/s, the trainer's idle share,
    and the per-token lag histogram (shares of trained tokens 0, 1, ... versions behind); empty when no run has
    them."""
    if not any(r.get("flow") for r in runs):
        return ""
    lines = ["generation and staleness (median over runs, steps 2..N; idle = the share of the trainer's step not "
             "spent on its old-log-prob pass or update; lag j = the share of trained tokens j versions behind):", "",
             "| arm | generation tokens/s | trainer idle share | per-token lag histogram |", "| --- | --- | --- | --- |"]
    for a in arms:
        mine = [r["flow"] for r in runs if r["arm"] == a.name and r.get("flow")]
        if not mine:
            continue
        rate = [f["gen_tokens_per_s"] for f in mine if f.get("gen_tokens_per_s") is not None]
        idle = [f["idle_share"] for f in mine if f.get("idle_share") is not None]
        shares = [{int(j): float(v) for j, v in (f.get("lag_share") or {}).items()} for f in mine]
        lags = sorted({j for sh in shares for j in sh})
        hist = ", ".join(f"{j}: {statistics.median(sh.get(j, 0.0) for sh in shares):.0%}" for j in lags)
        lines.append(f"| {a.name} | " + (f"{statistics.median(rate):.0f}" if rate else "—") + " | "
                     + (f"{statistics.median(idle):.0%}" if idle else "—") + f" | {hist or '—'} |")
    return "\n".join(lines)


def ceiling_table(runs: list[dict], headline: str, steps: int) -> str:
    """What the clock from process start allows the headline against trl and sync if all need the same steps
    (tta/analysis.py ``equal_steps_ceiling``): the ratio at this job's steps and its limit as the run grows; the
    headline exceeds them only by reaching the target in fewer steps."""
    startup = {r["arm"]: [] for r in runs}
    loop = {r["arm"]: [] for r in runs}
    for r in runs:
        startup[r["arm"]].append(r["startup_s"])
        loop[r["arm"]].append(r["curve"]["end_s"])
    lines = [f"equal-steps ceiling ({headline}, from process start; medians over runs; per-step cost with evaluation "
             "included): the ratio the clock allows if both arms need the same number of steps", "",
             "| reference | start-up s (ref / arm) | s per step (ref / arm) | ratio at "
             f"{steps} steps | limit as steps grow |", "| --- | --- | --- | --- | --- |"]
    for ref in ("trl", "sync"):
        if ref == headline or ref not in loop or headline not in loop:
            continue
        c = equal_steps_ceiling(ref, headline, startup, loop, steps)
        lines.append(f"| {ref} | {c.startup_reference_s:.1f} / {c.startup_arm_s:.1f} | {c.step_reference_s:.3f} / "
                     f"{c.step_arm_s:.3f} | {c.at_steps:.2f}x | {c.limit:.2f}x |")
    return "\n".join(lines)


def split_table(runs: list[dict], arms: list[Arm], target: float, headline: str) -> str:
    """The headline's speed-up over sync on the clock from process start, split in two paired ratios by seed: over
    the one-process arm of the same staleness and loss (``fixed-k<K>-<loss>``: what the system buys, i.e. the
    worker process, streaming, updates in flight) and that arm over sync (what the stale objective buys).  Empty when
    the headline is not asynchronous or streaming, or its fixed arm did not run."""
    by_name = {a.name: a for a in arms}
    h = by_name.get(headline)
    if h is None or h.mode not in ("async", "stream"):
        return ""
    fixed = f"fixed-k{h.staleness}-{h.loss}"
    if fixed not in by_name or "sync" not in by_name:
        return ""
    tta: dict[str, dict[int, float]] = {}
    for r in runs:
        t = time_to_accuracy(Curve(**r["curve"]), target)
        if t.seconds_process is not None and t.seconds_process == t.seconds_process and t.step != 0:
            tta.setdefault(r["arm"], {})[r["seed"]] = t.seconds_process
    lines = ["split of the headline's time to accuracy (from process start; paired ratios by seed, geometric mean "
             "[95%]; censored runs at their end)", "",
             "| ratio | what it measures | estimate [95%] | seeds |", "| --- | --- | --- | --- |"]
    for ref, arm, what in ((fixed, headline, "the system's share (same staleness and loss, one process vs this)"),
                           ("sync", fixed, "the objective's share (stale batches at k vs on-policy, one process)"),
                           ("sync", headline, "both (the headline vs sync)")):
        cmp = speedup(tta.get(ref, {}), tta.get(arm, {}))
        lines.append(f"| {arm} / {ref} | {what} | {_fmt_cmp(cmp)} | {cmp.n if cmp else 0} |")
    return "\n".join(lines)


def run_bound(run: dict, arm: Arm, grids: dict, steps: int) -> Optional[dict]:
    """One run's bound (tta/bounds.py :class:`ArmBound`) and the shares beside it, seconds a step (steps 2..N: the
    phase sums over ``steps - 1``): the generation floor from the run's step shapes on the grid of the threads it
    generated with, its old-log-prob pass and update as measured, the achieved step; the measured generation, the
    trainer's idle share (``async/trainer_wait_s`` / the achieved step) and the worker's blocked shares
    (``async/worker_wait_s`` and ``async/worker_send_s`` / the step with its evaluation, ``curve.end_s / (steps -
    1)``: the worker blocks through the trainer's evaluations too; None where not recorded).  None for TRL, a run
    without step shapes or an update time, or a record without the grid of the run's threads."""
    kind = arm_kind(arm.system, arm.mode, arm.staleness)
    grid = (grids.get("grids") or {}).get(str(run.get("threads", 1)))
    phases = (run.get("curve") or {}).get("phases") or {}
    if kind is None or grid is None or not run.get("shapes") or phases.get("perf/time_update_s") is None:
        return None
    n = max(steps - 1, 1)
    floor_s, source = generation_floor_s(DecodeGrid.from_dict(grid), run["shapes"], int(grids["rows_per_step"]),
                                         int(grids["prompt_columns"][0]))
    b = ArmBound(kind, floor_s, phases.get("perf/time_old_logp_s", 0.0) / n, phases["perf/time_update_s"] / n,
                 run["s_per_step"])
    per_step = {k: (phases[k] / n if k in phases else None)
                for k in ("async/worker_generate_s", "perf/time_generate_s", "async/trainer_wait_s",
                          "async/worker_wait_s", "async/worker_send_s")}
    generated = per_step["async/worker_generate_s" if kind in ("async", "stream") else "perf/time_generate_s"]
    with_eval = run["curve"].get("end_s")           # the worker waits through the trainer's evaluations too
    worker_step = with_eval / n if with_eval else b.achieved_s
    return {"bound": b, "source": source, "generation_measured_s": generated,
            "trainer_idle": share(per_step["async/trainer_wait_s"], b.achieved_s),
            "worker_wait": share(per_step["async/worker_wait_s"], worker_step),
            "worker_send": share(per_step["async/worker_send_s"], worker_step)}


def grid_note(grids: dict) -> str:
    """One line on the record's decode grids: their shape, and per thread count the seconds the measurement took
    and the load average (1 min) before and after it (a loaded machine's grid is slower, its fractions lower)."""
    parts = []
    for n, g in sorted(grids["grids"].items(), key=lambda kv: int(kv[0])):
        load = [g.get("load_before"), g.get("load_after")]
        when = f", {g['seconds']:.1f} s" if g.get("seconds") is not None else ""
        when += f", load {load[0][0]:.2f} -> {load[1][0]:.2f}" if all(x is not None for x in load) else ""
        rows, cols = g["rows"], g["columns"]
        parts.append(f"{n} thread(s): {len(rows)} rows {rows[0]}..{rows[-1]} x {len(cols)} KV columns "
                     f"{cols[0]}..{cols[-1]}{when}")
    return "decode grid (measured before the runs): " + "; ".join(parts)


def bound_table(runs: list[dict], arms: list[Arm], grids: dict, steps: int) -> str:
    """Every arm's bound (tta/bounds.py): per arm, the medians over its runs (:func:`run_bound`) of the generation
    floor G, the measured generation, the old-log-prob pass O, the update U, the bound, the achieved step and
    ``achieved / bound``, the trainer's idle share and the worker's blocked shares ('—' where the run records
    none); empty when the record has no decode grid (a record from before it, or ``--grid-repeats 0``)."""
    if not grids.get("grids"):
        return ""

    def med(xs: list, fmt: str) -> str:
        xs = [x for x in xs if x is not None]
        return format(statistics.median(xs), fmt) if xs else "—"

    lines = [f"every arm's bound (medians over runs, seconds a step, steps 2..N, evaluation excluded; G = the "
             f"generation floor: the sum over the step's decode forwards of the bare decode grid at the rows alive "
             f"and the KV columns of each, bilinear between measured points; O, U = the old-log-prob pass and the "
             f"update as measured; trainer idle = its wait for a batch / the achieved step; worker blocked = its "
             f"wait at the staleness bound or on sending results / the step with evaluation (it blocks through the "
             f"trainer's evaluations too); G from `lengths`: each step's "
             f"response length percentiles (a lower bound), `mean length`: every row at the step's mean length, a lower bound of G; "
             f"the padded prompt width where recorded, else the task's shortest, "
             f"{grids['prompt_columns'][0]} columns; target achieved / bound <= {BOUND_TARGET}x):", "",
             grid_note(grids), "",
             "| arm | bound | G floor | generation measured | O | U | bound s | achieved s | achieved / bound | "
             "trainer idle | worker blocked (staleness wait) | worker blocked (send) | G from |",
             "|" + " --- |" * 13]
    over = []
    for a in arms:
        got = [b for b in (run_bound(r, a, grids, steps) for r in runs if r["arm"] == a.name) if b is not None]
        if not got:
            if any(r["arm"] == a.name for r in runs):
                lines.append(f"| {a.name} | — |" + " — |" * 11)
            continue
        bs = [g["bound"] for g in got]
        frac = statistics.median(b.fraction for b in bs)
        over += [a.name] if frac > BOUND_TARGET else []
        lines.append(f"| {a.name} | {RULES[bs[0].kind]} | {med([b.generation_s for b in bs], '.4f')} | "
                     f"{med([g['generation_measured_s'] for g in got], '.4f')} | "
                     f"{med([b.old_logp_s for b in bs], '.4f')} | {med([b.update_s for b in bs], '.4f')} | "
                     f"{med([b.bound_s for b in bs], '.4f')} | {med([b.achieved_s for b in bs], '.4f')} | "
                     f"{frac:.2f}x | {med([g['trainer_idle'] for g in got], '.0%')} | "
                     f"{med([g['worker_wait'] for g in got], '.0%')} | "
                     f"{med([g['worker_send'] for g in got], '.0%')} | "
                     f"{' / '.join(sorted({g['source'] for g in got}))} |")
    lines.append("")
    lines.append(f"above {BOUND_TARGET}x of the bound: {', '.join(over)}" if over
                 else f"every arm with a bound is within {BOUND_TARGET}x of it")
    return "\n".join(lines)


def headline_line(summary: dict, headline: str) -> str:
    """``time to accuracy (from process start): <arm> <x>x TRL, <y>x ours sync``: the pre-registered arm's geometric
    mean paired ratios on the clock from process start (``n/a`` where a ratio has no seed)."""
    r = summary.get(headline)
    if r is None:
        return f"time to accuracy (from process start): {headline} did not run"

    def x(key):
        v = r.get(key)
        return f"{v['estimate']:.2f}x" if v else ("1.00x" if key == "vs_sync_process" and headline == "sync" else "n/a")

    return f"time to accuracy (from process start): {headline} {x('vs_trl_process')} TRL, {x('vs_sync_process')} ours sync"


def parse_args(argv=None) -> argparse.Namespace:
    from bench_vs_trl import add_trl_args

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--job", default="default", choices=tuple(JOBS),
                   help="default: 3-term sums, answers <= 3 tokens; long: sums with worked steps (task.name=chain), "
                        "answers of 30-50 tokens, generation most of a step")
    p.add_argument("--arms", default=None, help=f"comma list (default {FULL['arms']}; --quick {QUICK['arms']})")
    p.add_argument("--headline", default=None, metavar="ARM",
                   help="the pre-registered headline arm (one of ours among --arms), named before the run: the "
                        "last line and the table's marked row report it, whatever the other arms do")
    p.add_argument("--seeds", type=int, default=None, help=f"seeds per arm (default {FULL['seeds']})")
    p.add_argument("--first-seed", type=int, default=0,
                   help="seeds are first-seed .. first-seed + seeds - 1 (held-out seeds: a fresh range)")
    p.add_argument("--target", type=float, default=None,
                   help=f"target accuracy (default: sync's median final accuracy - {TARGET_MARGIN})")
    p.add_argument("--target-gain", type=float, default=None, metavar="G",
                   help="target = the runs' median step-0 accuracy + G (a rise over the start; not with --target)")
    p.add_argument("--warm-seed", type=int, default=None, metavar="N",
                   help="one SFT warm start (seed N's) shared by every seed; default: each seed its own")
    p.add_argument("--quick", action="store_true", help=f"{QUICK}")
    p.add_argument("--steps", type=int, default=None, help="trained steps per run (default: the job's)")
    p.add_argument("--eval-every", type=int, default=None, help="default: the job's")
    p.add_argument("--eval-size", type=int, default=256, help="task.eval_size (held-out problems)")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=None, help="default: the job's")
    p.add_argument("--lr", type=float, default=None, help="default: the job's")
    p.add_argument("--sft-steps", type=int, default=None, help="SFT warm-start steps (default: the job's)")
    p.add_argument("--metric", default=None,
                   help="the accuracy the target is set on and reached in (default: the job's; eval/accuracy = "
                        "greedy exact match, eval/reward = the task's reward, the final answer's on long; a sampled "
                        "metric eval/avg@N, eval/pass@K or eval/maj@K: every arm, TRL's too, samples the held-out "
                        "problems with eval.samples = --eval-samples)")
    p.add_argument("--eval-samples", type=int, default=None, metavar="N",
                   help="held-out samples per problem of a sampled --metric (eval.samples of every arm); default: the "
                        "N of eval/avg@N; required for eval/pass@K and eval/maj@K")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads of trl and sync (one process each; measure TRL's best first, see the "
                        "docstring); an asynchronous arm's trainer and worker have one each")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra override for our arms")
    p.add_argument("--grid-repeats", type=int, default=10, metavar="N",
                   help="timed decode forwards a cell of the decode grid (measured once, before the runs; every "
                        "arm's bound); 0: no grid, no bound table")
    p.add_argument("--out", default=None,
                   help="output folder (default experiments/results/tta/<full|quick|long|longtail>)")
    p.add_argument("--warm-cache", default=None, metavar="DIR",
                   help="keep each seed's SFT warm start here and reuse it (invocations on the same seeds share it)")
    p.add_argument("--reanalyse", default=None, metavar="RUNS_JSON",
                   help="no runs: summarise the runs of an earlier runs.json again (e.g. with another --target), "
                        "into --out or its folder")
    add_trl_args(p)
    p.set_defaults(trl_gradient_checkpointing=0)    # TRL at its best for a model this size (issue 35)
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.out_given, args.metric_given = args.out, args.metric
    if args.reanalyse is not None and not Path(args.reanalyse).is_file():
        p.error(f"--reanalyse {args.reanalyse!r}: no such file")
    preset = QUICK if args.quick else FULL
    for k, v in {**{k: v for k, v in JOBS[args.job].items() if k != "task"}, **preset}.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    try:
        args.arm_list = parse_arms(args.arms)
    except ValueError as exc:
        p.error(str(exc))
    names = [a.name for a in args.arm_list]
    problem = range_problem(args) or metric_problem(args)
    if problem:
        p.error(problem)
    try:
        trl_options(args.trl_option)      # a misspelt TRL option stops here, before any run
    except ValueError as exc:
        p.error(str(exc))
    if args.reanalyse is None:
        if args.headline is None:
            p.error("--headline ARM is required: name the pre-registered arm before the run (one of ours in --arms)")
        if args.headline not in names or args.headline == "trl":
            p.error(f"--headline {args.headline!r} must be one of our arms among --arms ({', '.join(names)})")
    default_out = "quick" if args.quick else ("full" if args.job == "default" else args.job)
    args.out = Path(args.out or HERE.parent / "results" / "tta" / default_out)
    return args


def range_problem(args: argparse.Namespace) -> Optional[str]:
    """The first numeric option out of its range, or options that contradict each other (two target rules, no target
    rule without the sync arm), in one line; None when there is none."""
    for key in ("seeds", "steps", "eval_every", "eval_size", "prompts", "group", "max_new_tokens", "sft_steps",
                "threads"):
        if getattr(args, key) < (0 if key == "sft_steps" else 1):
            return f"--{key.replace('_', '-')} must be >= {0 if key == 'sft_steps' else 1}, got {getattr(args, key)}"
    if args.first_seed < 0:
        return f"--first-seed must be >= 0, got {args.first_seed}"
    if args.grid_repeats < 0:
        return f"--grid-repeats must be >= 0, got {args.grid_repeats}"
    if args.steps % args.eval_every:
        return f"--steps {args.steps} must be a multiple of --eval-every {args.eval_every} (same eval points)"
    if args.target is not None and args.target_gain is not None:
        return "--target and --target-gain are two target rules: give one"
    if args.target_gain is not None and not (args.target_gain > 0 and args.target_gain < 1):
        return f"--target-gain must be in (0, 1), got {args.target_gain}"
    if args.warm_seed is not None and args.warm_seed < 0:
        return f"--warm-seed must be >= 0, got {args.warm_seed}"
    if (args.target is None and args.target_gain is None and args.reanalyse is None
            and "sync" not in [a.name for a in args.arm_list]):
        return ("--target or --target-gain is required when the sync arm is not among --arms (the default target "
                "is sync's)")
    bad = next((s for s in args.set if "=" not in s), None)
    return None if bad is None else f"--set {bad!r}: expected KEY=VALUE"


def metric_problem(args: argparse.Namespace) -> Optional[str]:
    """What is wrong with ``--metric`` and ``--eval-samples``, in one line (None when nothing is); fills in
    ``args.eval_samples`` (the N of ``eval/avg@N`` when not given).  A sampled metric needs samples that log it
    (``eval/pass@4``: N >= 4); the samples are every arm's ``eval.samples``, so ``--set`` may not give them; a
    ``--reanalyse`` record keeps the curves of one metric only, so ``--metric`` must be the record's."""
    metric, parsed = args.metric, sampled_metric(args.metric)
    if args.reanalyse is not None and args.metric_given is not None:
        try:
            recorded = json.loads(Path(args.reanalyse).read_text()).get("metric", "eval/accuracy")
        except (ValueError, AttributeError):
            return f"--reanalyse {args.reanalyse!r}: not a runs.json record"
        if recorded != args.metric_given:
            return (f"--metric {args.metric_given}: {args.reanalyse} holds the curves of {recorded} only; a new run "
                    f"measures another metric")
    if parsed is None:
        return None if args.eval_samples is None else (
            f"--eval-samples is for a sampled --metric (eval/avg@N, eval/pass@K, eval/maj@K), not {metric}")
    if any(s.split("=", 1)[0].strip() == SAMPLES_KEY for s in args.set):
        return f"--set {SAMPLES_KEY}=...: give the samples with --eval-samples (TRL's arm samples them too)"
    if args.eval_samples is None and parsed[0] != "avg":
        return (f"--metric {metric} needs --eval-samples N: the samples per held-out problem it is estimated from "
                f"({sampled_requirement(metric).replace(SAMPLES_KEY, 'N')})")
    n = parsed[1] if args.eval_samples is None else args.eval_samples
    if not logs_sampled(metric, n):
        return (f"--metric {metric} is not logged with --eval-samples {n}: it needs "
                f"{sampled_requirement(metric).replace(SAMPLES_KEY, '--eval-samples')}")
    args.eval_samples = n
    return None


def cached_warm_start(args, seed: int, work: Path) -> tuple[str, float]:
    """:func:`warm_start`, kept under ``--warm-cache`` (keyed by the job, its task settings, the seed, the SFT steps
    and a probe's model and task overrides) when given, so several invocations on the same seeds (the arms of item 4, a threads probe)
    share one warm start; a cached one reports the wall seconds it took when it was made."""
    if not args.warm_cache:
        return warm_start(args, seed, work)
    job_task = [o for o in JOBS[args.job]["task"] if not o.startswith("task.name=")]
    probe = [*job_task, *getattr(args, "model", ()), *getattr(args, "task_set", ())]
    model = "".join(f"-{o.split('.', 1)[-1]}" for o in probe)
    key = Path(args.warm_cache) / f"{args.job}-seed{seed}-sft{args.sft_steps}-eval{args.eval_size}{model}"
    if (key / "warm" / "config.json").is_file() and (key / "wall_s").is_file():
        return str(key / "warm"), float((key / "wall_s").read_text())
    path, wall = warm_start(args, seed, work)
    tmp = key.with_name(f"{key.name}.tmp{os.getpid()}")
    shutil.copytree(path, tmp / "warm")
    (tmp / "wall_s").write_text(f"{wall}")
    try:
        os.rename(tmp, key)          # atomic: another invocation that made the same (deterministic) one first wins
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(key / "warm"), wall


def save_partial(args, arms: list[Arm], runs: list[dict], warm: dict, t_start: float, load_start,
                 grids: Optional[dict] = None) -> None:
    """The record so far as ``--out``/partial.json after every run (``--reanalyse`` reads it), so a benchmark cut
    short by time keeps its finished runs (and the decode grid, :func:`measure_grids`)."""
    args.out.mkdir(parents=True, exist_ok=True)
    rec = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(t_start)),
           "command": "python experiments/bench/bench_tta.py " + " ".join(portable(args.argv, [args.warm_cache]))
           + " (partial)",
           "arms": [a.name for a in arms], "headline": args.headline, "job": args.job, "metric": args.metric,
           "threads": args.threads, "wall_s": time.time() - t_start, "load_start": load_start,
           "load_end": os.getloadavg(), "warm_start_s": warm, "warm_seed": args.warm_seed,
           "target_gain": args.target_gain, "decode_grids": grids or {}, "runs": runs}
    (args.out / "partial.json").write_text(json.dumps(rec, indent=1, default=str))


def collect(args) -> dict:
    """Every (seed, arm) run, seed-major with the arms rotated; the raw record ``report`` summarises."""
    arms = args.arm_list
    t_start = time.time()
    load_start = os.getloadavg()
    print(f"bench_tta: job {args.job}; headline (pre-registered) {args.headline}; arms "
          f"{', '.join(a.name for a in arms)}; {args.seeds} seeds from {args.first_seed}; {args.steps} steps, eval every "
          f"{args.eval_every}; load average at start {' / '.join(f'{x:.2f}' for x in load_start)}", flush=True)
    runs, warm, made = [], {}, {}
    grids = measure_grids(args, arms)
    with tempfile.TemporaryDirectory(prefix="bench_tta_") as tmp:
        work = Path(tmp)
        for i in range(args.seeds):
            seed = args.first_seed + i
            warm_seed = seed if args.warm_seed is None else args.warm_seed
            if warm_seed not in made:                   # a shared warm start (--warm-seed) is made once
                made[warm_seed] = cached_warm_start(args, warm_seed, work)
            path, wall = made[warm_seed]
            warm[warm_seed] = wall
            print(f"seed {seed}: warm start (seed {warm_seed}'s) {wall:.1f} s", flush=True)
            for arm in rotated(arms, i):
                r = run_arm(args, arm, seed, path, work)
                runs.append(r)
                c = r["curve"]
                save_partial(args, arms, runs, warm, t_start, load_start, grids)
                print(f"  {arm.name:>18} seed {seed}: final acc {c['final_accuracy']:.3f}, loop {c['end_s']:.1f} s "
                      f"(eval {c['eval_s']:.1f} s), process {r['process_wall_s']:.1f} s, load "
                      f"{r['load_after'][0]:.2f}", flush=True)
    return {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(t_start)),
            "command": "python experiments/bench/bench_tta.py " + " ".join(portable(args.argv, [args.warm_cache])),
            "args": {k: recorded_arg(v, args.warm_cache) for k, v in vars(args).items() if k != "arm_list"},
            "arms": [a.name for a in arms], "headline": args.headline, "job": args.job, "metric": args.metric,
            "threads": args.threads, "wall_s": time.time() - t_start, "load_start": load_start,
            "load_end": os.getloadavg(), "warm_start_s": warm, "warm_seed": args.warm_seed,
            "target_gain": args.target_gain, "decode_grids": grids, "runs": runs}


def target_of(record: dict, target_arg: float | None, gain_arg: float | None) -> tuple[float, str]:
    """The target accuracy of ``record`` and its rule in words: ``--target``, else ``--target-gain`` (given now, else
    the record's own), else sync's median final accuracy minus the margin (module docstring)."""
    runs = record["runs"]
    gain = gain_arg if gain_arg is not None else (record.get("target_gain") if target_arg is None else None)
    if target_arg is not None:
        return target_arg, "--target"
    if gain is not None:
        step0 = [r["curve"]["accuracy"][0] for r in runs if r["curve"]["steps"] and r["curve"]["steps"][0] == 0]
        if len(step0) != len(runs):
            raise ValueError("--target-gain needs every run's step-0 evaluation; a run has none")
        rule = f"median step-0 accuracy {statistics.median(step0):.3f} + {gain} (--target-gain)"
        return gain_target(step0, gain), rule
    final = [r["curve"]["final_accuracy"] for r in runs if r["arm"] == "sync"]
    return default_target(final), f"sync median final accuracy - {TARGET_MARGIN}"


def report(record: dict, target_arg: float | None, out: Path, note: str = "", headline: str | None = None,
           gain_arg: float | None = None) -> None:
    """Target (:func:`target_of`), summary, table (printed, table.md), plot (tta.png) and the raw record with them
    (runs.json)."""
    runs = record["runs"]
    arms = parse_arms(",".join(record["arms"]))
    target, rule = target_of(record, target_arg, gain_arg)
    summary = summarise(runs, arms, target)
    clocks = sorted({r["curve"]["clock"] for r in runs})
    headline = headline or record.get("headline") or "sync"
    text = table(summary, target, " + ".join(clocks), headline)
    if any(r["curve"].get("time_process_s") for r in runs):
        text += "\n\n" + sensitivity(runs, arms, target, headline)
    steps = (record.get("args") or {}).get("steps") or max(max(r["curve"]["steps"]) for r in runs)
    text += "\n\n" + phase_table(runs, arms, int(steps))
    flows = flow_table(runs, arms)
    if flows:
        text += "\n\n" + flows
    if any(r.get("startup_s") is not None for r in runs) and int(steps) >= 2:
        text += "\n\n" + ceiling_table(runs, headline, int(steps))
    split = split_table(runs, arms, target, headline) if any(r["curve"].get("time_process_s") for r in runs) else ""
    if split:
        text += "\n\n" + split
    bounds = bound_table(runs, arms, record.get("decode_grids") or {}, int(steps))
    if bounds:
        text += "\n\n" + bounds
    load_start, load_end = record["load_start"], record["load_end"]
    header = (f"# bench_tta {record['date']}\n\ncommand: `{record['command']}`{note}"
              f"\n\npre-registered headline arm: **{headline}** (named on the command line before the run); job "
              f"{record.get('job', 'default')}, accuracy `{record.get('metric', 'eval/accuracy')}`; median load "
              f"average (1 min) after the runs {statistics.median(r.get('load_after', [float('nan')])[0] for r in runs):.2f}"
              f"\n\ntarget rule: {rule}; warm start (SFT, s{warm_text(record)}): "
              f"{', '.join(f'{v:.1f}' for v in record['warm_start_s'].values())}; total wall {record['wall_s']:.0f} s; "
              f"load average start {' / '.join(f'{x:.2f}' for x in load_start)}, end "
              f"{' / '.join(f'{x:.2f}' for x in load_end)}\n")
    at_start = sum(r["met_at_start"] for r in summary.values())
    if at_start:
        header += (f"\nwarning: {at_start} run(s) met the target {target:.3f} at step 0 (before training: TTA 0 s, "
                   "left out of the ratios); the target is too low for this job (more --steps, or --target)\n")
    last = headline_line(summary, headline)
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.md").write_text(header + "\n" + text + "\n\n" + last + "\n")
    plot(runs, arms, target, out / "tta.png", record.get("metric", "eval/accuracy"))
    (out / "runs.json").write_text(json.dumps({**record, "target": target, "target_rule": rule, "clock": clocks,
                                               "summary": summary}, indent=1, default=str))
    print()
    print(header)
    print(text)
    print(f"\nwritten: {out}/table.md, runs.json, tta.png; load average at the end "
          f"{' / '.join(f'{x:.2f}' for x in load_end)}")
    print(last)


def warm_text(record: dict) -> str:
    """How the warm starts were shared, for the table's header."""
    ws = record.get("warm_seed")
    return " per seed" if ws is None else f"; one warm start, seed {ws}'s, shared by every seed"


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.reanalyse is not None:
        record = json.loads(Path(args.reanalyse).read_text())
        out = Path(args.out_given) if args.out_given else Path(args.reanalyse).parent
        report(record, args.target, out, note=f" (re-analysed {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
                                              f" with --reanalyse)", headline=args.headline, gain_arg=args.target_gain)
        return
    report(collect(args), args.target, args.out)


def trl_options(words: list[str]) -> dict:
    """``KEY=VALUE`` words of ``--trl-option`` as GRPOConfig fields (values read as YAML); ValueError in one line for a
    word without ``=`` or a key GRPOConfig does not have."""
    if not words:
        return {}
    from trl import GRPOConfig      # the child's library: imported only where TRL runs or is asked about

    known = {f.name for f in dataclasses.fields(GRPOConfig)}
    out = {}
    for word in words:
        key, eq, value = word.partition("=")
        if not eq or not key:
            raise ValueError(f"--trl-option {word!r}: expected KEY=VALUE")
        if key not in known:
            raise ValueError(f"--trl-option {word!r}: GRPOConfig has no field {key!r}")
        out[key] = yaml.safe_load(value)
    return out


def trl_child(argv: list[str]) -> None:
    """``bench_tta.py --trl-child RUN_DIR [--trl-...] -- OVERRIDES``: one TRL run (experiments/bench/tta/trl_arm.py)."""
    from tta import trl_arm

    sep = argv.index("--")
    p = argparse.ArgumentParser()
    p.add_argument("--trl-child")
    p.add_argument("--trl-gradient-checkpointing", type=int, default=1)
    p.add_argument("--trl-experts-implementation", default="grouped_mm")
    p.add_argument("--trl-option", action="append", default=[])
    a = p.parse_args(argv[:sep])
    fair = trl_arm.run(argv[sep + 1:], a.trl_child, bool(a.trl_gradient_checkpointing), a.trl_experts_implementation,
                       trl_options(a.trl_option))
    (Path(a.trl_child) / "fairness.json").write_text(json.dumps(fair))


if __name__ == "__main__":
    if "--trl-child" in sys.argv:
        trl_child(sys.argv[1:])
    else:
        main()
