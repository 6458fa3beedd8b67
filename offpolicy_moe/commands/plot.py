"""``offpolicy-moe plot SWEEP_DIR --metrics a,b --by AXIS``: PNG curves with seed bands; staleness plots."""
from __future__ import annotations

import argparse
import sys

from offpolicy_moe.commands.table import _where


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("sweep_dir", help="sweep folder (or any folder of run folders)")
    p.add_argument("--metrics", help="comma-separated metric names. Omitted: every plot of the experiment's "
                                     "report: section")
    p.add_argument("--by", help="axis with one line per value (e.g. algorithm)")
    p.add_argument("--out", help="output folder (default SWEEP_DIR/plots)")
    p.add_argument("--band", default="std", choices=["std", "minmax", "none"], help="band across seeds")
    p.add_argument("--where", action="append", metavar="AXIS=VALUE", help="keep only matching runs (repeatable)")
    p.add_argument("--staleness-axis", help="also plot the aggregated metric against this numeric axis")
    p.add_argument("--agg", default="final", help="aggregate for the staleness plot (final | best | mean_last:N)")


def run(args: argparse.Namespace) -> int:
    from offpolicy_moe.report.plot import plot_curves, plot_staleness
    from offpolicy_moe.report.spec import report_spec

    try:
        if args.metrics:
            if not args.by:
                raise ValueError("--by is required with --metrics")
            specs = [dict(metrics=args.metrics, by=args.by, band=args.band, where=_where(args.where),
                          staleness_axis=args.staleness_axis, agg=args.agg)]
        else:
            specs = report_spec(args.sweep_dir)["plots"]
            if not specs:
                raise ValueError("give --metrics and --by (this sweep's experiment.yaml has no report.plots)")
        paths = []
        for s in specs:
            where = {**(s.get("where") or {}), **_where(args.where)} if not args.metrics else s["where"]
            if s.get("staleness_axis"):
                paths += plot_staleness(args.sweep_dir, s["metrics"], s["staleness_axis"], s["by"], args.out,
                                        s.get("agg", "final"), where)
                if args.metrics:  # explicit command line: curves as well
                    paths += plot_curves(args.sweep_dir, s["metrics"], s["by"], args.out, s.get("band", "std"), where)
            else:  # report: section: a metric this trainer does not log is skipped, not fatal
                paths += plot_curves(args.sweep_dir, s["metrics"], s["by"], args.out, s.get("band", "std"), where,
                                     skip_missing=not args.metrics)
    except (ValueError, FileNotFoundError) as exc:
        print(f"offpolicy-moe plot: {exc}", file=sys.stderr)
        return 2
    for p in paths:
        print(f"wrote {p}")
    return 0
