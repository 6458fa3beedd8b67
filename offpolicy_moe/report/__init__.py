"""Sweeps, tables and plots. Tables and plots read only run folders (``metrics.jsonl``, ``summary.json``,
``config.yaml``, ``run.json``), never wandb.

* :mod:`~offpolicy_moe.report.experiment`: experiment YAML (base config, grid axes, seeds) -> planned runs;
* :mod:`~offpolicy_moe.report.sweep`: run them as subprocesses into one sweep folder (parallel, resumable);
* :mod:`~offpolicy_moe.report.runs`: read run folders;
* :mod:`~offpolicy_moe.report.table`: ``mean ± std (n)`` tables in md / csv / latex / console;
* :mod:`~offpolicy_moe.report.plot`: curves with seed bands, metric-vs-staleness plots (matplotlib Agg).
"""
from offpolicy_moe.report.experiment import Experiment, RunSpec, load_experiment, plan_runs
from offpolicy_moe.report.runs import RunRecord, load_runs
from offpolicy_moe.report.spec import report_spec
from offpolicy_moe.report.sweep import SweepResult, run_sweep
from offpolicy_moe.report.table import Cell, MetricSpec, Table, aggregate_series, build_table, render_table

__all__ = [
    "Cell",
    "Experiment",
    "MetricSpec",
    "RunRecord",
    "RunSpec",
    "SweepResult",
    "Table",
    "aggregate_series",
    "build_table",
    "load_experiment",
    "load_runs",
    "plan_runs",
    "render_table",
    "report_spec",
    "run_sweep",
]
