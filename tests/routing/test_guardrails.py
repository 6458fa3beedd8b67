"""Replay guardrail metrics (routing/metrics.py::replay_guardrails) on real replayed forwards of tiny models: an
adapter family (Qwen3-MoE), a generic-rule family (GLM-4-MoE) and DeepSeek-V4 (a hash-routed layer left unreplayed)."""
from __future__ import annotations

import pytest
import torch

from offpolicy_moe.routing import GUARDRAIL_METRICS, RouteTrace, RoutingController, replay_guardrails

from family_models import make_family_model
from routing_models import make_model


def _replayed(model, ctl, trace, ids):
    """The trainer's own top-k recorded in the replayed forward, as the trainer calls it."""
    with torch.no_grad(), ctl.replay(trace), ctl.record("own") as own:
        model(input_ids=ids)
    return own.trace()


def _outside(own: RouteTrace, n_out: int, num_experts: int) -> torch.Tensor:
    """Per row, ``n_out`` of the K own ids replaced by experts outside the own top-k (the rest kept)."""
    o = own.long_ids()
    out = o.clone()
    for idx in torch.cartesian_prod(*[torch.arange(d) for d in o.shape[:3]]):
        b, s, l = idx.tolist()
        free = [e for e in range(num_experts) if e not in o[b, s, l].tolist()]
        out[b, s, l, :n_out] = torch.tensor(free[:n_out])
    return out


@pytest.mark.parametrize("family", ["qwen3_moe", "glm4_moe"])
def test_outside_topk_share_is_exact(family):
    """One MoE layer (its input does not depend on the replay), so the own top-k under replay is the one recorded
    without it and the share is known exactly."""
    model = make_model(family, num_hidden_layers=1) if family == "qwen3_moe" else make_family_model(family)
    ctl = RoutingController(model)
    assert ctl.num_moe_layers == 1
    ids = torch.randint(3, 64, (2, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), ctl.record("own") as rec:
        model(input_ids=ids)
    own = rec.trace()
    self_m = replay_guardrails(own, _replayed(model, ctl, own, ids))
    assert self_m == {"routing/replay_fallback": 0.0, "routing/replay_outside_topk": 0.0,
                      "routing/replay_outside_topk_decisions": 0.0,
                      "routing/replay_decisions": float(2 * 5 * ctl.num_moe_layers)}
    assert set(self_m) == set(GUARDRAIL_METRICS)
    for n_out, share in ((1, 0.5), (2, 1.0)):
        forced = RouteTrace.from_ids(_outside(own, n_out, ctl.num_experts), ctl.num_experts, ctl.top_k,
                                     ctl.layer_ids)
        own_under_replay = _replayed(model, ctl, forced, ids)
        assert own_under_replay.equal(own)  # "own" is the router's choice, not the replayed ids
        m = replay_guardrails(forced, own_under_replay)
        assert m["routing/replay_outside_topk"] == share
        assert m["routing/replay_outside_topk_decisions"] == 1.0
        assert m["routing/replay_fallback"] == 0.0


def test_fallback_share_counts_unrecorded_rows_inside_the_mask():
    model = make_model("qwen3_moe")
    ctl = RoutingController(model)
    ids = torch.randint(3, 64, (2, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), ctl.record() as rec:
        model(input_ids=ids)
    full = rec.trace()
    recorded = torch.ones(2, 6, dtype=torch.bool)
    recorded[0, 4:] = False
    recorded[1, 1] = False
    partial = RouteTrace.from_ids(full.long_ids(), ctl.num_experts, ctl.top_k, ctl.layer_ids, recorded=recorded)
    own = _replayed(model, ctl, partial, ids)
    m = replay_guardrails(partial, own)
    assert m["routing/replay_fallback"] == 3 / 12 and m["routing/replay_outside_topk"] == 0.0
    mask = torch.zeros(2, 6, dtype=torch.bool)
    mask[:, 3:] = True  # the response: 6 tokens, 2 of them unrecorded
    m = replay_guardrails(partial, own, mask=mask)
    assert m["routing/replay_fallback"] == 2 / 6
    assert m["routing/replay_decisions"] == 4 * ctl.num_moe_layers


def test_unreplayed_hash_layers_count_as_fallback():
    model = make_family_model("deepseek_v4")
    ctl = RoutingController(model)
    ids = torch.randint(3, 64, (1, 4), generator=torch.Generator().manual_seed(2))
    with torch.no_grad(), ctl.record() as rec:
        model(input_ids=ids)
    trace = rec.trace()
    m = replay_guardrails(trace, _replayed(model, ctl, trace, ids), unreplayed_layers=len(ctl.unreplayed))
    assert len(ctl.unreplayed) == 1 and m["routing/replay_fallback"] == 0.5


def test_bad_input_refused():
    t = RouteTrace.empty(1, 3, 2, 2, 8)
    with pytest.raises(ValueError, match="differ in shape"):
        replay_guardrails(t, RouteTrace.empty(1, 4, 2, 2, 8))
    with pytest.raises(ValueError, match="mask shape"):
        replay_guardrails(t, t, mask=torch.ones(1, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="unreplayed_layers"):
        replay_guardrails(t, t, unreplayed_layers=-1)
    # nothing recorded: every decision fell back, nothing replayed
    own = RouteTrace.from_ids(torch.zeros(1, 3, 2, 2, dtype=torch.long) + torch.tensor([0, 1]), 8)
    assert replay_guardrails(t, own)["routing/replay_fallback"] == 1.0
