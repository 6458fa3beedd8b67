"""Length bias of a stream: the deadline rule against the naive first-finished rule (issue 44, item 3).

A streaming step trains the groups that complete; short answers complete first.  For each admission rule
(``buffer.admission=deadline | first_finished``) and seed this runs the ``longtail`` job as ``buffer.mode=stream``
from a warm start and reads the run's last metric row: the Kolmogorov-Smirnov distance between the response lengths
of every row trained and every row received (``stream/ks_trained_vs_generated``), the mean trained length, the mean
of the per-step means of the rows received (a step of a few long arrivals weighs as much as one of many short ones:
not the mean over rows), the groups dropped for lateness and the largest per-token lag.  Usage::

    python experiments/bench/stream_length_bias.py --warm WARM_DIR --seeds 0,1,2 --steps 30 --out OUT.md

``WARM_DIR``: a warm-start export (bench_tta.py's ``--warm-cache`` keeps one per seed).  The table, the commands and
the load average go to ``--out`` and stdout.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RULES = ("deadline", "first_finished")


def overrides(warm: str, seed: int, steps: int, rule: str, k: int, slots: int) -> list[str]:
    """The longtail job (bench_tta.py's defaults: 16 prompts x 8 samples, 225 new tokens, lr 3e-5) as a stream."""
    return ["task.name=longtail", f"seed={seed}", "rollout.prompts_per_step=16", "rollout.group_size=8",
            "rollout.max_new_tokens=225", "rollout.temperature=1.0", "rollout.dtype=float32", "optim.lr=3e-5",
            "optim.grad_clip=1.0", "optim.scheduler=constant", f"trainer.steps={steps}", "trainer.eval_every=0",
            "trainer.threads=1", "trainer.checkpoint_every=0", "trainer.export_final=false",
            "logging.loggers=[jsonl]", "logging.progress=false", "algo.routing.replay=none",
            "algo.routing.metrics=false", "trainer.mismatch_metrics=false", f"model.path={warm}",
            "trainer.sft_warmup_steps=0", "buffer.mode=stream", f"buffer.staleness={k}", f"buffer.admission={rule}",
            "rollout.workers=1", "rollout.worker_threads=1", f"rollout.stream_slots={slots}"]


def run(args: argparse.Namespace, seed: int, rule: str) -> dict:
    """One run; its last metric row's length-bias figures."""
    run_dir = Path(tempfile.mkdtemp(prefix=f"bias-{rule}-{seed}-"))
    cmd = [sys.executable, "-m", "offpolicy_moe", "train", "--quiet", "--run-dir", str(run_dir),
           *overrides(args.warm, seed, args.steps, rule, args.staleness, args.slots)]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, env=dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled"),
                   stdout=subprocess.DEVNULL)
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl") if line.strip()][1:]
    last = rows[-1]
    return {"rule": rule, "seed": seed, "wall_s": time.perf_counter() - t0,
            "ks": last["stream/ks_trained_vs_generated"], "dropped": last["stream/dropped_late"],
            "trained_len": statistics.fmean(r["stream/trained_len_mean"] for r in rows),
            "generated_len": statistics.fmean(r["stream/generated_len_mean"] for r in rows),
            "lag_max": max(r["offpolicy/staleness_max"] for r in rows),
            "versions_per_row_max": max(r["offpolicy/versions_per_row_max"] for r in rows),
            "wait_s": statistics.median(r["async/trainer_wait_s"] for r in rows),
            "step_s": statistics.median(r["perf/time_step_s"] for r in rows)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--warm", required=True, help="warm-start export folder (model.path)")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--staleness", type=int, default=1)
    p.add_argument("--slots", type=int, default=128)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    load0 = os.getloadavg()
    results = [run(args, seed, rule) for seed in seeds for rule in RULES]     # seed-major, rules interleaved
    load1 = os.getloadavg()
    lines = ["| rule | seed | KS trained vs received | groups dropped | mean trained length | mean of per-step received "
             "means | max lag | max versions in a row | median trainer wait s | median step s |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in results:
        lines.append(f"| {r['rule']} | {r['seed']} | {r['ks']:.3f} | {r['dropped']:.0f} | {r['trained_len']:.1f} | "
                     f"{r['generated_len']:.1f} | {r['lag_max']:.0f} | {r['versions_per_row_max']:.0f} | "
                     f"{r['wait_s']:.3f} | {r['step_s']:.3f} |")
    for rule in RULES:
        ks = [r["ks"] for r in results if r["rule"] == rule]
        lines.append(f"\n{rule}: KS median {statistics.median(ks):.3f}, max {max(ks):.3f} over {len(ks)} runs")
    lines.append(f"\nmachine: {platform.processor() or platform.machine()}; load average before "
                 f"{load0[0]:.2f}/{load0[1]:.2f}/{load0[2]:.2f}, after {load1[0]:.2f}/{load1[1]:.2f}/{load1[2]:.2f}; "
                 f"{args.steps} steps, k={args.staleness}, {args.slots} slots")
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
