"""Sweeps: plan a grid of runs from an experiment file (:mod:`~offpolicy_moe.sweep.plan`) and execute it into one
sweep folder (:mod:`~offpolicy_moe.sweep.execute`).  Reading run folders and rendering is :mod:`offpolicy_moe.report`.
"""
from offpolicy_moe.sweep.execute import RunResult, SweepResult, run_sweep
from offpolicy_moe.sweep.plan import Experiment, RunSpec, load_experiment, parse_experiment, plan_runs

__all__ = ["Experiment", "RunResult", "RunSpec", "SweepResult", "load_experiment", "parse_experiment", "plan_runs",
           "run_sweep"]
