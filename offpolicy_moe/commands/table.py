"""``offpolicy-moe table SWEEP_DIR --rows AXIS --cols AXIS --metric NAME``: mean ± std (n) over seeds."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from offpolicy_moe.commands.errors import UsageError
from offpolicy_moe.report.spec import default_agg, parse_where, report_spec
from offpolicy_moe.report.table import FORMATS, build_table, parse_metrics, render_table


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("sweep_dir", help="sweep folder (or any folder of run folders)")
    p.add_argument("--rows", help="axis (or comma-separated axes) for rows; axes of run.json or config keys")
    p.add_argument("--cols", help="axis (or axes) for columns; omit for one column per metric")
    p.add_argument("--metric", help="metric name(s), comma-separated; suffix :lower / :higher sets the direction. "
                                    "Omitted: render every table of the experiment's report: section")
    p.add_argument("--agg", default=None,
                   help="final | best | mean_last:N | min | max | collapse[:F] (step where the trailing 5-point mean "
                        "falls below F x its best; default F 0.5). Default: the sweep's report.agg, else final "
                        "(as plot)")
    p.add_argument("--format", default="console", choices=list(FORMATS))
    g = p.add_mutually_exclusive_group()
    g.add_argument("--higher-is-better", dest="higher", action="store_true", default=True)
    g.add_argument("--lower-is-better", dest="higher", action="store_false")
    p.add_argument("--where", action="append", metavar="AXIS=VALUE", help="keep only matching runs (repeatable)")
    p.add_argument("--digits", type=int, default=3, help="significant digits (default 3)")
    p.add_argument("--out", help="write to this file instead of stdout")


def table_specs(args: argparse.Namespace) -> list[dict]:
    """The tables to render: the command line's, or the sweep's ``report:`` section."""
    if args.metric:
        if not args.rows:
            raise ValueError("--rows is required with --metric")
        return [dict(rows=args.rows, cols=args.cols, metric=args.metric, agg=args.agg,
                     where=parse_where(args.where), lower_is_better=not args.higher, digits=args.digits)]
    specs = report_spec(args.sweep_dir)["tables"]
    if not specs:
        raise ValueError("give --rows and --metric (this sweep's experiment.yaml has no report.tables)")
    return [{**s, "where": {**(s.get("where") or {}), **parse_where(args.where)}} for s in specs]


def render(args: argparse.Namespace, spec: dict) -> str:
    """One table of ``spec`` rendered in ``args.format`` (notes of csv tables go to stderr)."""
    metrics = parse_metrics(spec["metric"], default_higher=not spec.get("lower_is_better", False))
    agg = spec.get("agg") or default_agg(args.sweep_dir)
    t = build_table(args.sweep_dir, spec["rows"], spec.get("cols"), metrics, agg, spec["where"])
    text = render_table(t, args.format, spec.get("digits", args.digits))
    if args.format == "csv":
        for note in t.notes():
            print(note, file=sys.stderr)
    if spec.get("title") and args.format == "md":
        text = f"### {spec['title']}\n\n{text}"
    elif spec.get("title") and args.format == "console":
        text = f"== {spec['title']} ==\n{text}"
    return text


def run(args: argparse.Namespace) -> int:
    if not Path(args.sweep_dir).is_dir():
        raise UsageError(f"sweep folder '{args.sweep_dir}' does not exist")
    try:
        text = "\n".join(render(args, spec) for spec in table_specs(args))
    except (ValueError, FileNotFoundError) as exc:   # the report layer's refusals of names and values
        raise UsageError(str(exc)) from None
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
        print(f"wrote {args.out}")
    else:
        print(text, end="")
    return 0
