"""The trainer's threads fixed at 1, fixed at 2, or following the cores the rollout worker leaves idle
(``trainer.follow_threads``, offpolicy_moe/trainer/thread_follower.py), on the same short job with one 1-thread
worker beside the trainer: the stream arm (``buffer.mode=stream``, k = 1) and the asynchronous one
(``buffer.mode=async``, k = 1).

    python experiments/bench/bench_follow_threads.py          # 3 rounds x 20 steps, both modes: 2-3 min on 2 cores
    python experiments/bench/bench_follow_threads.py --rounds 2 --steps 60 --modes stream --json out.json

Every run trains ``--steps`` steps in this process (the trainer; its worker is a process of its own); the figure of
a run is its **seconds per step**, the mean of ``perf/time_step_s`` over the steps after the first ``--skip`` (the
worker's start and first weights) and before the last (which checkpoints).  The three thread arms of a mode run
back to back in a round, in an order rotated by the round, so a change of machine load hits all of them; the ratios
(``fixed-1 / arm``: above 1 is faster than one fixed thread) are taken within a round, then their median over the
rounds is printed.  Beside each run: the threads the trainer's steps ran with (``perf/trainer_threads``), the
worker's busy share (``async/worker_cpu_s`` over the step's wall), the trainer's wait for data, and the 1-minute load
average before and after; the machine (``lscpu``'s model name, cores) heads the output.

The job: the embedded Qwen3-MoE at hidden 128 (2 layers, 8 experts top-2), the chain task (4 one-digit terms,
worked steps: 25 new tokens at most), 16 prompts x 8 samples, GRPO with TIS, the trainer's old-log-prob pass and its
routing and mismatch measurements on; no evaluation.  On the 2-core AMD EPYC (2026-11-29) a step took about 0.26 s
at 1 thread, its worker generating about a third of it (async k = 1) or two thirds (stream); results in
docs/async.md ("The trainer's threads follow the idle cores").
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from typing import Any

import torch

from _machine import cpu_model
from offpolicy_moe.config.load import load_config
from offpolicy_moe.trainer.callbacks import FunctionCallback
from offpolicy_moe.trainer.thread_follower import GENERATE_KEY, THREADS_KEY, WALL_KEY, usable_cores
from offpolicy_moe.trainer.trainer import Trainer

#: the thread arms: (name, trainer.threads, trainer.follow_threads); the follower starts from 1 thread
ARMS = (("fixed-1", 1, False), ("fixed-2", 2, False), ("follow", 1, True))
#: the modes: name -> buffer overrides (one 1-thread worker either way)
MODES = {
    "stream": ["buffer.mode=stream", "buffer.staleness=1", "rollout.stream_slots=64"],
    "async-k1": ["buffer.mode=async", "buffer.staleness=1"],
}


def job_overrides(args: argparse.Namespace, run_dir: str) -> list[str]:
    """The job every run trains (module docstring), without its mode and thread keys."""
    return [
        f"run_dir={run_dir}", "preset=[grpo,tis]", "task.name=chain", "task.num_terms=4", "task.eval_size=8",
        f"model.hidden_size={args.hidden}", "model.num_layers=2", "model.num_experts=8",
        f"rollout.prompts_per_step={args.prompts}", f"rollout.group_size={args.group}",
        f"rollout.max_new_tokens={args.max_new_tokens}", "rollout.dtype=float32", "rollout.workers=1",
        "rollout.worker_threads=1", f"trainer.steps={args.steps}", "trainer.sft_warmup_steps=0",
        "trainer.eval_every=0", "trainer.checkpoint_every=0", "trainer.export_final=false",
        "trainer.keep_checkpoints=1", "logging.loggers=[jsonl]", "logging.progress=false", "optim.lr=3e-4",
        *args.set]


def run_once(args: argparse.Namespace, mode: str, arm: tuple[str, int, bool]) -> dict[str, Any]:
    """One run of ``mode`` under thread ``arm``: seconds per step over the timed steps and what went on in them."""
    name, threads, follow = arm
    steps: list[dict[str, float]] = []
    load0 = os.getloadavg()[0]
    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory(prefix=f"bench_follow_{mode}_{name}_") as d:
        cfg = load_config(None, [*job_overrides(args, d), *MODES[mode], f"trainer.threads={threads}",
                                 f"trainer.follow_threads={str(follow).lower()}"])
        t0 = time.perf_counter()
        summary = Trainer(cfg, callbacks=[FunctionCallback(on_step_end=lambda tr, s, m: steps.append(dict(m)))]).run()
        wall = time.perf_counter() - t0
    if summary["status"] != "completed":
        raise RuntimeError(f"{mode} {name} ended {summary['status']}: {summary.get('error')}")
    timed = steps[args.skip:-1]
    busy = [m[GENERATE_KEY] / m[WALL_KEY] for m in timed]
    cpu = [m["async/worker_cpu_s"] / m[WALL_KEY] for m in timed]
    return {"mode": mode, "arm": name, "s_per_step": statistics.fmean(m[WALL_KEY] for m in timed),
            "steps_timed": len(timed), "threads": [int(m[THREADS_KEY]) for m in steps],
            "step_s": [round(m[WALL_KEY], 3) for m in steps],
            "worker_generate_s": [round(m[GENERATE_KEY], 3) for m in steps],
            "update_s": statistics.fmean(m["perf/time_update_s"] for m in timed),
            "old_logp_s": statistics.fmean(m["perf/time_old_logp_s"] for m in timed),
            "trainer_wait_s": statistics.fmean(m["async/trainer_wait_s"] for m in timed),
            "worker_busy": statistics.fmean(busy), "worker_cpu_share": statistics.fmean(cpu), "run_wall_s": wall,
            "load1": [round(load0, 2), round(os.getloadavg()[0], 2)]}


def rotated(arms: tuple, round_: int) -> list:
    """The arms in the order of round ``round_`` (rotated by one each round)."""
    k = round_ % len(arms)
    return list(arms[k:] + arms[:k])


def ratios(rows: list[dict], mode: str, base: str) -> dict[str, list[float]]:
    """Per round, ``base``'s seconds per step over each arm's (above 1: the arm is faster than ``base``)."""
    out: dict[str, list[float]] = {name: [] for name, _, _ in ARMS}
    for r in sorted({row["round"] for row in rows}):
        got = {row["arm"]: row["s_per_step"] for row in rows if row["round"] == r and row["mode"] == mode}
        if base in got:
            for name in out:
                if name in got:
                    out[name].append(got[base] / got[name])
    return out


def report(rows: list[dict], modes: list[str]) -> None:
    """The table: per mode and arm, median seconds per step, the paired ratios, threads, busy share, loads."""
    print(f"\n{'mode':9} {'arm':8} {'s/step (median)':>16} {'fixed-1/arm':>12} {'fixed-2/arm':>12} "
          f"{'threads used':>14} {'worker busy':>12} {'trainer wait':>13}  load1 before-after")
    for mode in modes:
        vs1, vs2 = ratios(rows, mode, "fixed-1"), ratios(rows, mode, "fixed-2")
        for name, _, _ in ARMS:
            mine = [r for r in rows if r["mode"] == mode and r["arm"] == name]
            if not mine:
                continue
            used = [t for r in mine for t in r["threads"][1:]]
            share = {t: used.count(t) / len(used) for t in sorted(set(used))}
            print(f"{mode:9} {name:8} {statistics.median(r['s_per_step'] for r in mine):16.3f} "
                  f"{statistics.median(vs1[name]):12.2f} {statistics.median(vs2[name]):12.2f} "
                  f"{' '.join(f'{t}:{p:.0%}' for t, p in share.items()):>14} "
                  f"{statistics.median(r['worker_busy'] for r in mine):12.2f} "
                  f"{statistics.median(r['trainer_wait_s'] for r in mine):13.3f}  "
                  f"{', '.join(f'{a}-{b}' for a, b in (r['load1'] for r in mine))}")
        print(f"{'':18} per-round fixed-1/follow {[round(x, 2) for x in vs1['follow']]}, "
              f"fixed-2/follow {[round(x, 2) for x in vs2['follow']]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the three arms per mode (default 3)")
    ap.add_argument("--steps", type=int, default=20, help="trained steps per run (default 20)")
    ap.add_argument("--skip", type=int, default=3, help="first steps left out of the timing (default 3)")
    ap.add_argument("--modes", default="stream,async-k1", help="comma-separated, of: " + ", ".join(MODES))
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--max-new-tokens", type=int, default=25)
    ap.add_argument("--set", nargs="*", default=[], help="more config overrides (key=value) for every run")
    ap.add_argument("--json", default=None, help="write every run's record and the machine to this file")
    args = ap.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown or args.steps < args.skip + 3:
        ap.error(f"unknown modes {unknown}" if unknown else "--steps must be at least --skip + 3")
    machine = {"cpu": cpu_model(), "cores": usable_cores(), "torch": torch.__version__,
               "load_avg_start": [round(x, 2) for x in os.getloadavg()],
               "utc_start": time.strftime("%Y-%m-%d %H:%M", time.gmtime())}
    print(json.dumps(machine), flush=True)
    rows: list[dict] = []
    for r in range(args.rounds):
        for mode in modes:
            for arm in rotated(ARMS, r):
                row = {"round": r, **run_once(args, mode, arm)}
                rows.append(row)
                print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}),
                      flush=True)
    machine["load_avg_end"] = [round(x, 2) for x in os.getloadavg()]
    report(rows, modes)
    print(f"\nload average at the start {machine['load_avg_start']}, at the end {machine['load_avg_end']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine, "args": vars(args), "runs": rows}, f, indent=1)


if __name__ == "__main__":
    main()
