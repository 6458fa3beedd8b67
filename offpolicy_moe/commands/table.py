"""``offpolicy-moe table SWEEP_DIR --rows AXIS --cols AXIS --metric NAME [--metric NAME ...]``: mean ± std (n) over
seeds, a column per metric (any logged one: ``eval/accuracy``, ``eval/avg@16``, ``eval/pass@4``); without ``--metric``
the experiment's ``report:`` tables, then its claims table (``--claims``: only that)."""
from __future__ import annotations

import argparse
from dataclasses import replace
import sys
from pathlib import Path

from offpolicy_moe.commands.errors import UsageError
from offpolicy_moe.report.claims import claims_notes, evaluate_claims, render_claims
from offpolicy_moe.report.spec import TableSpec, default_agg, parse_where, report_spec
from offpolicy_moe.report.table import FORMATS, build_table, parse_metrics, render_table

CLAIMS_TITLE = "Claims"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("sweep_dir", help="sweep folder (or any folder of run folders)")
    p.add_argument("--rows", help="axis (or comma-separated axes) for rows; axes of run.json or config keys")
    p.add_argument("--cols", help="axis (or axes) for columns; omit for one column per metric")
    p.add_argument("--metric", action="append", metavar="NAME[,NAME...]",
                   help="metric name(s), comma-separated or repeated (--metric eval/accuracy --metric eval/avg@16: "
                        "one column each, each with its paired interval under --baseline); suffix :lower / :higher "
                        "sets the direction. Omitted: render every table of the experiment's report: section, then "
                        "its claims")
    p.add_argument("--agg", default=None,
                   help="final | best | mean_last:N | min | max | collapse[:F] (step where the trailing 5-point mean "
                        "falls below F x its best; default F 0.5). Default: the sweep's report.agg, else final "
                        "(as plot)")
    p.add_argument("--format", default="console", choices=list(FORMATS))
    g = p.add_mutually_exclusive_group()
    g.add_argument("--higher-is-better", dest="higher", action="store_true", default=True)
    g.add_argument("--lower-is-better", dest="higher", action="store_false")
    p.add_argument("--where", action="append", metavar="AXIS=VALUE", help="keep only matching runs (repeatable; "
                                                                          "tables only, claims have their own)")
    p.add_argument("--baseline", metavar="LABEL",
                   help="a row label: every other row also shows its paired difference from that row (same column, "
                        "paired by seed) with a 95%% t interval; applies to every table rendered")
    p.add_argument("--claims", action="store_true",
                   help="render only the claims table of the experiment's report.claims")
    p.add_argument("--digits", type=int, default=3, help="significant digits (default 3)")
    p.add_argument("--out", help="write to this file instead of stdout")


def table_specs(args: argparse.Namespace) -> list[TableSpec]:
    """The tables to render: the command line's, the sweep's ``report:`` section's, or none with ``--claims``."""
    if args.claims:
        if args.metric or args.rows or args.cols or args.baseline:
            raise ValueError("--claims renders the report's claims only; it takes no --metric, --rows, --cols or "
                             "--baseline")
        return []
    if args.metric:
        if not args.rows:
            raise ValueError("--rows is required with --metric")
        return [TableSpec(rows=args.rows, cols=args.cols, metric=args.metric, agg=args.agg,
                          where=parse_where(args.where), lower_is_better=not args.higher, digits=args.digits,
                          baseline=args.baseline)]
    spec = report_spec(args.sweep_dir)
    if not spec.tables and not spec.claims:
        raise ValueError("give --rows and --metric (this sweep's experiment.yaml has no report.tables nor "
                         "report.claims)")
    cli_baseline = {"baseline": args.baseline} if args.baseline is not None else {}
    return [replace(s, where={**s.where, **parse_where(args.where)}, **cli_baseline) for s in spec.tables]


def render(args: argparse.Namespace, spec: TableSpec) -> str:
    """One table of ``spec`` rendered in ``args.format`` (notes of csv tables go to stderr)."""
    metrics = parse_metrics(spec.metric, default_higher=not spec.lower_is_better)
    agg = spec.agg or default_agg(args.sweep_dir)
    baseline = None if spec.baseline is None else str(spec.baseline)
    t = build_table(args.sweep_dir, spec.rows, spec.cols, metrics, agg, spec.where, baseline=baseline)
    text = render_table(t, args.format, spec.digits if spec.digits is not None else args.digits)
    if args.format == "csv":
        for note in t.notes():
            print(note, file=sys.stderr)
    return with_title(text, spec.title, args.format)


def render_claims_table(args: argparse.Namespace) -> str:
    """The claims table of the sweep's ``report.claims`` ("" when it has none and ``--claims`` was not given)."""
    claims = list(report_spec(args.sweep_dir).claims)
    if not claims:
        if args.claims:
            raise ValueError("this sweep's experiment.yaml has no report.claims")
        return ""
    results = evaluate_claims(args.sweep_dir, claims, default_agg(args.sweep_dir))
    text = render_claims(results, args.format, args.digits)
    if args.format == "csv":
        for note in claims_notes(results):
            print(note, file=sys.stderr)
    return with_title(text, CLAIMS_TITLE, args.format)


def with_title(text: str, title: str | None, fmt: str) -> str:
    """``### title`` (md) or ``== title ==`` (console) above a rendered table; csv and latex are left as they are."""
    if title and fmt == "md":
        return f"### {title}\n\n{text}"
    if title and fmt == "console":
        return f"== {title} ==\n{text}"
    return text


def run(args: argparse.Namespace) -> int:
    if not Path(args.sweep_dir).is_dir():
        raise UsageError(f"sweep folder '{args.sweep_dir}' does not exist")
    try:
        parts = [render(args, spec) for spec in table_specs(args)]
        if not args.metric:
            parts.append(render_claims_table(args))
        text = "\n".join(p for p in parts if p)
    except (ValueError, FileNotFoundError) as exc:   # the report layer's refusals of names and values
        raise UsageError(str(exc)) from None
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
        print(f"wrote {args.out}")
    else:
        print(text, end="")
    return 0
