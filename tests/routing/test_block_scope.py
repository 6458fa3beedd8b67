"""Families whose MoE block routes and runs its experts in one forward (the router module has no top-k: DBRX's
``DbrxRouter`` returns logits, ``DbrxFFN.forward`` selects and runs the experts). Recording the trainer's own choice
under replay must not run the experts a second time, and a router that scales its input in place (DBRX's
``moe_jitter_eps`` in train mode) must scale it once."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from offpolicy_moe.routing import RouteTrace, RoutingController
from offpolicy_moe.routing.families import scan_moe_families

from family_models import VOCAB, make_family_model, tiny_config
from test_families import REFUSED, SLOW

EPS = 0.01


def _dbrx(jitter: float | None = EPS):
    from transformers import AutoModelForCausalLM

    cfg = tiny_config("dbrx")
    cfg.ffn_config.moe_jitter_eps = jitter
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "router.layer.weight" in n:
                p.normal_(0, 0.5)
    return model


def _batch(b=2, s=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (b, s), generator=g)


def _forced(ctl, ids, seed=1) -> RouteTrace:
    g = torch.Generator().manual_seed(seed)
    n = ids.numel() * ctl.num_moe_layers
    picks = torch.stack([torch.randperm(ctl.num_experts, generator=g)[:ctl.top_k] for _ in range(n)])
    return RouteTrace.from_ids(picks.reshape(*ids.shape, ctl.num_moe_layers, ctl.top_k), ctl.num_experts,
                               ctl.top_k, ctl.layer_ids).with_tokens(ids)


def _watch(model, name: str):
    """Forward pre-hooks on every module whose name ends with ``name``: the first input of each call, cloned."""
    seen, handles = [], []
    for n, m in model.named_modules():
        if n.rsplit(".", 1)[-1] == name and isinstance(m, nn.Module):
            handles.append(m.register_forward_pre_hook(
                lambda mod, args, kwargs: seen.append((args[0] if args else next(iter(kwargs.values()))).detach()
                                                      .clone()), with_kwargs=True))
    return seen, handles


def test_dbrx_runs_its_experts_once_and_jitters_once_under_replay_and_own_record():
    model = _dbrx().train()
    ctl = RoutingController(model)
    assert all(type(s.scope).__name__ == "DbrxFFN" for s in ctl._slots)     # the block holds the top-k
    ids = _batch()
    trace = _forced(ctl, ids)
    blocks, hb = _watch(model, "ffn")
    experts, he = _watch(model, "experts")
    try:
        with torch.no_grad(), ctl.replay(trace), ctl.record("own") as own, ctl.record() as used:
            model(input_ids=ids)
    finally:
        for h in hb + he:
            h.remove()
    assert len(experts) == ctl.num_moe_layers == len(blocks)               # old code: twice per layer
    for h_in, h_exp in zip(blocks, experts):                              # jitter in U[1 - eps, 1 + eps], once
        ratio = h_exp.reshape(-1) / h_in.reshape(-1)
        assert float((ratio - 1).abs().max()) <= EPS * (1 + 1e-5)          # old code: up to (1 + eps)^2 - 1
        assert float((ratio - 1).abs().max()) > EPS / 4                    # the jitter did apply
    assert torch.equal(used.trace().ids.long(), trace.ids.long())
    # the own choice is the router's under the jitter the real call drew: the same draw without replay (layer 0,
    # whose input does not depend on the replayed experts)
    torch.manual_seed(5)
    with torch.no_grad(), ctl.record("own") as own2:
        model(input_ids=ids)
    torch.manual_seed(5)
    with torch.no_grad(), ctl.replay(trace), ctl.record("own") as own3:
        model(input_ids=ids)
    assert torch.equal(own3.trace().ids[:, :, 0], own2.trace().ids[:, :, 0])
    assert not torch.equal(own.trace().ids[:, :, 0], trace.ids[:, :, 0])


def test_dbrx_own_choice_under_a_logit_shift_runs_no_second_expert_pass():
    """Under a shift (PR2 offsets, noise) the own choice needs a probe: it stops at the top-k."""
    model = _dbrx().train()
    ctl = RoutingController(model)
    ids = _batch(seed=3)
    experts, he = _watch(model, "experts")
    blocks, hb = _watch(model, "ffn")
    try:
        with torch.no_grad(), ctl.logit_noise(1.0), ctl.record("own"):
            model(input_ids=ids)
    finally:
        for h in he + hb:
            h.remove()
    assert len(experts) == ctl.num_moe_layers
    for h_in, h_exp in zip(blocks, experts):
        assert float((h_exp.reshape(-1) / h_in.reshape(-1) - 1).abs().max()) <= EPS * (1 + 1e-5)


FAST = [f.model_type for f in scan_moe_families() if f.model_type not in REFUSED | SLOW]


def _calls(model, ctl, run) -> tuple[list[int], int]:
    """(the MoE-layer index of each router call, in call order; calls of modules named ``experts``) during
    ``run()``."""
    routers = {id(s.router): s.index for s in ctl._slots}
    seen, experts, handles = [], [], []
    for name, m in model.named_modules():
        if id(m) in routers:
            handles.append(m.register_forward_pre_hook(lambda mod, args, i=routers[id(m)]: seen.append(i)))
        elif name.rsplit(".", 1)[-1] == "experts":
            handles.append(m.register_forward_pre_hook(lambda mod, args: experts.append(1)))
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return seen, len(experts)


@pytest.mark.parametrize("family", FAST)
def test_own_record_under_replay_runs_no_second_pass_and_matches_the_routers_choice(family):
    """Every family: under replay with ``record("own")`` each router and each experts module runs as often as in
    a plain forward (no probe through the block), and the own choice equals the router's choice without replay at
    the router that runs first (whose input the replay cannot change; JetMoE's attention router runs before the MLP
    router of its layer)."""
    model = make_family_model(family)
    ctl = RoutingController(model)
    ids = _batch()
    trace = _forced(ctl, ids)
    box = {}

    def replayed():
        with torch.no_grad(), ctl.replay(trace), ctl.record("own") as own:
            model(input_ids=ids)
        box["own"] = own.trace().ids

    def plain():
        with torch.no_grad(), ctl.record("own") as free:
            model(input_ids=ids)
        box["free"] = free.trace().ids

    order, n_experts = _calls(model, ctl, plain)
    assert _calls(model, ctl, replayed) == (order, n_experts) and len(order) == ctl.num_moe_layers
    first = order[0]
    assert torch.equal(box["own"][:, :, first], box["free"][:, :, first])
    assert not torch.equal(box["own"][:, :, first], trace.ids[:, :, first].to(box["own"].dtype))
