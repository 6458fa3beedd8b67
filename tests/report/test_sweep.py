"""Sweep mechanics with a fake trainer script: folders, run.json, failures recorded, resume, dry run, jobs."""
import json
import sys
from pathlib import Path

import pytest

from offpolicy_moe.cli import main
from offpolicy_moe.config import ConfigError
from offpolicy_moe.sweep.plan import load_experiment, parse_experiment, plan_runs
from offpolicy_moe.sweep.execute import run_sweep

FAKE = [sys.executable, str(Path(__file__).with_name("fake_train.py"))]

EXP = """
name: tiny
seeds: [0, 1]
base:
  preset: [tis]
  trainer: {steps: 4}
grid:
  algorithm:
    grpo: {preset: [grpo]}
    unclipped: {preset: [unclipped]}
  staleness:
    key: buffer.staleness
    values: [0, 2]
exclude:
  - {algorithm: unclipped, staleness: 2}
report:
  tables: [{rows: algorithm, cols: staleness, metric: reward/mean}]
"""


@pytest.fixture
def exp_file(tmp_path):
    p = tmp_path / "tiny.yaml"
    p.write_text(EXP)
    return p


def test_plan_grid_exclude_names_and_preset_concat(exp_file):
    exp = load_experiment(exp_file)
    runs = plan_runs(exp)
    names = [r.name for r in runs]
    assert names == [
        "algorithm=grpo__staleness=0__seed=0", "algorithm=grpo__staleness=0__seed=1",
        "algorithm=grpo__staleness=2__seed=0", "algorithm=grpo__staleness=2__seed=1",
        "algorithm=unclipped__staleness=0__seed=0", "algorithm=unclipped__staleness=0__seed=1",
    ]
    r = runs[2]
    assert r.config.preset == ["tis", "grpo"] and r.config.algo.correction.mode == "truncate"
    assert r.config.buffer.staleness == 2 and r.config.seed == 0 and r.config.trainer.steps == 4
    assert r.axes == {"algorithm": "grpo", "staleness": "2"}
    assert [x.seed for x in plan_runs(exp, seeds=[5])] == [5, 5, 5]
    over = plan_runs(exp, overrides=["trainer.steps=2"])
    assert all(x.config.trainer.steps == 2 for x in over)


def test_experiment_errors_name_the_problem():
    with pytest.raises(ConfigError, match="clip_lo"):
        plan_runs(parse_experiment({"grid": {"a": {"x": {"algo.loss.clip_lo": 1}}}}))
    with pytest.raises(ConfigError, match="grid axis 'stale'"):
        parse_experiment({"grid": {"stale": [0, 1]}})
    with pytest.raises(ConfigError, match="unknown axis 'algo'"):
        parse_experiment({"grid": {"buffer.staleness": [0]}, "exclude": [{"algo": "x"}]})
    with pytest.raises(ConfigError, match="unknown top-level"):
        parse_experiment({"grids": {}})
    e = parse_experiment({"grid": {"buffer.staleness": [0, 4]}})
    assert [r.config.buffer.staleness for r in plan_runs(e)] == [0, 4]


def test_sweep_runs_records_failure_and_resumes(exp_file, tmp_path, monkeypatch):
    log = tmp_path / "calls.txt"
    monkeypatch.setenv("FAKE_TRAIN_LOG", str(log))
    out = tmp_path / "sw"
    res = run_sweep(exp_file, out=out, train_cmd=FAKE, jobs=2, progress=False, log=lambda s: None)
    assert res.counts == {"completed": 5, "failed": 1}
    bad = out / "algorithm=unclipped__staleness=0__seed=1"
    summ = json.loads((bad / "summary.json").read_text())
    assert summ["status"] == "failed" and summ["returncode"] == 3 and "boom" in summ["error"]
    info = json.loads((bad / "run.json").read_text())
    assert info["status"] == "failed" and info["axes"] == {"algorithm": "unclipped", "staleness": "0"}
    good = out / "algorithm=grpo__staleness=2__seed=1"
    for f in ("config.yaml", "metrics.jsonl", "summary.json", "env.json", "run.json", "train.log"):
        assert (good / f).is_file(), f
    sw = json.loads((out / "sweep.json").read_text())
    assert sw["counts"]["completed"] == 5 and sw["failed_runs"] == [bad.name]
    assert sw["axes"] == {"algorithm": ["grpo", "unclipped"], "staleness": ["0", "2"]}
    assert (out / "experiment.yaml").read_text() == EXP
    assert len(log.read_text().split()) == 6

    with pytest.raises(ConfigError, match="--resume"):
        run_sweep(exp_file, out=out, train_cmd=FAKE, progress=False, log=lambda s: None)

    res2 = run_sweep(exp_file, out=out, train_cmd=FAKE, resume=True, progress=False, log=lambda s: None)
    assert res2.counts == {"skipped": 5, "failed": 1}
    assert log.read_text().split()[6:] == [bad.name]  # only the failed run was redone
    sw = json.loads((out / "sweep.json").read_text())
    assert sw["counts"]["completed"] == 5 and sw["counts"]["failed"] == 1


def test_dry_run_executes_nothing(exp_file, tmp_path, monkeypatch, capsys):
    log = tmp_path / "calls.txt"
    monkeypatch.setenv("FAKE_TRAIN_LOG", str(log))
    rc = main(["sweep", str(exp_file), "--dry-run", "--out", str(tmp_path / "d"), "--train-cmd",
               " ".join(FAKE), "--seeds", "0"])
    assert rc == 0 and not log.exists() and not (tmp_path / "d").exists()
    out = capsys.readouterr().out
    assert "3 runs planned" in out and "algorithm=grpo__staleness=2__seed=0" in out


def test_sweep_refuses_invalid_run_config_before_compute(tmp_path, monkeypatch):
    p = tmp_path / "bad.yaml"
    p.write_text("base: {algo: {old_logp_source: engine}}\ngrid:\n  algorithm:\n    ok: {}\n    tis: {preset: [tis]}\n")
    log = tmp_path / "calls.txt"
    monkeypatch.setenv("FAKE_TRAIN_LOG", str(log))
    with pytest.raises(ConfigError, match=r"(?s)run algorithm=tis__seed=0.*algo.correction.mode"):
        run_sweep(p, out=tmp_path / "o", train_cmd=FAKE, progress=False, log=lambda s: None)
    assert not log.exists()


def test_cli_sweep_then_table(exp_file, tmp_path, capsys):
    out = tmp_path / "sw"
    rc = main(["sweep", str(exp_file), "trainer.steps=3", "--out", str(out), "--train-cmd", " ".join(FAKE),
               "--no-progress"])
    assert rc == 1  # one run failed
    capsys.readouterr()
    assert main(["table", str(out), "--format", "md"]) == 0  # uses the experiment's report: section
    text = capsys.readouterr().out
    # grpo, staleness 0: seeds 0,1 final reward 0.03 and 0.13 -> mean 0.08, sample std 0.0707
    assert "| grpo | **0.08 ± 0.0707 (2)** | **0.082 ± 0.0707 (2)** |" in text
    assert "| unclipped | 0.03 ± – (1; 1 failed) | – |" in text
    assert "Failed runs (1): algorithm=unclipped__staleness=0__seed=1" in text
