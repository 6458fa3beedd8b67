"""Reading run folders and rendering them: tables and plots read only run folders (``metrics.jsonl``,
``summary.json``, ``config.yaml``, ``run.json``), never wandb. Planning and executing sweeps is
:mod:`offpolicy_moe.sweep`.

* :mod:`~offpolicy_moe.report.runs`: read run folders;
* :mod:`~offpolicy_moe.report.spec`: the ``report:`` section of a sweep's experiment file;
* :mod:`~offpolicy_moe.report.table`: ``mean ± std (n)`` tables in md / csv / latex / console, optionally with
  paired differences from a baseline row;
* :mod:`~offpolicy_moe.report.stats`: pairing by seed, the Student-t interval of a mean difference, verdicts;
* :mod:`~offpolicy_moe.report.claims`: ``report.claims``, papers' findings checked against a sweep;
* :mod:`~offpolicy_moe.report.plot`: curves with seed bands, metric-vs-staleness plots (matplotlib Agg).
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
