"""Reading run folders and rendering them: tables, paired comparisons, claims and plots read only run folders
(``metrics.jsonl``, ``summary.json``, ``config.yaml``, ``run.json``), never wandb (docs/sweeps.md).  Planning and
executing sweeps is :mod:`offpolicy_moe.sweep`.
"""
from offpolicy_moe.report.claims import Claim, ClaimResult, evaluate_claims, parse_claims, render_claims
from offpolicy_moe.report.runs import RunRecord, load_runs
from offpolicy_moe.report.spec import report_spec
from offpolicy_moe.report.stats import Comparison, compare, t_interval, verdict
from offpolicy_moe.report.table import Cell, MetricSpec, Table, aggregate_series, build_table, render_table

__all__ = [
    "Cell",
    "Claim",
    "ClaimResult",
    "Comparison",
    "MetricSpec",
    "RunRecord",
    "Table",
    "aggregate_series",
    "build_table",
    "compare",
    "evaluate_claims",
    "load_runs",
    "parse_claims",
    "render_claims",
    "render_table",
    "report_spec",
    "t_interval",
    "verdict",
]
