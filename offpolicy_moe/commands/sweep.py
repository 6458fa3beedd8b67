"""``offpolicy-moe sweep EXPERIMENT.yaml [key=value ...]``: run a grid of runs into one sweep folder."""
from __future__ import annotations

import argparse

from offpolicy_moe.commands.errors import RunFailed, UsageError


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


def parse_seeds(text: str | None) -> list[int] | None:
    """``"0,1,2"`` -> ``[0, 1, 2]``; :class:`UsageError` on anything else."""
    if not text:
        return None
    try:
        return [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise UsageError(f"--seeds must be comma-separated integers, got {text!r}") from None


def run(args: argparse.Namespace) -> int:
    # the sweep reads configs (OmegaConf): imported when the command runs, so `offpolicy-moe --help` stays fast
    from offpolicy_moe.sweep.execute import run_sweep

    seeds = parse_seeds(args.seeds)
    if args.jobs < 1:
        raise UsageError(f"--jobs must be >= 1, got {args.jobs}")
    if args.threads < 1:
        raise UsageError(f"--threads must be >= 1, got {args.threads}")
    res = run_sweep(args.experiment, out=args.out, seeds=seeds, overrides=args.overrides, jobs=args.jobs,
                    threads=args.threads, resume=args.resume, overwrite=args.overwrite, train_cmd=args.train_cmd,
                    timeout=args.timeout, progress=not args.no_progress, dry_run=args.dry_run)
    if res.failed:
        raise RunFailed(f"{len(res.failed)} of {len(res.results)} runs failed: "
                        f"{', '.join(r.name for r in res.failed)} (see their train.log)")
    return 0
