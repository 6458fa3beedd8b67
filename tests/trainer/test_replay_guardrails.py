"""The trainer logs the replay guardrails of R3 (routing/replay_fallback, routing/replay_outside_topk) from its
old-log-prob pass: the engine's routes against the trainer's own top-k on the same tokens."""
from __future__ import annotations


from offpolicy_moe.routing import GUARDRAIL_METRICS
from offpolicy_moe.trainer.trainer import Trainer
from tests.tiny import tiny_config


def _metrics(tmp_path, name, *overrides):
    cfg = tiny_config(tmp_path / name, "trainer.steps=1", "algo.routing.replay=r3", "rollout.dtype=float32",
                      "buffer.staleness=0", *overrides)
    tr = Trainer(cfg)
    tr.run()
    return tr.last_metrics


def test_same_weights_same_routes_nothing_to_override(tmp_path):
    m = _metrics(tmp_path, "same")
    assert set(GUARDRAIL_METRICS) <= set(m)
    assert m["routing/replay_fallback"] == 0.0 and m["routing/replay_outside_topk"] == 0.0


def test_a_perturbed_engine_router_shows_as_replayed_experts_outside_the_trainers_top_k(tmp_path):
    m = _metrics(tmp_path, "perturbed", "rollout.router_perturb=2.0")
    assert m["routing/replay_outside_topk"] > 0.05
