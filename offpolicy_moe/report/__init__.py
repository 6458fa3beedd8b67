"""Reading run folders and rendering them: tables and plots read only run folders (``metrics.jsonl``,
``summary.json``, ``config.yaml``, ``run.json``), never wandb. Planning and executing sweeps is
:mod:`offpolicy_moe.sweep`.

* :mod:`~offpolicy_moe.report.runs`: read run folders;
* :mod:`~offpolicy_moe.report.spec`: the ``report:`` section of a sweep's experiment file;
* :mod:`~offpolicy_moe.report.table`: ``mean ± std (n)`` tables in md / csv / latex / console;
* :mod:`~offpolicy_moe.report.plot`: curves with seed bands, metric-vs-staleness plots (matplotlib Agg).
"""
from offpolicy_moe.report.runs import RunRecord, load_runs
from offpolicy_moe.report.spec import report_spec
from offpolicy_moe.report.table import Cell, MetricSpec, Table, aggregate_series, build_table, render_table

__all__ = [
    "Cell",
    "MetricSpec",
    "RunRecord",
    "Table",
    "aggregate_series",
    "build_table",
    "load_runs",
    "render_table",
    "report_spec",
]
