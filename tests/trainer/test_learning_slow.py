"""Slow learning test (excluded by default): `python -m pytest -m slow tests/trainer`.

After a short SFT warm start, on-policy GRPO raises the sampled reward on the training prompts.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from offpolicy_moe.config.load import load_config
from offpolicy_moe.trainer.launch import train


@pytest.mark.slow
def test_grpo_raises_reward(tmp_path):
    cfg = load_config(None, ["task.num_terms=2", "task.eval_size=50", "optim.lr=1e-3", "trainer.threads=1",
                             "trainer.sft_warmup_steps=40", "trainer.steps=40", "rollout.max_new_tokens=3",
                             "rollout.dtype=float32", "algo.routing.metrics=false", "trainer.eval_every=0",
                             "logging.progress=false", "trainer.min_free_mb=1", "buffer.staleness=1"])
    cfg.run_dir = str(tmp_path / "run")
    summary = train(cfg)
    assert summary["status"] == "completed"
    rows = [json.loads(l) for l in open(Path(cfg.run_dir) / "metrics.jsonl")][1:]
    first = sum(r["reward/mean"] for r in rows[:10]) / 10
    last = sum(r["reward/mean"] for r in rows[-10:]) / 10
    assert last > first + 0.05, (first, last)


@pytest.mark.slow
def test_demo_recipe_improves_held_out_accuracy(tmp_path):
    """The README's main job: SFT, then 250 stale (k=2) GRPO+TIS+R3 steps from a bf16 engine, seed 0."""
    from offpolicy_moe.commands.demo import DEMO_OVERRIDES, summarize

    cfg = load_config(None, DEMO_OVERRIDES + ["trainer.steps=250", "seed=0", "logging.progress=false",
                                              "trainer.min_free_mb=1"])
    cfg.run_dir = str(tmp_path / "demo")
    assert train(cfg)["status"] == "completed"
    s = summarize(cfg.run_dir)
    assert s["accuracy_after"] > s["accuracy_before"] + 0.1, s
    assert s["kl_r3"] < s["kl_no_r3"], s
