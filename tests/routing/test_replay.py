"""Replay (R3/R2) on tiny models of every family: exactness, forced routes, weights rule, gradients, checkpointing."""
import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointError
from transformers import AutoConfig, AutoModelForCausalLM

from routing_models import FAMILIES, batch, make_model
from offpolicy_moe.routing import (RouteTrace, RouterBypassError, RoutingController, TraceValidationError,
                                   UnsupportedRouterError)


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _fwd_bwd(model, ids, mask, pos):
    model.zero_grad(set_to_none=True)
    out = model(ids, attention_mask=mask, position_ids=pos)
    (out.logits.float() * torch.linspace(-1, 1, out.logits.shape[-1])).sum().backward()
    return out.logits.detach(), _grads(model)


def _router_weight_names(model):
    return [n for n, _ in model.named_parameters() if n.endswith(("mlp.gate.weight", "mlp.router.weight"))]


def _forced_trace(ctl, b, s, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(ctl.num_experts, generator=g)[:ctl.top_k]
                       for _ in range(b * s * ctl.num_moe_layers)]).view(b, s, ctl.num_moe_layers, ctl.top_k)
    return RouteTrace.from_ids(ids, ctl.num_experts, ctl.top_k, ctl.layer_ids)


class ExpertSpy:
    """Records the (indices, weights) each experts module receives; independent of the controller."""

    def __init__(self, model):
        self.calls = []
        self.handles = [m.register_forward_pre_hook(self._hook) for n, m in model.named_modules()
                        if n.endswith("mlp.experts")]

    def _hook(self, module, args):
        self.calls.append((args[1].clone(), args[2].detach().clone()))

    def remove(self):
        for h in self.handles:
            h.remove()


class LogitSpy:
    def __init__(self, model):
        self.logits = []
        self.handles = [m.register_forward_hook(lambda mod, a, o: self.logits.append(o[0].detach().clone()))
                        for n, m in model.named_modules() if n.endswith(("mlp.gate", "mlp.router"))
                        and not isinstance(m, torch.nn.Linear)]

    def remove(self):
        for h in self.handles:
            h.remove()


def reference_weights(family, router, logits, idx):
    """The weighting rule of each family, written from the model papers/configs (not from the adapters)."""
    if family in ("qwen3_moe", "qwen2_moe", "olmoe"):
        p = torch.exp(logits.double() - torch.logsumexp(logits.double(), -1, keepdim=True))
        w = torch.stack([p[t, idx[t]] for t in range(len(idx))])
        return w / w.sum(-1, keepdim=True) if router.norm_topk_prob else w
    if family == "mixtral":
        p = torch.softmax(logits.double(), -1)
        w = torch.stack([p[t, idx[t]] for t in range(len(idx))])
        return w / w.sum(-1, keepdim=True)
    if family == "deepseek_v3":
        sig = 1 / (1 + torch.exp(-logits.double()))
        w = torch.stack([sig[t, idx[t]] for t in range(len(idx))])
        w = w / w.sum(-1, keepdim=True)
        return w * router.routed_scaling_factor
    if family == "gpt_oss":
        sel = torch.stack([logits.double()[t, idx[t]] for t in range(len(idx))])
        return torch.exp(sel) / torch.exp(sel).sum(-1, keepdim=True)
    raise KeyError(family)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_self_replay_exact_and_forced_routes(family):
    model = make_model(family).train()
    ctl = RoutingController(model)
    ids, mask, pos = batch()
    b, s = ids.shape
    with torch.no_grad(), ctl.record() as rec:
        model(ids, attention_mask=mask, position_ids=pos)
    own = rec.trace()
    own.validate(seq_shape=(b, s))
    assert not ctl.active
    logits0, g0 = _fwd_bwd(model, ids, mask, pos)
    with ctl.replay(own):
        logits1, g1 = _fwd_bwd(model, ids, mask, pos)
    assert torch.equal(logits0, logits1)
    assert g0.keys() == g1.keys() and all(torch.equal(g0[n], g1[n]) for n in g0)

    # forced routes: the experts receive exactly the replayed ids, weighted by the family rule on the full dist.
    forced = _forced_trace(ctl, b, s)
    spy, lspy = ExpertSpy(model), LogitSpy(model)
    try:
        with ctl.replay(forced), ctl.record() as used, ctl.record(which="own") as native:
            logits2, g2 = _fwd_bwd(model, ids, mask, pos)
    finally:
        spy.remove()
        lspy.remove()
    assert len(spy.calls) == ctl.num_moe_layers
    routers = ctl.routers
    for layer, (idx, w) in enumerate(spy.calls):
        assert torch.equal(idx, forced.long_ids()[:, :, layer].reshape(b * s, -1))
        ref = reference_weights(family, routers[layer], lspy.logits[layer], idx)
        assert torch.allclose(w.double(), ref, rtol=1e-5, atol=1e-6), family
    assert used.trace().equal(forced)
    # the model's own choice, recorded while replaying: the first MoE layer's input does not depend on routes
    assert torch.equal(native.trace().ids[:, :, 0], own.ids[:, :, 0])
    assert not torch.allclose(logits0, logits2)
    for n in _router_weight_names(model):
        assert g2[n].abs().sum() > 0, n  # router gradients flow under replay
        assert not torch.equal(g2[n], g0[n])  # and depend on the replayed routes


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss"])
def test_self_replay_exact_bf16_and_eager(family):
    model = make_model(family, dtype=torch.bfloat16, experts="eager").train()
    ctl = RoutingController(model)
    ids, mask, pos = batch(seed=3)
    with torch.no_grad(), ctl.record() as rec:
        model(ids, attention_mask=mask, position_ids=pos)
    logits0, g0 = _fwd_bwd(model, ids, mask, pos)
    with ctl.replay(rec.trace()):
        logits1, g1 = _fwd_bwd(model, ids, mask, pos)
    assert torch.equal(logits0, logits1) and all(torch.equal(g0[n], g1[n]) for n in g0)


def test_sentinel_rows_use_own_choice():
    model = make_model("qwen3_moe")
    ctl = RoutingController(model)
    ids, mask, pos = batch()
    b, s = ids.shape
    forced = _forced_trace(ctl, b, s, seed=5)
    with torch.no_grad(), ctl.record() as rec:
        model(ids, attention_mask=mask, position_ids=pos)
    own = rec.trace()
    partial = forced.long_ids()
    partial[:, 4:] = -1  # only the first 4 positions forced
    partial = RouteTrace.from_ids(partial, 8, 2, ctl.layer_ids)
    with torch.no_grad(), ctl.replay(partial), ctl.record() as used:
        model(ids, attention_mask=mask, position_ids=pos)
    u = used.trace()
    assert torch.equal(u.ids[:, :4], forced.ids[:, :4])
    assert torch.equal(u.ids[:, 4:, 0], own.ids[:, 4:, 0])  # layer 0 input does not depend on earlier routes
    assert bool((u.ids != 255).all())


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_gradient_checkpointing_exact(family):
    ids, mask, pos = batch(seed=1)
    ref_model = make_model(family).train()
    ctl_ref = RoutingController(ref_model)
    forced = _forced_trace(ctl_ref, *ids.shape, seed=2)
    with ctl_ref.replay(forced):
        logits_ref, g_ref = _fwd_bwd(ref_model, ids, mask, pos)  # backward inside the block, no checkpointing

    model = make_model(family).train()
    ctl = RoutingController(model)
    ctl.enable_gradient_checkpointing()
    model.zero_grad(set_to_none=True)
    with ctl.replay(forced):
        out = model(ids, attention_mask=mask, position_ids=pos)
    assert not ctl.active
    (out.logits.float() * torch.linspace(-1, 1, out.logits.shape[-1])).sum().backward()  # recompute after the block
    g = _grads(model)
    assert not ctl.active
    assert torch.equal(out.logits.detach(), logits_ref)
    assert g.keys() == g_ref.keys() and all(torch.equal(g[n], g_ref[n]) for n in g), family

    # without the context function the recompute routes differently: torch refuses or the grads are wrong
    naive = make_model(family).train()
    ctl_n = RoutingController(naive)
    naive.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    with ctl_n.replay(forced):
        out_n = naive(ids, attention_mask=mask, position_ids=pos)
    try:
        (out_n.logits.float() * torch.linspace(-1, 1, out_n.logits.shape[-1])).sum().backward()
        wrong = not all(torch.equal(_grads(naive)[n], g_ref[n]) for n in g_ref)
    except CheckpointError:
        wrong = True
    assert wrong


def test_nothing_stays_patched_even_on_exception():
    model = make_model("qwen3_moe")
    ctl = RoutingController(model)
    ids, mask, pos = batch()
    forced = _forced_trace(ctl, *ids.shape)
    hooks_before = [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in model.modules()]
    with pytest.raises(RuntimeError, match="boom"):
        with ctl.replay(forced), ctl.record():
            model(ids, attention_mask=mask, position_ids=pos)
            raise RuntimeError("boom")
    assert not ctl.active and ctl.state.replay is None and not ctl.state.recorders
    assert "generate" not in model.__dict__
    assert [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in model.modules()] == hooks_before
    with torch.no_grad():
        plain = model(ids, attention_mask=mask, position_ids=pos).logits
        with ctl.replay(forced):
            forced_logits = model(ids, attention_mask=mask, position_ids=pos).logits
        again = model(ids, attention_mask=mask, position_ids=pos).logits
    assert torch.equal(plain, again) and not torch.equal(plain, forced_logits)


def test_replay_refuses_bad_traces():
    model = make_model("qwen3_moe")
    ctl = RoutingController(model)
    ids, mask, pos = batch()
    good = _forced_trace(ctl, *ids.shape)
    with pytest.raises(ValueError, match=r"replay trace has \[B, S\] = \(3, 9\) but the forward's MoE layer 0 saw "
                                         r"\[B, s\] = \(3, 10\)"):
        with torch.no_grad(), ctl.replay(good.slice(0, 9)):
            model(ids, attention_mask=mask, position_ids=pos)
    bad = good.ids.clone()
    bad[0, 0, 0] = torch.tensor([3, 3], dtype=torch.uint8)
    with pytest.raises(TraceValidationError, match="duplicate"):
        with ctl.replay(RouteTrace(bad, 8, 2, ctl.layer_ids)):
            pass
    with pytest.raises(TraceValidationError, match=r"\(L_moe, num_experts, top_k\) = \(2, 9, 2\)"):
        with ctl.replay(RouteTrace.from_ids(good.long_ids(), 9, 2, ctl.layer_ids)):
            pass
    with pytest.raises(TraceValidationError, match="layer_ids"):
        with ctl.replay(RouteTrace(good.ids, 8, 2, (5, 6))):
            pass
    with pytest.raises(TypeError, match="RouteTrace"):
        with ctl.replay(good.ids):
            pass
    assert not ctl.active


def test_discovery_metadata_and_refusals():
    ctl = RoutingController(make_model("deepseek_v3"))
    assert (ctl.num_moe_layers, ctl.num_experts, ctl.top_k, ctl.layer_ids) == (2, 8, 2, (1, 2))
    assert ctl.hidden_size == 32

    cfg = AutoConfig.for_model("phimoe", vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                               num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                               num_experts_per_tok=2)
    with pytest.raises(UnsupportedRouterError, match="PhimoeTopKRouter"):
        RoutingController(AutoModelForCausalLM.from_config(cfg))
    assert issubclass(UnsupportedRouterError, ValueError)

    dense = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "llama", vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4))
    with pytest.raises(ValueError, match="no MoE router found in LlamaForCausalLM"):
        RoutingController(dense)

    kern = make_model("gpt_oss")
    kern._use_kernels = True
    with pytest.raises(UnsupportedRouterError, match="use_kernels"):
        RoutingController(kern)


def test_router_bypass_is_detected():
    model = make_model("gpt_oss")
    ctl = RoutingController(model)
    block = model.model.layers[1].mlp

    def kernel_forward(hidden_states):  # like a hub kernel: computes routing itself, never calls block.router
        return hidden_states * 0, None

    block.forward = kernel_forward
    ids, mask, pos = batch()
    with pytest.raises(RouterBypassError, match="model.layers.1.mlp"):
        with torch.no_grad(), ctl.record():
            model(ids, attention_mask=mask, position_ids=pos)
    assert not ctl.active
