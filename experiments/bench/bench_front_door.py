"""Wall time of the CLI's front door against ``python -c pass``, interleaved with an older checkout.

    git archive <old commit> offpolicy_moe | tar -x -C OLD_DIR
    python experiments/bench/bench_front_door.py --old OLD_DIR --rounds 10
    python experiments/bench/bench_front_door.py --old OLD_DIR --rounds 4 --dry-run

Each round runs every command once, in alternating order, each in a fresh interpreter started in the folder that
holds the code it measures (this checkout, or ``--old``); the medians, ranges and the load average before and after
are printed (docs/benchmarks.md, 2026-11-27).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def commands(dry_run: bool) -> dict[str, list[str]]:
    """The measured commands: ``--help`` and ``python -c pass``, or a valid and a mistaken ``train --dry-run``."""
    if dry_run:
        return {"dry-run": ["-m", "offpolicy_moe", "train", "--dry-run"],
                "dry-run, config mistake": ["-m", "offpolicy_moe", "train", "--dry-run", "algo.loss.options.tua=1"]}
    return {"--help": ["-m", "offpolicy_moe", "--help"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--old", type=Path, help="folder holding an older offpolicy_moe/ to measure beside this one")
    p.add_argument("--rounds", type=int, default=10, help="rounds (each runs every command once)")
    p.add_argument("--dry-run", action="store_true", help="measure `train --dry-run` instead of `--help`")
    args = p.parse_args()
    arms = {"python -c pass": (["-c", "pass"], ROOT)} if not args.dry_run else {}
    for name, argv in commands(args.dry_run).items():
        arms[f"{name} (this checkout)"] = (argv, ROOT)
        if args.old is not None:
            arms[f"{name} ({args.old.name})"] = (argv, args.old.resolve())
    times: dict[str, list[float]] = {k: [] for k in arms}
    print(f"load average before: {os.getloadavg()}")
    for r in range(args.rounds):
        for name in (list(arms) if r % 2 == 0 else list(reversed(arms))):
            argv, cwd = arms[name]
            t = time.perf_counter()
            subprocess.run([sys.executable, *argv], cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            times[name].append(time.perf_counter() - t)
    print(f"load average after: {os.getloadavg()}")
    for name, ts in times.items():
        print(f"{name:>40}: median {statistics.median(ts):.3f} s (min {min(ts):.3f}, max {max(ts):.3f}, n={len(ts)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
