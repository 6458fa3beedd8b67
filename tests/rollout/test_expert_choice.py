"""The route recorder's fallback (the experts chosen from the router logits where a kernel selects inside itself)
against vLLM's own selection functions, for every family rule it reproduces: softmax top-k, sigmoid scores with a
correction bias, group-limited top-k with and without the bias; and the families it refuses, by name.

The recorder is driven through a small module tree named as vLLM names its models' (``model.layers.<i>.mlp.gate``
beside ``...mlp.experts`` holding the layer's selection settings), with a stand-in for the model runner's batch."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from offpolicy_moe.rollout import vllm_worker
from offpolicy_moe.rollout.expert_choice import ExpertRule, choose_experts, rule_of

cpu_moe = pytest.importorskip("vllm.model_executor.layers.fused_moe.cpu_fused_moe")


def vllm_ids(logits: torch.Tensor, top_k: int, *, grouped: bool = False, groups: int = 0, top_groups: int = 0,
             scoring: str = "softmax", bias=None) -> torch.Tensor:
    """vLLM's own choice (its CPU path: ``select_experts``, which calls ``grouped_topk`` for grouped layers)."""
    _, ids = cpu_moe.select_experts(hidden_states=torch.zeros(logits.shape[0], 4), router_logits=logits,
                                    top_k=top_k, use_grouped_topk=grouped, renormalize=True, topk_group=top_groups,
                                    num_expert_group=groups, scoring_func=scoring, e_score_correction_bias=bias)
    return ids


def same_sets(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.sort(-1).values.long(), b.sort(-1).values.long())


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 24), experts=st.sampled_from([4, 8, 16, 64]),
       k=st.integers(1, 4), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_softmax_top_k_is_vllms(seed, n, experts, k, dtype):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, experts, generator=g).to(dtype)
    rule = ExpertRule(top_k=k)
    assert same_sets(choose_experts(logits, rule), vllm_ids(logits, k))


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 24), shape=st.sampled_from([(8, 4, 2), (16, 4, 2),
                                                                                   (32, 8, 4), (64, 8, 3)]),
       k=st.integers(1, 6), scoring=st.sampled_from(["sigmoid", "softmax"]), biased=st.booleans(),
       bias_scale=st.sampled_from([0.01, 0.5, 3.0]))
def test_grouped_and_biased_choices_are_vllms(seed, n, shape, k, scoring, biased, bias_scale):
    """DeepSeek-V3 (sigmoid, bias, groups), DeepSeek-V2 (softmax, groups, no bias), and every mix."""
    experts, groups, top_groups = shape
    k = min(k, top_groups * (experts // groups))
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, experts, generator=g)
    bias = torch.randn(experts, generator=g) * bias_scale if biased else None
    rule = ExpertRule(top_k=k, scoring=scoring, groups=groups, top_groups=top_groups, biased=biased)
    want = vllm_ids(logits, k, grouped=True, groups=groups, top_groups=top_groups, scoring=scoring, bias=bias)
    assert same_sets(choose_experts(logits, rule, bias), want)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 24), experts=st.sampled_from([8, 16, 64]),
       k=st.integers(1, 6))
def test_sigmoid_with_a_bias_and_one_group_is_vllms(seed, n, experts, k):
    """A biased layer without expert groups (vLLM's degenerate grouping: one group, one kept)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, experts, generator=g)
    bias = torch.randn(experts, generator=g)
    rule = ExpertRule(top_k=k, scoring="sigmoid", biased=True)
    want = vllm_ids(logits, k, grouped=True, groups=1, top_groups=1, scoring="sigmoid", bias=bias)
    assert same_sets(choose_experts(logits, rule, bias), want)


# ------------------------------------------------------------------------------------- through the route recorder
class Experts(torch.nn.Module):
    """The selection settings vLLM's routed-experts layer carries (RoutedExperts' attribute names)."""

    def __init__(self, top_k, scoring="softmax", grouped=False, groups=None, top_groups=None, bias=None,
                 custom=None):
        super().__init__()
        self.top_k, self.scoring_func, self.use_grouped_topk = top_k, scoring, grouped
        self.num_expert_group, self.topk_group, self.custom_routing_function = groups, top_groups, custom
        self.e_score_correction_bias = bias


class MoE(torch.nn.Module):
    def __init__(self, hidden, experts):
        super().__init__()
        self.gate = torch.nn.Linear(hidden, experts.e_score_correction_bias.numel()
                                    if experts.e_score_correction_bias is not None else 16, bias=False)
        self.experts = experts

    def forward(self, h):
        self.gate(h)
        return h


class Layer(torch.nn.Module):
    def __init__(self, hidden, experts):
        super().__init__()
        self.mlp = MoE(hidden, experts)


class Inner(torch.nn.Module):
    def __init__(self, hidden, make_experts, layers):
        super().__init__()
        self.embed = torch.nn.Embedding(50, hidden)
        self.layers = torch.nn.ModuleList(Layer(hidden, make_experts()) for _ in range(layers))


class DeepseekV3ForCausalLM(torch.nn.Module):
    """Named as vLLM's class, so that a refusal names the family."""

    def __init__(self, make_experts, hidden=8, layers=2):
        super().__init__()
        self.model = Inner(hidden, make_experts, layers)

    def forward(self, input_ids, positions):
        h = self.model.embed(input_ids)
        for layer in self.model.layers:
            h = layer.mlp(h)
        return h


def _runner(model):
    batch = SimpleNamespace(num_reqs=2, req_ids=["a", "b"])
    return SimpleNamespace(model=model, input_batch=batch, query_start_loc=SimpleNamespace(np=np.array([0, 3, 5])))


def _deepseek_like(seed=0):
    torch.manual_seed(seed)
    return DeepseekV3ForCausalLM(lambda: Experts(top_k=4, scoring="sigmoid", grouped=True, groups=4, top_groups=2,
                                                 bias=torch.nn.Parameter(torch.randn(16) * 2.0)))


def test_the_recorders_fallback_chooses_as_vllm_for_a_deepseek_v3_router():
    """Sigmoid scores + correction bias + group-limited top-k: the recorder's routes are vLLM's ``grouped_topk``
    ids of the same logits (the plain top-k of the logits, the old fallback, replays other experts)."""
    model = _deepseek_like()
    rec = vllm_worker.RouteRecorder(_runner(model), top_k=4)
    ids = torch.tensor([3, 7, 9, 11, 2])
    pos = torch.tensor([0, 1, 2, 0, 1])
    with torch.no_grad():
        model(ids, pos)
    got = rec.take()
    hidden = model.model.embed(ids).detach()
    for layer_index, layer in enumerate(model.model.layers):
        logits = layer.mlp.gate(hidden).detach()
        e = layer.mlp.experts
        want = vllm_ids(logits, 4, grouped=True, groups=4, top_groups=2, scoring="sigmoid",
                        bias=e.e_score_correction_bias.detach())
        rows = torch.cat([torch.from_numpy(got["a"][1][:, layer_index].astype(np.int64)),
                          torch.from_numpy(got["b"][1][:, layer_index].astype(np.int64))])
        assert same_sets(rows, want)
        assert not same_sets(logits.topk(4, -1).indices, want)        # the old fallback would be wrong here
    assert got["a"][0].tolist() == [0, 1, 2] and got["b"][0].tolist() == [0, 1]


def test_the_fallback_reads_the_bias_the_layer_holds_now():
    """A weight sync replaces the bias: the next forward chooses with the new one."""
    model = _deepseek_like()
    rec = vllm_worker.RouteRecorder(_runner(model), top_k=4)
    ids, pos = torch.tensor([3, 7, 9, 11, 2]), torch.tensor([0, 1, 2, 0, 1])
    with torch.no_grad():
        model(ids, pos)
        first = rec.take()["a"][1].copy()
        for layer in model.model.layers:
            layer.mlp.experts.e_score_correction_bias = torch.nn.Parameter(torch.arange(16.0) * 10)
        model(ids, pos)
    second = rec.take()["a"][1]
    assert not np.array_equal(first, second)
    assert all(set(row.tolist()) <= set(range(8, 16)) for row in second.reshape(-1, 4))   # the biggest biases win


def test_a_family_the_fallback_cannot_reproduce_is_refused_by_name(monkeypatch):
    def llama4_routing(**kwargs):
        raise AssertionError("never called")

    model = DeepseekV3ForCausalLM(lambda: Experts(top_k=2, custom=llama4_routing))
    runner = _runner(model)
    rec = vllm_worker.RouteRecorder(runner, top_k=2)
    with pytest.raises(RuntimeError, match="DeepseekV3ForCausalLM's MoE layers route with a custom function "
                                           r"\(llama4_routing\)") as err:
        with torch.no_grad():
            model(torch.tensor([1, 2, 3, 4, 5]), torch.tensor([0, 1, 2, 0, 1]))
    assert "\n" not in str(err.value)
    rec.remove()
    # where no kernel selection can be watched (a GPU), the refusal comes at install, before any generation
    monkeypatch.setattr(vllm_worker, "_watch_kernel_selection", lambda rec: False)
    worker = SimpleNamespace(model_runner=runner)
    with pytest.raises(RuntimeError, match="custom function") as err:
        vllm_worker.install_route_recorder(worker, 2)
    assert "\n" not in str(err.value)
    assert not hasattr(runner, "_offpolicy_moe_routes")
    assert not model._forward_pre_hooks                          # its hooks were taken off again


def test_rules_are_read_off_vllms_layer_settings():
    bias = torch.zeros(16)
    assert rule_of(Experts(top_k=2)) == ExpertRule(top_k=2)
    assert rule_of(Experts(top_k=8, scoring="sigmoid", grouped=True, groups=8, top_groups=4, bias=bias)) == \
        ExpertRule(top_k=8, scoring="sigmoid", groups=8, top_groups=4, biased=True)
    assert rule_of(Experts(top_k=2, grouped=False, groups=8, top_groups=4)).groups == 1       # not grouped
    assert "sqrtsoftplus" in rule_of(Experts(top_k=6, scoring="sqrtsoftplus"), family="DeepseekV4").refused
    zero = type("ZeroExpertRouter", (), {"select_experts": None})()
    assert "ZeroExpertRouter" in rule_of(Experts(top_k=2), zero).refused
    hashed = type("FusedTopKBiasRouter", (), {"select_experts": None, "hash_indices_table": torch.zeros(3)})()
    assert "hash" in rule_of(Experts(top_k=2, bias=bias), hashed).refused
    assert rule_of(Experts(top_k=2), type("GroupedTopKRouter", (), {})()).refused == ""
