"""The cost model that picks the trainer's forward (plain, packed, shared KV cache) and the equivalence of every
forward it can pick: a deterministic function of the shapes, the cheapest estimate, plain when unsure, and log-probs
and gradients equal to the plain forward's whatever it picks (packing with any number of samples per row included).
"""
from __future__ import annotations

import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings, strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_shared_prompt import _batch, _count_tokens, _grads, _model  # noqa: E402

from offpolicy_moe.models.forward_plan import (MODES, ForwardCostModel, ForwardPlan, choose_forward,  # noqa: E402
                                               forward_costs)

ANCHOR = SimpleNamespace(hidden_size=128, num_attention_heads=8, head_dim=16, num_key_value_heads=4,
                         num_hidden_layers=4, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128,
                         vocab_size=20)


def _brute(P, R, counts, cm):
    """Loop reference: every packing width c in 2..max(counts) (the model considers the sizes present and powers
    of two only, so the reference restricts to those), costs written out token by token."""
    w, B, S = cm.entry_weight, sum(counts), P + R + 1
    plain = sum(S + w * S * S for _ in range(B))
    packs = {}
    for c in range(2, max(counts) + 1):
        if c not in counts and c & (c - 1):
            continue
        rows = sum(math.ceil(n / c) for n in counts)
        L = P + c * R
        packs[c] = sum(L + w * L * L for _ in range(rows))
    cache = sum(P + w * P * P for _ in counts)
    if R:
        cache += sum(R + w * R * (P + R) + cm.cache_copy * (P + R) for _ in range(B)) + cm.pass_overhead
    return plain, packs, cache


@settings(max_examples=60, deadline=None)
@given(P=st.integers(1, 40), R=st.integers(0, 300), counts=st.lists(st.integers(1, 17), min_size=1, max_size=6))
def test_costs_match_loop_reference_and_choice_is_the_cheapest(P, R, counts):
    cm = ForwardCostModel.from_config(ANCHOR)
    costs = forward_costs(P, R, counts, cm)
    plain, packs, cache = _brute(P, R, counts, cm)
    assert costs["plain"][0] == pytest.approx(plain, rel=1e-9)
    assert costs["cache"][0] == pytest.approx(cache, rel=1e-9)
    if packs:
        c = costs["pack"][1]
        assert costs["pack"][0] == pytest.approx(min(packs.values()), rel=1e-9)
        assert packs[c] == pytest.approx(min(packs.values()), rel=1e-9)
    else:
        assert "pack" not in costs
    for allowed in (MODES, ("plain", "pack"), ("plain", "cache"), ("plain",)):
        mode = choose_forward(costs, allowed)
        assert mode == choose_forward(dict(costs), allowed)       # deterministic
        assert mode in allowed or mode == "plain"
        if mode != "plain":
            assert costs[mode][0] <= cm.margin * costs["plain"][0]
            assert all(costs[mode][0] <= costs[m][0] for m in allowed if m in costs and m != "plain")
        else:
            assert all(costs[m][0] > cm.margin * costs["plain"][0] for m in allowed if m in costs and m != "plain")


def test_choice_on_the_anchor_model_shares_short_and_runs_long_responses_plain():
    cm = ForwardCostModel.from_config(ANCHOR)
    for G in (4, 8, 16):
        assert choose_forward(forward_costs(7, 7, [G] * 16, cm), MODES) != "plain"      # 8 new tokens
        assert choose_forward(forward_costs(7, 7, [G] * 16, cm), ("plain", "pack")) == "pack"
        for T in (64, 128, 256):                                                        # long: attention^2 loses
            assert choose_forward(forward_costs(7, T - 1, [G] * 16, cm), MODES) == "plain"
    # a long prompt with short responses: sharing it pays
    assert choose_forward(forward_costs(200, 15, [8] * 16, cm), MODES) != "plain"


def test_mask_budget_and_bad_input():
    cm = ForwardCostModel.from_config(ANCHOR)
    costs = forward_costs(6, 4, [4] * 5, cm, max_mask_elements=5 * (6 + 2 * 4) ** 2 * 2)
    assert costs["pack"][1] == 2                             # c = 4 would need 5 x 22^2 mask entries
    assert "pack" not in forward_costs(6, 4, [4] * 5, cm, max_mask_elements=10)
    for bad in ((0, 4, [4]), (6, -1, [4]), (6, 4, []), (6, 4, [0, 3])):
        with pytest.raises(ValueError, match="forward_costs"):
            forward_costs(*bad, cm)
    with pytest.raises(ValueError, match="unknown forward modes"):
        choose_forward(costs, ("plain", "flash"))
    m = ForwardPlan("pack", costs, 2).metrics()
    assert m["perf/forward_pack"] == 1.0 and m["perf/forward_plain"] == m["perf/forward_cache"] == 0.0
    assert m["perf/forward_est_speedup"] == pytest.approx(costs["plain"][0] / costs["pack"][0])
    assert set(ForwardPlan("plain").metrics()) == set(m)     # same keys every time (cross-process mean)


@pytest.mark.parametrize("way", ["plain", "pack1", "pack2", "pack3", "pack4", "cache", "auto"])
def test_every_choice_gives_the_plain_log_probs_and_gradients(way):
    from offpolicy_moe.models.response_logprobs import response_logprobs
    from offpolicy_moe.models.prompt_packing import plan_group_packing

    torch.manual_seed(0)
    model, _ = _model()
    model.train()
    ids, am, ram = _batch(U=4, G=4, P=6, T=6)
    keep = torch.tensor([b for b in range(ids.shape[0]) if b % 7 != 3])      # groups of unequal size
    ids, am, ram = ids[keep], am[keep], ram[keep]
    kw = {}
    if way.startswith("pack"):
        kw["packing"] = plan_group_packing(ids, am, 6, samples_per_row=int(way[4:]))
        assert kw["packing"] is not None
    elif way != "plain":
        kw["share_prompt"] = "cache" if way == "cache" else True
    plain = lambda: response_logprobs(model, ids, am, 6, temperature=0.7, response_mask=ram)  # noqa: E731
    other = lambda: response_logprobs(model, ids, am, 6, temperature=0.7, response_mask=ram, **kw)  # noqa: E731
    torch.testing.assert_close(other(), plain(), rtol=0, atol=2e-5)
    ga, gb = _grads(model, plain), _grads(model, other)
    assert ga.keys() == gb.keys() and len(ga) > 10
    for k in ga:
        scale = max(ga[k].abs().max().item(), 1e-3)
        torch.testing.assert_close(gb[k], ga[k], rtol=0, atol=2e-5 * scale, msg=lambda s, k=k: f"{k}: {s}")


def test_auto_feeds_what_the_plan_says():
    """``share_prompt=True`` runs exactly the forward :func:`plan_shared_forward` picked: packed rows of ``c``
    samples for short responses, the plain ``[B, S]`` batch for long ones; ``samples_per_row`` is honoured."""
    from offpolicy_moe.models.response_logprobs import plan_shared_forward, response_logprobs
    from offpolicy_moe.models.prompt_packing import plan_group_packing

    model, _ = _model()
    for T in (3, 60):
        ids, am, ram = _batch(U=5, G=4, P=6, T=T)
        plan, packing = plan_shared_forward(model, ids, am, 6, True)
        seen, h = _count_tokens(model)
        try:
            response_logprobs(model, ids, am, 6, response_mask=ram, share_prompt=True)
        finally:
            h.remove()
        if T == 3:
            assert plan.mode == "pack" and seen == [packing.num_rows * packing.length]
        else:
            assert plan.mode == "plain" and packing is None and seen == [20 * (6 + T)]
    ids, am, _ = _batch(U=5, G=4, P=6, T=5)
    p2 = plan_group_packing(ids, am, 6, samples_per_row=2)
    assert (p2.num_rows, p2.length) == (10, 6 + 2 * 4)
    assert plan_shared_forward(model, ids, am, 6, False)[0].mode == "plain"
    assert plan_shared_forward(model, ids, am, 6, True, allowed=("plain",))[0].mode == "plain"
    with pytest.raises(ValueError, match="samples_per_row"):
        plan_group_packing(ids, am, 6, samples_per_row=0)
