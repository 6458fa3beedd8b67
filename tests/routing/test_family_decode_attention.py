"""Single-query decode attention on every buildable MoE family: a copy switched from SDPA decodes (prefill with
left padding, then two one-token steps against the cache) to the same logits as the unswitched model; families on
another attention implementation are left alone."""
from __future__ import annotations

import copy

import pytest
import torch

from offpolicy_moe.rollout.decode_attention import NAME, use_single_query_decode
from tests.decode_steps import decode_logits

from family_models import VOCAB, make_family_model
from test_families import CACHE_DIFFERS, SLOW, SUPPORTED

CASES = [pytest.param(f, marks=pytest.mark.slow) if f in SLOW else f for f in SUPPORTED]


@pytest.mark.parametrize("family", CASES)
def test_family_single_query_decode_equals_sdpa(family):
    model = make_family_model(family)
    fast = copy.deepcopy(model)
    before = model.config._attn_implementation
    switched = use_single_query_decode(fast)
    assert switched == (before == "sdpa" and fast.config._attn_implementation == NAME)
    assert model.config._attn_implementation == before
    if not switched:
        assert fast.config._attn_implementation == before
        return
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, VOCAB, (3, 6), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    ids = ids.masked_fill(mask == 0, 0)
    ref = decode_logits(model, ids, mask)
    out = decode_logits(fast, ids, mask)
    if family in CACHE_DIFFERS:
        assert bool(torch.isfinite(out).all())
        return
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-4)
