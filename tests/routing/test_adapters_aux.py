"""User routers (weights outside ``.weight``, extra forward arguments), the aux loss of the used experts, PR2."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from offpolicy_moe.routing import PR2Predictors, RouteTrace, RouterAdapter, RoutingController, register_router_adapter
from offpolicy_moe.routing.adapters import ROUTER_ADAPTERS
from offpolicy_moe.routing.aux import load_balancing_loss

from family_models import VOCAB, make_family_model


class WgRouter(nn.Module):
    """A router that keeps its weight in ``.wg`` and has neither ``.weight`` nor ``.hidden_dim``."""

    def __init__(self, hidden, experts, k):
        super().__init__()
        self.wg = nn.Linear(hidden, experts, bias=False)
        self.top_k, self.num_experts = k, experts

    def forward(self, h):
        logits = self.wg(h.reshape(-1, h.shape[-1]))
        p = F.softmax(logits, -1, dtype=torch.float)
        w, i = torch.topk(p, self.top_k, -1)
        return logits, (w / w.sum(-1, keepdim=True)).to(logits.dtype), i


def _wg_rule(r, logits, idx):
    w = F.softmax(logits, -1, dtype=torch.float).gather(-1, idx)
    return (w / w.sum(-1, keepdim=True)).to(logits.dtype)


def _with_wg_routers(model):
    for layer in model.model.layers:
        old = layer.mlp.gate
        new = WgRouter(old.weight.shape[1], old.weight.shape[0], old.top_k)
        with torch.no_grad():
            new.wg.weight.copy_(old.weight)
        layer.mlp.gate = new
    return model


def _ids(b=2, s=6, seed=0):
    return torch.randint(3, VOCAB, (b, s), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("registered", [True, False])
def test_router_without_weight_attribute(registered):
    """Old code: ``RoutingController.__init__`` raised AttributeError ('hidden_dim') for such a router even with an
    adapter registered. Now the hidden size comes from the config; unregistered, the generic rule handles it."""
    model = _with_wg_routers(make_family_model("qwen3_moe"))
    ids = _ids()
    with torch.no_grad():
        ref = model(ids).logits
    try:
        if registered:
            register_router_adapter("WgRouter", RouterAdapter(
                "wg-softmax", lambda r, l: torch.topk(F.softmax(l, -1, dtype=torch.float), r.top_k, -1)[1],
                _wg_rule, lambda r: r.num_experts, lambda r: r.top_k))
        ctl = RoutingController(model)
        assert ctl.hidden_size == 32 and ctl.families == (("wg-softmax",) if registered else ("generic",))
        with torch.no_grad(), ctl.record() as rec:
            model(ids)
        with torch.no_grad(), ctl.replay(rec.trace()):
            assert torch.equal(model(ids).logits, ref)
    finally:
        ROUTER_ADAPTERS.pop("WgRouter", None)


class BiasArgRouter(nn.Module):
    """Sigmoid scores with a selection bias handed to forward as an argument (as MiniMax-M2 / LFM2 do)."""

    def __init__(self, hidden, experts, k):
        super().__init__()
        self.proj = nn.Parameter(torch.randn(experts, hidden) * 0.5)
        self.top_k = k
        self.num_experts = experts

    def forward(self, h, bias):
        logits = F.linear(h.reshape(-1, h.shape[-1]), self.proj)
        s = logits.sigmoid()
        _, idx = torch.topk(s + bias, self.top_k, -1)
        w = s.gather(-1, idx)
        return logits, w / w.sum(-1, keepdim=True), idx


class Block(nn.Module):
    def __init__(self, hidden=16, experts=6, k=2):
        super().__init__()
        self.router = BiasArgRouter(hidden, experts, k)
        self.register_buffer("bias", torch.linspace(-0.3, 0.3, experts))
        self.experts = nn.Parameter(torch.randn(experts, hidden, hidden) * 0.3)

    def forward(self, hidden_states):
        b, s, h = hidden_states.shape
        _, w, idx = self.router(hidden_states, self.bias)
        x = hidden_states.reshape(-1, h)
        y = torch.einsum("nh,nkhd->nkd", x, self.experts[idx])
        return (y * w[..., None]).sum(1).reshape(b, s, h)


class TinyMoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


def test_generic_rule_with_forward_bias_argument_matches_hand_rule():
    torch.manual_seed(0)
    model = TinyMoE()
    ctl = RoutingController(model)
    x = torch.randn(2, 5, 16, requires_grad=True)
    g = torch.Generator().manual_seed(1)
    forced = torch.stack([torch.randperm(6, generator=g)[:2] for _ in range(2 * 5 * 2)]).reshape(2, 5, 2, 2)
    with ctl.replay(RouteTrace.from_ids(forced, 6, 2, (0, 1))):
        out = model(x)
    # hand-written reference: forced ids, weights = sigmoid gathered and renormalised (bias excluded)
    ref = x
    for li, layer in enumerate(model.layers):
        h = ref.reshape(-1, 16)
        idx = forced[:, :, li].reshape(-1, 2)
        s = F.linear(h, layer.router.proj).sigmoid().gather(-1, idx)
        w = s / s.sum(-1, keepdim=True)
        y = torch.einsum("nh,nkhd->nkd", h, layer.experts[idx])
        ref = ref + (y * w[..., None]).sum(1).reshape(2, 5, 16)
    assert torch.allclose(out, ref, atol=1e-6)
    out.sum().backward()
    assert model.layers[0].router.proj.grad.abs().sum() > 0


def test_aux_loss_from_used_experts():
    """Self-replay: equal to transformers' aux loss; forced replay: the loss of the experts that ran, which
    transformers' aux loss (re-deriving the router's top-k) does not see."""
    model = make_family_model("qwen3_moe")
    ctl = RoutingController(model)
    ids = _ids(seed=3)
    with torch.no_grad(), ctl.record() as rec:
        hf = model(ids, output_router_logits=True).aux_loss
    with torch.no_grad(), ctl.replay(rec.trace()):
        model(ids)
        own = ctl.load_balancing_loss()
    assert torch.allclose(own, hf, rtol=1e-5)
    forced = torch.zeros(2, 6, ctl.num_moe_layers, 2, dtype=torch.long)
    forced[..., 1] = 1  # every token to experts 0 and 1: maximally unbalanced
    with ctl.replay(RouteTrace.from_ids(forced, ctl.num_experts, 2, ctl.layer_ids)):
        out = model(ids, output_router_logits=True)
        used = ctl.load_balancing_loss()
    logits = [lg for lg in out.router_logits]
    probs = F.softmax(torch.cat(logits).float(), -1)
    brute = ctl.num_experts * sum(float(probs[:, e].mean().detach()) * (1.0 if e in (0, 1) else 0.0)
                                  for e in range(ctl.num_experts))
    assert abs(float(used) - brute) < 1e-5
    assert abs(float(used) - float(out.aux_loss)) > 1e-3
    used.backward()
    assert model.model.layers[0].mlp.gate.weight.grad.abs().sum() > 0
    with pytest.raises(RuntimeError, match="no router calls stored"):
        ctl.load_balancing_loss()
    with pytest.raises(ValueError, match="one ids tensor per logits"):
        load_balancing_loss([torch.zeros(2, 4)], [], 4)


@pytest.mark.parametrize("family", ["glm4_moe", "deepseek_v2", "jamba", "llama4_text", "dbrx", "ernie4_5_moe"])
def test_pr2_offsets_act_on_each_rule(family):
    """PR2: the offsets change the selection; replaying the PR2 routes with the same offsets in the weights is
    bit-exact; ``in_weights=False`` keeps the first layer's selection and changes only the weights."""
    model = make_family_model(family)
    ctl = RoutingController(model)
    pred = PR2Predictors.from_controller(ctl)
    with torch.no_grad():
        for p in pred.parameters():
            p.normal_(0, 2.0)
    ids = _ids(seed=4)
    with torch.no_grad():
        with ctl.record("own") as own:
            model(ids)
        with ctl.offsets(pred), ctl.record() as rec:
            a = model(ids).logits
        with ctl.offsets(pred, in_weights=False), ctl.record() as rec2:
            b = model(ids).logits
        with ctl.offsets(pred), ctl.replay(rec.trace()):
            c = model(ids).logits
    assert not rec.trace().equal(own.trace())
    # the first MoE layer sees the same hidden states either way: same selection (later layers see other weights)
    assert torch.equal(rec.trace().ids[:, :, 0], rec2.trace().ids[:, :, 0])
    assert torch.equal(a, c) and not torch.equal(a, b)
