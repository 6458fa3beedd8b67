"""A user reward that fails stops the run with a checkpoint and one line naming the function (task.on_reward_error
=stop), whether it fails in the step-0 evaluation or on a training batch; ``--resume`` after fixing it goes on."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

BASE = ["trainer.steps=2", "trainer.sft_warmup_steps=0", "rollout.prompts_per_step=4", "rollout.group_size=2",
        "trainer.eval_every=0", "--quiet"]


def _reward_file(tmp_path, fail_rows: int, message: str = "picky failed"):
    f = tmp_path / "user_rewards.py"
    f.write_text("def picky(completions, answers, **columns):\n"
                 f"    if len(completions) == {fail_rows}:\n"
                 f"        raise ValueError({message!r})\n"
                 "    return [float(c.strip() == a) for c, a in zip(completions, answers)]\n")
    return f


def _train(run_dir, reward, *extra):
    return subprocess.run([sys.executable, "-m", "offpolicy_moe", "train", *BASE, f"task.rewards=[{{fn: {reward}:picky}}]",
                           "--run-dir", str(run_dir), *extra], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("where, fail_rows, step", [("evaluation", 128, 0), ("training batch", 8, 0)])
def test_a_failing_reward_stops_with_a_checkpoint_and_one_line(tmp_path, where, fail_rows, step):
    run = tmp_path / "run"
    out = _train(run, _reward_file(tmp_path, fail_rows))
    assert out.returncode == 1, out.stderr[-2000:]
    err = [line for line in out.stderr.strip().splitlines() if line]
    assert len(err) == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert "reward 'picky'" in err[0] and "picky failed" in err[0] and f"step_{step}" in err[0]
    assert err[0].count("checkpointed in") == 1, err[0]      # checkpointed once, by whichever handler met it first
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["steps"] == step
    assert (run / "checkpoints" / f"step_{step}" / "manifest.json").is_file()


def test_a_reward_message_that_reads_like_a_checkpoint_still_gets_one(tmp_path):
    """Whether the state was checkpointed is read from the error's ``checkpoint_step``, never from its text: a
    reward whose own message says "checkpointed in: ..." fails in the step-0 evaluation and is checkpointed there."""
    run = tmp_path / "run"
    saved = f"the last good state (step 0) is checkpointed in {run / 'checkpoints' / 'step_0'}"
    out = _train(run, _reward_file(tmp_path, 128, message="checkpointed in: nowhere"))
    assert out.returncode == 1, out.stderr[-2000:]
    err = [line for line in out.stderr.strip().splitlines() if line]
    assert len(err) == 1 and "checkpointed in: nowhere" in err[0], out.stderr[-2000:]
    assert err[0].endswith(saved), err[0]
    assert (run / "checkpoints" / "step_0" / "manifest.json").is_file()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["error"].startswith("RewardError: ") and summary["error"].endswith(saved), summary["error"]
