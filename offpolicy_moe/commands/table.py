"""``offpolicy-moe table SWEEP_DIR --rows AXIS --cols AXIS --metric NAME``: mean ± std (n) over seeds."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _where(items):
    out = {}
    for it in items or []:
        if "=" not in it:
            raise ValueError(f"--where expects AXIS=VALUE, got {it!r}")
        k, v = it.split("=", 1)
        out[k.strip()] = v.strip()
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("sweep_dir", help="sweep folder (or any folder of run folders)")
    p.add_argument("--rows", help="axis (or comma-separated axes) for rows; axes of run.json or config keys")
    p.add_argument("--cols", help="axis (or axes) for columns; omit for one column per metric")
    p.add_argument("--metric", help="metric name(s), comma-separated; suffix :lower / :higher sets the direction. "
                                    "Omitted: render every table of the experiment's report: section")
    p.add_argument("--agg", default="final", help="final | best | mean_last:N | min | max | collapse[:F] (step where the trailing 5-point mean falls below F x its best; default F 0.5) (default final)")
    p.add_argument("--format", default="console", choices=["md", "csv", "latex", "console"])
    g = p.add_mutually_exclusive_group()
    g.add_argument("--higher-is-better", dest="higher", action="store_true", default=True)
    g.add_argument("--lower-is-better", dest="higher", action="store_false")
    p.add_argument("--where", action="append", metavar="AXIS=VALUE", help="keep only matching runs (repeatable)")
    p.add_argument("--digits", type=int, default=3, help="significant digits (default 3)")
    p.add_argument("--out", help="write to this file instead of stdout")


def run(args: argparse.Namespace) -> int:
    from offpolicy_moe.report.spec import report_spec
    from offpolicy_moe.report.table import build_table, parse_metrics, render_table

    try:
        if args.metric:
            if not args.rows:
                raise ValueError("--rows is required with --metric")
            specs = [dict(rows=args.rows, cols=args.cols, metric=args.metric, agg=args.agg,
                          where=_where(args.where), lower_is_better=not args.higher, digits=args.digits)]
        else:
            specs = report_spec(args.sweep_dir)["tables"]
            if not specs:
                raise ValueError("give --rows and --metric (this sweep's experiment.yaml has no report.tables)")
        parts = []
        for spec in specs:
            metrics = parse_metrics(spec["metric"], default_higher=not spec.get("lower_is_better", False))
            where = {**spec.get("where", {}), **_where(args.where)} if not args.metric else spec["where"]
            t = build_table(args.sweep_dir, spec["rows"], spec.get("cols"), metrics, spec.get("agg", "final"), where)
            text = render_table(t, args.format, spec.get("digits", args.digits))
            if args.format == "csv":
                for note in t.notes():
                    print(note, file=sys.stderr)
            if spec.get("title") and args.format == "md":
                text = f"### {spec['title']}\n\n{text}"
            elif spec.get("title") and args.format == "console":
                text = f"== {spec['title']} ==\n{text}"
            parts.append(text)
        text = "\n".join(parts)
    except (ValueError, FileNotFoundError) as exc:
        print(f"offpolicy-moe table: {exc}", file=sys.stderr)
        return 2
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
        print(f"wrote {args.out}")
    else:
        print(text, end="")
    return 0
