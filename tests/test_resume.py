"""`train --resume` means what it says: the run's own config, only extending keys, forced changes recorded as a
segment, "nothing to resume" said, and wall time over every segment. Tiny runs (a few steps of a 1-layer model)."""
from __future__ import annotations

import json

import pytest

from offpolicy_moe.cli import main
from offpolicy_moe.commands.resume import EXTEND_KEYS, extends_only, read_segments

TINY = ["model.num_layers=1", "model.hidden_size=32", "model.num_experts=4", "task.eval_size=16",
        "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=3", "trainer.eval_every=0",
        "trainer.sft_warmup_steps=0", "trainer.min_free_mb=1", "trainer.checkpoint_every=1", "preset=[grpo]"]


def _err(capsys, command="train") -> str:
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(err) == 1 and err[0].startswith(f"offpolicy-moe {command}: error: "), err
    return err[0]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A finished 2-step run (checkpoints at steps 1 and 2)."""
    run_dir = tmp_path_factory.mktemp("runs") / "r"
    assert main(["train", *TINY, "trainer.steps=2", "--run-dir", str(run_dir), "--quiet"]) == 0
    return run_dir


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_resume_of_a_missing_folder_is_an_error(tmp_path, capsys):
    assert main(["train", "--run-dir", str(tmp_path / "nope"), "--resume"]) == 2
    assert "does not exist" in _err(capsys)
    assert not (tmp_path / "nope").exists()


def test_nothing_to_resume_is_said(tmp_path, capsys):
    rd = tmp_path / "r"
    rd.mkdir()
    (rd / "config.yaml").write_text("trainer:\n  steps: 5\n")      # a run stopped before its first checkpoint
    assert main(["train", "--run-dir", str(rd), "--resume"]) == 2
    assert "nothing to resume" in _err(capsys)
    assert not (rd / "metrics.jsonl").exists()


def test_resume_reuses_the_saved_config_and_extends(trained, tmp_path, capsys):
    rd = _copy(trained, tmp_path / "r")
    first = json.loads((rd / "summary.json").read_text())
    capsys.readouterr()
    # no YAML: the run's own config.yaml; trainer.steps extends the run
    assert main(["train", "--run-dir", str(rd), "--resume", "trainer.steps=3"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("offpolicy-moe train: 1 CPU thread") and "resuming from step 2" in out[0]
    summary = json.loads((rd / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 3 and summary["segments"] == 2
    segs = read_segments(rd)
    assert [s["segment"] for s in segs] == [0, 1] and segs[1]["from_step"] == 2 and segs[1]["to_step"] == 3
    assert segs[1]["changed"] == {"trainer.steps": [2, 3]} and "forced" not in segs[1]
    # wall time covers both segments
    assert summary["wall_time_s"] == pytest.approx(first["wall_time_s"] + segs[1]["wall_time_s"], abs=2e-3)
    assert summary["wall_time_s"] > segs[1]["wall_time_s"]
    env = json.loads((rd / "env.json").read_text())
    assert env["threads_choice"]["threads"] == env["torch_threads"]


def test_meaning_changes_are_refused_naming_the_keys(trained, tmp_path, capsys):
    rd = _copy(trained, tmp_path / "r")
    before = {p.name: p.read_bytes() for p in rd.iterdir() if p.is_file()}
    assert main(["train", "--run-dir", str(rd), "--resume", "trainer.steps=3", "optim.lr=0.01", "seed=7"]) == 2
    line = _err(capsys)
    assert "optim.lr" in line and "seed" in line and "--force-change" in line and "trainer.steps" not in line.split("(")[1].split(")")[0]
    after = {p.name: p.read_bytes() for p in rd.iterdir() if p.is_file()}
    assert after == before                                   # nothing written


def test_forced_change_is_recorded_as_a_segment(trained, tmp_path, capsys):
    rd = _copy(trained, tmp_path / "r")
    assert main(["train", "--run-dir", str(rd), "--resume", "--force-change", "--quiet", "trainer.steps=3",
                 "algo.loss.options.clip_high=0.3"]) == 0
    seg = read_segments(rd)[-1]
    assert seg["forced"] is True and seg["forced_keys"] == ["algo.loss.options.clip_high"]
    assert seg["changed"]["algo.loss.options.clip_high"][1] == 0.3
    assert "clip_high: 0.3" in (rd / "config.yaml").read_text()


def test_budget_already_reached_is_nothing_to_resume(trained, tmp_path, capsys):
    rd = _copy(trained, tmp_path / "r")
    assert main(["train", "--run-dir", str(rd), "--resume"]) == 2
    assert "trainer.steps=N with N > 2" in _err(capsys)
    # a meaning change is named first, even when the step budget is also reached
    assert main(["train", "--run-dir", str(rd), "--resume", "optim.lr=1"]) == 2
    assert "optim.lr" in _err(capsys)


def test_extend_keys_are_only_budget_cadence_and_logging():
    assert extends_only("trainer.steps") and extends_only("logging.progress")
    for key in ("optim.lr", "algo.loss.name", "rollout.group_size", "seed", "buffer.staleness", "preset"):
        assert not extends_only(key)
    assert all(k.startswith(("trainer.", "run_dir")) for k in EXTEND_KEYS)
