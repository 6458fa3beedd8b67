"""A user reward in a file outside the package, named by path, through the CLI with buffer.mode=async: the trainer
and the rollout worker each import it (the worker builds the task from the config), and the trainer scores with it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow          # a real async run with a worker process: about 40 s on one core

REWARD = '''\
import os

LOG = os.environ["BYO_REWARD_LOG"]
with open(LOG, "a") as fh:
    fh.write(f"import {os.getpid()}\\n")


def digits_only(completions, answers, **columns):
    with open(LOG, "a") as fh:
        fh.write(f"call {os.getpid()} {len(completions)}\\n")
    return [1.0 if c.strip().isdigit() else 0.0 for c in completions]
'''


def test_async_worker_imports_a_user_reward_file(tmp_path):
    user = tmp_path / "outside" / "my_reward.py"
    user.parent.mkdir()
    user.write_text(REWARD)
    log = tmp_path / "reward.log"
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "offpolicy_moe", "train", "--run-dir", str(run_dir),
           "buffer.mode=async", "rollout.workers=1", "buffer.staleness=1", "trainer.steps=3", "trainer.threads=1",
           "model.num_layers=1", "model.hidden_size=32", "model.num_experts=4", "model.top_k=2",
           "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=3", "task.eval_size=8",
           "trainer.eval_every=0", "trainer.sft_warmup_steps=0", "logging.progress=false", "logging.loggers=[jsonl]",
           "trainer.min_free_mb=1", "task.on_reward_error=stop",
           f"task.rewards=[{{fn: exact}}, {{fn: '{user}:digits_only', weight: 0.5}}]"]
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled", PYTHONPATH=str(REPO), BYO_REWARD_LOG=str(log))
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert [r["step"] for r in rows][-1] == 3
    events = [line.split() for line in log.read_text().splitlines()]
    importers = {int(e[1]) for e in events if e[0] == "import"}
    callers = {int(e[1]) for e in events if e[0] == "call"}
    assert len(importers) >= 2, events                 # the trainer and the rollout worker
    assert callers and callers <= importers
    assert sum(int(e[2]) for e in events if e[0] == "call") >= 3 * 16     # every trained sequence was scored
