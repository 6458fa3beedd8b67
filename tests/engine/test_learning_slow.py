"""Slow learning test (excluded by default): `python -m pytest -m slow tests/engine`.

After a short SFT warm start, on-policy GRPO raises the sampled reward on the training prompts.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from offpolicy_moe.config.load import load_config
from offpolicy_moe.engine.trainer import train


@pytest.mark.slow
def test_grpo_raises_reward(tmp_path):
    cfg = load_config(None, ["trainer.sft_warmup_steps=40", "trainer.steps=40", "rollout.max_new_tokens=3",
                             "rollout.dtype=float32", "algo.routing.metrics=false", "trainer.eval_every=0",
                             "logging.progress=false", "trainer.min_free_mb=1", "buffer.staleness=1"])
    cfg.run_dir = str(tmp_path / "run")
    summary = train(cfg)
    assert summary["status"] == "completed"
    rows = [json.loads(l) for l in open(Path(cfg.run_dir) / "metrics.jsonl")][1:]
    first = sum(r["reward/mean"] for r in rows[:10]) / 10
    last = sum(r["reward/mean"] for r in rows[-10:]) / 10
    assert last > first + 0.05, (first, last)
