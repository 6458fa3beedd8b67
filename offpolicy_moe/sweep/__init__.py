"""Sweeps: plan a grid of runs from an experiment file, and execute it into one sweep folder.

* :mod:`~offpolicy_moe.sweep.plan`: experiment YAML (base config, grid axes, seeds) -> planned, validated runs;
* :mod:`~offpolicy_moe.sweep.execute`: run them as subprocesses into one sweep folder (parallel, resumable).

Reading run folders and rendering tables and plots is :mod:`offpolicy_moe.report`'s job; this package only reads a
run's ``summary.json`` status through it (layers: config -> engine -> report -> sweep -> commands).
"""
from offpolicy_moe.sweep.execute import RunResult, SweepResult, run_sweep
from offpolicy_moe.sweep.plan import Experiment, RunSpec, load_experiment, parse_experiment, plan_runs

__all__ = ["Experiment", "RunResult", "RunSpec", "SweepResult", "load_experiment", "parse_experiment", "plan_runs",
           "run_sweep"]
