"""``model.experts_implementation=auto`` (offpolicy_moe/models/experts.py) on the anchor preset: on the CPU exactly
the family's own per-expert loop (``eager``) from ``N * K * H >= LOOP_MIN_ELEMENTS`` and exactly ``grouped_mm``
below it, the two equal up to float rounding in values and gradients (an expert without tokens, top-1 and top-3
included); ``grouped_mm`` under expert parallelism; the names it resolves."""
from __future__ import annotations

import copy

import pytest
import torch
from transformers.integrations.moe import grouped_mm_experts_forward

from offpolicy_moe.config.schema import ModelConfig
from offpolicy_moe.models import load_policy
from offpolicy_moe.models import experts as experts_module
from offpolicy_moe.models.experts import (AUTO, LOOP_MIN_ELEMENTS, NAME, auto_experts_forward,
                                          resolve_experts_implementation)


def _eager(experts, x, idx, w):
    """The class's own loop, called the way transformers' ``eager`` calls it."""
    return type(experts).forward.__wrapped__(experts, x, idx, w)


def _experts(top_k=2, experts=4, hidden=32, seed=0):
    model, _ = load_policy(ModelConfig(num_layers=1, hidden_size=hidden, num_experts=experts, top_k=top_k), seed=seed)
    return model.model.layers[0].mlp.experts


def _run(fn, experts, x, idx, w):
    x = x.clone().requires_grad_(True)
    w = w.clone().requires_grad_(True)
    experts.zero_grad(set_to_none=True)
    out = fn(experts, x, idx, w)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return out.detach(), x.grad, w.grad, {n: p.grad for n, p in experts.named_parameters()}


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a[:3], b[:3])) and all(torch.equal(a[3][n], b[3][n]) for n in b[3])


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_auto_equals_grouped_mm_values_and_gradients(top_k, monkeypatch):
    monkeypatch.setattr(experts_module, "LOOP_MIN_ELEMENTS", 0)       # every call takes the per-expert loop
    experts = _experts(top_k=top_k)
    g = torch.Generator().manual_seed(top_k)
    N, E = 37, experts.num_experts
    x = torch.randn(N, 32, generator=g)
    idx = torch.stack([torch.randperm(E, generator=g)[:top_k] for _ in range(N)])
    if top_k == 1:
        idx[idx == 3] = 0                                  # expert 3 gets no token
    w = torch.rand(N, top_k, generator=g)
    ref = _run(grouped_mm_experts_forward, experts, x, idx, w)
    out = _run(auto_experts_forward, experts, x, idx, w)
    eager = _run(_eager, experts, x, idx, w)
    torch.testing.assert_close(out[0], ref[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(out[1], ref[1], rtol=0, atol=1e-6)
    torch.testing.assert_close(out[2], ref[2], rtol=0, atol=1e-6)
    for name in ref[3]:
        torch.testing.assert_close(out[3][name], ref[3][name], rtol=0, atol=1e-5)
    assert _same(out, eager)


def test_size_picks_the_implementation():
    """Below N * K * H = LOOP_MIN_ELEMENTS exactly grouped_mm, from it exactly the per-expert loop."""
    experts = _experts(top_k=2, hidden=32)
    for n, loop in ((LOOP_MIN_ELEMENTS // 64 - 1, False), (LOOP_MIN_ELEMENTS // 64, True)):
        g = torch.Generator().manual_seed(n)
        x = torch.randn(n, 32, generator=g)
        idx = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(n)])
        w = torch.rand(n, 2, generator=g)
        out = _run(auto_experts_forward, experts, x, idx, w)
        assert _same(out, _run(_eager if loop else grouped_mm_experts_forward, experts, x, idx, w)), n


def test_model_forward_and_backward_equal_grouped_mm(monkeypatch):
    monkeypatch.setattr(experts_module, "LOOP_MIN_ELEMENTS", 0)
    model, _ = load_policy(ModelConfig(num_layers=2, hidden_size=32, num_experts=4, top_k=2), seed=1)
    assert model.config._experts_implementation == NAME
    ref = copy.deepcopy(model)
    ref.set_experts_implementation("grouped_mm")
    ids = torch.tensor([[1, 4, 13, 5, 16, 8, 3], [1, 9, 15, 3, 16, 3, 7]])
    outs = []
    for m in (model, ref):
        logits = m(ids).logits
        logits.log_softmax(-1)[..., 5].mean().backward()
        outs.append((logits.detach(), {n: p.grad for n, p in m.named_parameters()}))
    torch.testing.assert_close(outs[0][0], outs[1][0], rtol=0, atol=1e-6)
    for name, grad in outs[1][1].items():
        torch.testing.assert_close(outs[0][1][name], grad, rtol=0, atol=1e-6)


def test_out_of_range_expert_ids_go_to_grouped_mm():
    """Ids past the rank's experts (expert-parallel sentinels): transformers' grouped_mm, which drops them."""
    experts = _experts()
    x = torch.randn(5, 32)
    idx = torch.tensor([[0, 1], [2, 3], [1, 4], [0, 2], [3, 1]])
    w = torch.rand(5, 2)
    experts._is_expert_parallel = True
    ref = grouped_mm_experts_forward(experts, x, idx, w)
    assert torch.equal(auto_experts_forward(experts, x, idx, w), ref)


def test_names_resolve():
    assert resolve_experts_implementation(AUTO) == NAME
    for name in ("grouped_mm", "eager", "batched_mm", None):
        assert resolve_experts_implementation(name) == name


def test_eager_and_grouped_mm_still_selectable():
    for name in ("eager", "grouped_mm"):
        model, _ = load_policy(ModelConfig(num_layers=1, hidden_size=32, num_experts=4, top_k=2,
                                           experts_implementation=name), seed=0)
        assert model.config._experts_implementation == name
