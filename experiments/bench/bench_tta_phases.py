"""Where a time-to-accuracy step goes: the per-phase seconds of bench_tta's job for chosen arms, side by side.

bench_tta.py reports each arm's time to the target and its seconds per step; this script says why one arm's step
costs what it does.  It trains bench_tta's job (same overrides, same SFT warm start, through the CLI) for each arm,
``--rounds`` times interleaved (arm order rotated each round, so load drift hits every arm alike), and reports the
median over the timed steps (steps 2..N) of the trainer's per-phase metrics:

* ``perf/time_generate_s``: generation in the trainer's process (sync) or waiting for the worker's batch (async);
* ``perf/time_old_logp_s``: the old-log-prob pass;
* ``perf/time_update_s``: the optimizer update (forward, backward, step);
* ``perf/time_step_s``: the whole step;
* ``async/trainer_wait_s``, ``async/weight_sync_s``, ``async/worker_generate_s``: (async) the trainer's wait for a
  batch, its publication of the weights, the worker's generation (beside the trainer);

then each arm's median step against the first arm's, as a ratio.  Evaluation is off (``trainer.eval_every=0``)
so that steps are comparable.

    python experiments/bench/bench_tta_phases.py --arms sync,async-k1-grpo,async-k2-m2po --steps 120 --rounds 3
    python experiments/bench/bench_tta_phases.py --job long --arms sync,async-k1-grpo --steps 40 --rounds 3
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from bench_tta import JOBS, _call, job_overrides, warm_start
from tta.analysis import parse_arms

KEYS = ["perf/time_generate_s", "perf/time_old_logp_s", "perf/time_update_s", "perf/time_step_s",
        "async/trainer_wait_s", "async/weight_sync_s", "async/worker_generate_s"]


def phases(rows: list[dict]) -> dict[str, float]:
    """Median over the steps >= 2 of each key of :data:`KEYS` that the rows hold."""
    out = {}
    for key in KEYS:
        vals = [r[key] for r in rows if r.get("step", 0) >= 2 and r.get(key) is not None]
        if vals:
            out[key] = statistics.median(vals)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--job", default="default", choices=tuple(JOBS), help="bench_tta's job (default | long)")
    p.add_argument("--arms", default="sync,async-k1-grpo,async-k2-m2po")
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--out", default=None, help="JSON record of every run")
    args = p.parse_args(argv)
    try:
        arms = [a for a in parse_arms(args.arms) if a.system == "ours"]
    except ValueError as exc:
        p.error(str(exc))
    if not arms:
        p.error("--arms: no arm of ours (sync, async-k<K>-<loss>)")
    spec = JOBS[args.job]
    job = argparse.Namespace(job=args.job, prompts=16, group=8, max_new_tokens=spec["max_new_tokens"], lr=spec["lr"],
                             steps=args.steps, eval_every=0, eval_size=256, sft_steps=spec["sft_steps"])
    work = Path(tempfile.mkdtemp(prefix="tta_phases_"))
    load0 = os.getloadavg()
    warm, warm_s = warm_start(job, args.seed, work)
    print(f"warm start {warm_s:.1f} s; load {load0[0]:.2f}", flush=True)
    record: dict[str, list[dict]] = {a.name: [] for a in arms}
    for r in range(args.rounds):
        order = arms[r % len(arms):] + arms[:r % len(arms)]
        for arm in order:
            run_dir = work / f"{arm.name}-{r}"
            cmd = [sys.executable, "-m", "offpolicy_moe", "train", "--quiet", "--run-dir", str(run_dir),
                   *job_overrides(job, args.seed, warm), "trainer.eval_every=0", *arm.overrides(), *args.set]
            wall = _call(cmd, f"{arm.name} round {r}")
            rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
            ph = phases(rows)
            record[arm.name].append({"round": r, "wall_s": wall, "phases": ph, "load": os.getloadavg()})
            print(f"{arm.name} round {r}: step {ph['perf/time_step_s']:.4f} s, wall {wall:.1f} s, "
                  f"load {os.getloadavg()[0]:.2f}", flush=True)
    load1 = os.getloadavg()
    print(f"\nload average start {load0[0]:.2f} / {load0[1]:.2f} / {load0[2]:.2f}, "
          f"end {load1[0]:.2f} / {load1[1]:.2f} / {load1[2]:.2f}; median over {args.rounds} rounds of each run's "
          f"median over steps 2..{args.steps}\n")
    print("| arm | " + " | ".join(k.split("/")[1] for k in KEYS) + " | step vs " + arms[0].name + " |")
    print("| --- |" + " ---: |" * (len(KEYS) + 1))
    base = statistics.median(x["phases"]["perf/time_step_s"] for x in record[arms[0].name])
    for arm in arms:
        cells = []
        for key in KEYS:
            vals = [x["phases"][key] for x in record[arm.name] if key in x["phases"]]
            cells.append(f"{statistics.median(vals):.4f}" if vals else "—")
        step = statistics.median(x["phases"]["perf/time_step_s"] for x in record[arm.name])
        print(f"| {arm.name} | " + " | ".join(cells) + f" | {base / step:.2f}x |")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "load_start": load0, "load_end": load1,
                                              "runs": record}, indent=1))


if __name__ == "__main__":
    main()
