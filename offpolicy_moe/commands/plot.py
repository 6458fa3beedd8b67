"""``offpolicy-moe plot SWEEP_DIR --metrics a,b --by AXIS``: PNG curves with seed bands; staleness plots."""
from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from offpolicy_moe.commands.errors import UsageError
from offpolicy_moe.report.plot import plot_curves, plot_staleness
from offpolicy_moe.report.spec import PlotSpec, default_agg, parse_where, report_spec


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("sweep_dir", help="sweep folder (or any folder of run folders)")
    p.add_argument("--metrics", "--metric", dest="metrics", action="append", metavar="NAME[,NAME...]",
                   help="metric names, comma-separated or repeated (any logged one, e.g. eval/avg@16: file "
                        "eval_avg@16.png). Omitted: every plot of the experiment's report: section")
    p.add_argument("--by", help="axis with one line per value (e.g. algorithm)")
    p.add_argument("--out", help="output folder (default SWEEP_DIR/plots)")
    p.add_argument("--band", default="std", choices=["std", "minmax", "none"], help="band across seeds")
    p.add_argument("--where", action="append", metavar="AXIS=VALUE", help="keep only matching runs (repeatable)")
    p.add_argument("--staleness-axis", help="also plot the aggregated metric against this numeric axis")
    p.add_argument("--agg", default=None, help="aggregate for the staleness plot (final | best | mean_last:N); "
                                               "default: the sweep's report.agg, else final (as table)")


def plot_specs(args: argparse.Namespace) -> list[PlotSpec]:
    """The plots to draw: the command line's, or the sweep's ``report:`` section."""
    if args.metrics:
        if not args.by:
            raise ValueError("--by is required with --metrics")
        return [PlotSpec(metrics=args.metrics, by=args.by, band=args.band, where=parse_where(args.where),
                         staleness_axis=args.staleness_axis, agg=args.agg)]
    specs = report_spec(args.sweep_dir).plots
    if not specs:
        raise ValueError("give --metrics and --by (this sweep's experiment.yaml has no report.plots)")
    return [replace(s, where={**s.where, **parse_where(args.where)}) for s in specs]


def draw(args: argparse.Namespace, s: PlotSpec) -> list[Path]:
    """The PNG files of one plot spec."""
    explicit = bool(args.metrics)
    paths = []
    metrics = s.metrics
    if s.staleness_axis:
        paths += plot_staleness(args.sweep_dir, metrics, s.staleness_axis, s.by, args.out,
                                s.agg or default_agg(args.sweep_dir), s.where)
        if explicit:  # explicit command line: curves as well
            paths += plot_curves(args.sweep_dir, metrics, s.by, args.out, s.band, s.where)
    else:  # report: section: a metric this trainer does not log is skipped, not fatal
        paths += plot_curves(args.sweep_dir, metrics, s.by, args.out, s.band, s.where, skip_missing=not explicit)
    return paths


def run(args: argparse.Namespace) -> int:
    if not Path(args.sweep_dir).is_dir():
        raise UsageError(f"sweep folder '{args.sweep_dir}' does not exist")
    try:
        paths = [p for s in plot_specs(args) for p in draw(args, s)]
    except (ValueError, FileNotFoundError) as exc:   # the report layer's refusals of names and values
        raise UsageError(str(exc)) from None
    for p in paths:
        print(f"wrote {p}")
    return 0
