"""``offpolicy-moe sweep EXPERIMENT.yaml [key=value ...]``: run a grid of runs into one sweep folder."""
from __future__ import annotations

import argparse
import sys

from offpolicy_moe.config import ConfigError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("experiment", help="experiment YAML (base config, grid axes, seeds; see experiments/)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="overrides applied to every run")
    p.add_argument("--seeds", help="comma-separated seeds, replacing the experiment's (e.g. 0,1,2)")
    p.add_argument("--jobs", type=int, default=1, help="runs at once; default 1 (use about the number of cores)")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads per run (OMP_NUM_THREADS unless set); default 1: tiny models gain nothing "
                        "from more, and oversubscribed cores slow every run down")
    p.add_argument("--resume", action="store_true", help="skip runs whose summary.json says completed")
    p.add_argument("--overwrite", action="store_true", help="re-run every run of an existing sweep folder")
    p.add_argument("--out", help="sweep folder (default runs/<experiment name>)")
    p.add_argument("--dry-run", action="store_true", help="plan and validate every run, print the commands, run nothing")
    p.add_argument("--train-cmd", help="command that trains one run (default: '<python> -m offpolicy_moe train'; "
                                       "env OFFPOLICY_MOE_TRAIN_CMD)")
    p.add_argument("--timeout", type=float, help="seconds before a run is killed and recorded as failed")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    from offpolicy_moe.report.sweep import run_sweep

    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()] if args.seeds else None
    except ValueError:
        print(f"offpolicy-moe sweep: --seeds must be comma-separated integers, got {args.seeds!r}", file=sys.stderr)
        return 2
    if args.jobs < 1:
        print("offpolicy-moe sweep: --jobs must be >= 1", file=sys.stderr)
        return 2
    try:
        res = run_sweep(args.experiment, out=args.out, seeds=seeds, overrides=args.overrides, jobs=args.jobs,
                        threads=args.threads,
                        resume=args.resume, overwrite=args.overwrite, train_cmd=args.train_cmd,
                        timeout=args.timeout, progress=not args.no_progress, dry_run=args.dry_run)
    except ConfigError as exc:
        print(f"offpolicy-moe sweep: {exc}", file=sys.stderr)
        return 2
    return 1 if res.failed else 0
