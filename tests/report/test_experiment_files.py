"""The shipped experiments plan, validate, respect the CPU budget, and their GPU twins share the grid."""
import json
import re
from pathlib import Path

import pytest

from offpolicy_moe.config import ConfigError, validate
from offpolicy_moe.sweep.plan import load_experiment, plan_runs
from offpolicy_moe.report.spec import PlotSpec, TableSpec

ROOT = Path(__file__).resolve().parents[2] / "experiments"
NAMES = ["r3_ablation", "m2po_staleness", "pr2_offpolicy"]      # each with a GPU twin in experiments/gpu/
CPU_ONLY = ["m2po_regime", "stale_race"]


@pytest.mark.parametrize("name", NAMES + CPU_ONLY)
def test_cpu_experiment_plans_validates_and_fits_budget(name):
    exp = load_experiment(ROOT / f"{name}.yaml")
    assert len(exp.seeds) >= 3
    runs = plan_runs(exp)
    for r in runs:
        validate(r.config)
    # the header writes the budget down from measured per-run wall times: "N runs x S s / 2 jobs ~= M min"
    text = (ROOT / f"{name}.yaml").read_text()
    m = re.search(r"(\d+) runs x (\d+) s / 2 jobs ~= (\d+) min", text)
    assert m, f"{name}: the header's budget line is missing"
    n, per_run, total = (int(g) for g in m.groups())
    assert n == len(runs), f"{name}: the budget counts {n} runs, the grid plans {len(runs)}"
    assert abs(n * per_run / 2 / 60 - total) <= 1, f"{name}: {n} x {per_run} s / 2 is not {total} min"
    assert total <= 45, f"{name}: {total} min is over the 45-minute budget on 2 cores"
    assert all(isinstance(t, TableSpec) for t in exp.report.tables)     # parsed and checked at load
    assert all(isinstance(p, PlotSpec) for p in exp.report.plots)


@pytest.mark.parametrize("name", NAMES)
def test_gpu_twin_same_grid_and_placeholders_refused(name, tmp_path):
    cpu = load_experiment(ROOT / f"{name}.yaml")
    gpu = load_experiment(ROOT / "gpu" / f"{name}.yaml")
    assert [a.name for a in gpu.axes] == [a.name for a in cpu.axes]
    for a, b in zip(gpu.axes, cpu.axes):
        assert set(b.labels) <= set(a.labels)
    runs = plan_runs(gpu, seeds=[0])
    with pytest.raises(ConfigError, match="model.path.*placeholder"):
        validate(runs[0].config)
    model = tmp_path / "moe"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_experts": 128}))
    runs = plan_runs(gpu, seeds=[0], overrides=[f"model.path={model}", f"task.name=jsonl:{tmp_path}/m.jsonl"])
    for r in runs:
        validate(r.config)
        assert r.config.model.path == str(model) and r.config.rollout.max_new_tokens >= 512


@pytest.mark.parametrize("name", NAMES)
def test_gpu_twin_makes_the_same_claims(name):
    """The GPU twin checks the CPU file's claims: same comparisons, expectations and margins (the metric and the
    aggregation may differ with the task and the evaluation cadence), and lays out the same tables."""
    def key(c):
        return (c.claim, c.treatment, c.baseline, c.baseline_value, c.where, c.expect, c.margin, c.scale)
    cpu = load_experiment(ROOT / f"{name}.yaml")
    gpu = load_experiment(ROOT / "gpu" / f"{name}.yaml")
    assert cpu.report.claims and [key(c) for c in gpu.report.claims] == [key(c) for c in cpu.report.claims]
    layout = [(t.rows, t.cols, t.baseline, t.where) for t in cpu.report.tables]
    assert [(t.rows, t.cols, t.baseline, t.where) for t in gpu.report.tables] == layout
