"""drift/* (engine route vs the current router's own top-k at off-policy mini-steps) and the pr2/* same-token
metrics, through the trainer."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from offpolicy_moe.run.metrics import is_documented
from offpolicy_moe.trainer.trainer import Trainer
from tests.tiny import tiny_config

DRIFT = ("drift/zero_dev_layer", "drift/zero_dev_token", "drift/n_tokens")


def _rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in open(Path(run_dir) / "metrics.jsonl")]


def _run(tmp_path, name, *overrides) -> list[dict]:
    cfg = tiny_config(tmp_path / name, "model.num_layers=2", "trainer.log_every=1", "rollout.router_noise=0.5",
                      *overrides)
    Trainer(cfg).run()
    return _rows(cfg.run_dir)


def _training(rows):
    return [{k: v for k, v in r.items() if not k.startswith(("perf/", "drift/"))} for r in rows]


def test_drift_metrics_are_logged_at_off_policy_mini_steps_and_change_nothing(tmp_path):
    on = _run(tmp_path, "on", "algo.routing.replay=r3", "trainer.updates_per_step=2",
              "algo.routing.drift_metrics=true")
    off = _run(tmp_path, "off", "algo.routing.replay=r3", "trainer.updates_per_step=2")
    assert _training(on) == _training(off)          # measuring the drift does not change the training
    steps = [r for r in on if "actor/loss" in r]
    assert steps and all(all(k in r for k in DRIFT) for r in steps)
    for r in steps:
        assert 0.0 <= r["drift/zero_dev_token"] <= r["drift/zero_dev_layer"] <= 1.0
        assert r["drift/n_tokens"] > 0
        assert all(is_documented(k, reward_names=("partial",)) for k in r)   # TINY: task.reward=partial
    # the engine's noisy routes differ from the trainer's own choice somewhere
    assert min(r["drift/zero_dev_layer"] for r in steps) < 1.0
    assert not any(k.startswith("drift/") for r in off for k in r)


def test_no_drift_metrics_without_an_off_policy_mini_step(tmp_path):
    rows = _run(tmp_path, "onpolicy", "algo.routing.replay=r3", "algo.routing.drift_metrics=true")
    assert not any(k.startswith("drift/") for r in rows for k in r)


def test_pr2_logs_the_same_token_counterfactual_and_skill(tmp_path):
    rows = _run(tmp_path, "pr2", "algo.routing.replay=pr2", "trainer.updates_per_step=4",
                "algo.routing.pr2_feature_sample_rate=1.0", "algo.routing.drift_metrics=true",
                "rollout.router_noise=0.0")
    steps = [r for r in rows if "pr2/num_tokens" in r]
    assert steps
    for r in steps:
        for key in ("pr2/zero_dev_layer", "pr2/zero_dev_token", "pr2/zero_dev_layer_r3", "pr2/zero_dev_token_r3",
                    "pr2/bias_route_change", "pr2/base_kl", "pr2/pred_kl", *DRIFT):
            assert key in r, key
        assert 0.0 <= r["pr2/zero_dev_token"] <= r["pr2/zero_dev_layer"] <= 1.0
        assert 0.0 <= r["pr2/zero_dev_token_r3"] <= r["pr2/zero_dev_layer_r3"] <= 1.0
    # the zero-initialised predictor adds no bias before its first update: the first PR2 step's routes are R3's
    first = steps[0]
    assert first["pr2/bias_route_change"] == 0.0
    assert first["pr2/zero_dev_layer"] == pytest.approx(first["pr2/zero_dev_layer_r3"])
