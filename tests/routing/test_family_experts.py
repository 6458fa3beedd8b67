"""``model.experts_implementation=auto`` on every buildable MoE family whose experts dispatch by name, its per-expert
loop path forced (the tiny models are below the size it starts at): the same outputs and gradients as transformers'
``grouped_mm`` (the family's gate function, biases, weight layout and
post-expert norm included); families whose experts do not dispatch by name are unaffected by the setting."""
from __future__ import annotations

import copy

import pytest
import torch

from offpolicy_moe.models import experts as experts_module
from offpolicy_moe.models.experts import NAME, register_experts_implementation

from family_models import VOCAB, make_family_model
from test_families import SLOW, SUPPORTED

CASES = [pytest.param(f, marks=pytest.mark.slow) if f in SLOW else f for f in SUPPORTED]


def _dispatches_by_name(model) -> bool:
    return any(hasattr(m, "has_gate") and hasattr(m, "is_transposed") for m in model.modules())


def _loss_and_grads(model, ids, mask):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, attention_mask=mask, use_cache=False)
    loss = out.logits.float().log_softmax(-1)[..., 3:9].mean()
    loss.backward()
    return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", CASES)
def test_family_auto_experts_equal_grouped_mm(family, monkeypatch):
    monkeypatch.setattr(experts_module, "LOOP_MIN_ELEMENTS", 0)   # tiny models: take the per-expert loop anyway
    model = make_family_model(family).train()
    if not _dispatches_by_name(model):
        pytest.skip(f"{family}: its experts do not dispatch by implementation name")
    for m in model.modules():           # no dropout, so both forwards see the same function
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    register_experts_implementation()
    fast = copy.deepcopy(model)
    model.set_experts_implementation("grouped_mm")
    fast.set_experts_implementation(NAME)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, VOCAB, (3, 8), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    ref_logits, ref_grads = _loss_and_grads(model, ids, mask)
    logits, grads = _loss_and_grads(fast, ids, mask)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-4, atol=1e-5, msg=f"{family}: {name}")
