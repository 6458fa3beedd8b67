"""Single-query decode attention (``rollout.decode_attention=single_query``): the same values as transformers' SDPA
function for one query per row (grouped-query and multi-head, boolean / additive / per-head / no mask, float32 and
bfloat16), every other call handed to SDPA unchanged, the engine's copy switched and the trainer's model not, and
samples equal to the SDPA engine's."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from tests.tiny import rollout_engine
from offpolicy_moe.config.schema import ModelConfig, TaskConfig
from offpolicy_moe.rollout.decode_attention import NAME, single_query_attention, use_single_query_decode
from offpolicy_moe.rollout.engine import HFRolloutEngine
from offpolicy_moe.models import load_policy
from offpolicy_moe.tasks import make_task
from tests.decode_steps import decode_logits


def _module(heads: int, kv_heads: int) -> nn.Module:
    m = nn.Module()
    m.num_key_value_groups = heads // kv_heads
    m.is_causal = True
    m.training = False
    return m


def _inputs(B, H, KV, L, D, dtype, q_len=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, q_len, H, D, generator=g).to(dtype).transpose(1, 2)     # strided, as attention modules pass
    buf_k = torch.randn(B, KV, L + 5, D, generator=g).to(dtype)                 # cache views of a larger buffer
    buf_v = torch.randn(B, KV, L + 5, D, generator=g).to(dtype)
    return q, buf_k[:, :, :L], buf_v[:, :, :L]


def _masks(B, H, L):
    pad = torch.ones(B, 1, 1, L, dtype=torch.bool)
    pad[0, ..., :3] = False
    pad[2, ..., :1] = False
    per_head = pad.expand(B, H, 1, L).clone()
    per_head[1, 2, 0, 4] = False
    additive = torch.zeros(B, 1, 1, L).masked_fill(~pad, torch.finfo(torch.float32).min)
    return {"none": None, "bool": pad, "per_head": per_head, "additive": additive}


@pytest.mark.parametrize("heads,kv_heads", [(8, 4), (4, 4), (6, 1)])
@pytest.mark.parametrize("mask_kind", ["none", "bool", "per_head", "additive"])
def test_single_query_equals_sdpa_float32(heads, kv_heads, mask_kind):
    B, L, D = 3, 11, 16
    q, k, v = _inputs(B, heads, kv_heads, L, D, torch.float32)
    mask = _masks(B, heads, L)[mask_kind]
    mod = _module(heads, kv_heads)
    ref, _ = sdpa_attention_forward(mod, q, k, v, mask, scaling=0.3)
    out, weights = single_query_attention(mod, q, k, v, mask, scaling=0.3)
    assert weights is None and out.shape == ref.shape == (B, 1, heads, D) and out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-6)
    out_default_scale, _ = single_query_attention(mod, q, k, v, mask)
    ref_default_scale, _ = sdpa_attention_forward(mod, q, k, v, mask)
    torch.testing.assert_close(out_default_scale, ref_default_scale, rtol=0, atol=1e-6)


def test_single_query_value_head_size_of_its_own():
    """Multi-head latent attention: values narrower than queries and keys ([B, H_kv, L, 8] against 16)."""
    B, H, KV, L = 3, 4, 4, 7
    q, k, _ = _inputs(B, H, KV, L, 16, torch.float32)
    v = torch.randn(B, KV, L, 8)
    mask = _masks(B, H, L)["bool"]
    mod = _module(H, KV)
    ref, _ = sdpa_attention_forward(mod, q, k, v, mask)
    out, _ = single_query_attention(mod, q, k, v, mask)
    assert out.shape == ref.shape == (B, 1, H, 8)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-6)


def test_single_query_bfloat16_is_no_less_accurate_than_sdpa():
    """bfloat16 cache: both against a float64 computation on the same bfloat16 inputs; ours accumulates in float32."""
    B, H, KV, L, D = 16, 8, 4, 200, 16
    q, k, v = _inputs(B, H, KV, L, D, torch.bfloat16)
    mask = _masks(B, H, L)["bool"]
    mod = _module(H, KV)
    exact, _ = sdpa_attention_forward(mod, q.double(), k.double(), v.double(), mask)
    ref, _ = sdpa_attention_forward(mod, q, k, v, mask)
    out, _ = single_query_attention(mod, q, k, v, mask)
    assert out.dtype == torch.bfloat16
    err_ours = (out.double() - exact).abs().max().item()
    err_sdpa = (ref.double() - exact).abs().max().item()
    assert err_ours <= max(err_sdpa, 2 ** -8)
    assert bool(torch.isfinite(out).all())


def test_other_calls_are_sdpa_exactly():
    """Several queries (prefill), dropout or a position bias: transformers' SDPA function, bit for bit."""
    B, H, KV, L, D = 2, 4, 2, 9, 8
    mod = _module(H, KV)
    q, k, v = _inputs(B, H, KV, L, D, torch.float32, q_len=L)
    ref, _ = sdpa_attention_forward(mod, q, k, v, None, scaling=0.5)
    out, _ = single_query_attention(mod, q, k, v, None, scaling=0.5)
    assert torch.equal(out, ref)
    q1, k1, v1 = _inputs(B, H, KV, L, D, torch.float32)
    bias = torch.randn(B, H, 1, L)
    ref, _ = sdpa_attention_forward(mod, q1, k1, v1, None, position_bias=bias)
    out, _ = single_query_attention(mod, q1, k1, v1, None, position_bias=bias)
    assert torch.equal(out, ref)
    torch.manual_seed(0)
    ref, _ = sdpa_attention_forward(mod, q1, k1, v1, None, dropout=0.5)
    torch.manual_seed(0)
    out, _ = single_query_attention(mod, q1, k1, v1, None, dropout=0.5)
    assert torch.equal(out, ref)


def test_switched_model_decodes_like_sdpa_model():
    """The anchor family (Qwen3-MoE, grouped-query): prefill and two decode steps with left padding."""
    model, _ = load_policy(ModelConfig(num_layers=2, hidden_size=64, num_experts=8, top_k=2), seed=0)
    model.eval()
    fast = copy.deepcopy(model)
    assert use_single_query_decode(fast) and fast.config._attn_implementation == NAME
    assert model.config._attn_implementation == "sdpa"
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 19, (4, 7), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    torch.testing.assert_close(decode_logits(fast, ids, mask), decode_logits(model, ids, mask), rtol=0, atol=1e-5)
    assert not use_single_query_decode(fast)            # already switched: only an "sdpa" model is switched


def test_eager_model_is_left_alone():
    model, _ = load_policy(ModelConfig(num_layers=1, hidden_size=32, num_experts=4, top_k=2), seed=0)
    model.set_attn_implementation("eager")
    assert not use_single_query_decode(model) and model.config._attn_implementation == "eager"


def _engine_batches(decode_attention: str, dtype: str):
    torch.set_num_threads(1)
    task = make_task(TaskConfig())
    model, tok = load_policy(ModelConfig(num_layers=2, hidden_size=32, num_experts=4, top_k=2), seed=3, task=task)
    rows = task.sample_prompts(0, 4)
    eng = rollout_engine(model, tok, dtype=dtype, max_new_tokens=24, decode_attention=decode_attention)
    assert eng.single_query_decode == (decode_attention == "single_query")
    assert model.config._attn_implementation == "sdpa"          # the trainer's model is never switched
    return eng.generate([r["prompt"] for r in rows], [r["answer"] for r in rows], group_size=4, seed=7)


@pytest.mark.parametrize("dtype,atol", [("float32", 1e-5), ("bfloat16", 2e-2)])
def test_engine_samples_equal_sdpa_engine(dtype, atol):
    """Same seed: the same tokens, behaviour log-probs equal to float rounding (bfloat16: to its rounding)."""
    a, b = _engine_batches("sdpa", dtype), _engine_batches("single_query", dtype)
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.response_mask, b.response_mask)
    torch.testing.assert_close(a.behav_logp, b.behav_logp, rtol=0, atol=atol)


def test_an_unknown_decode_attention_is_refused_at_the_door():
    """The config refuses it before any engine is built (the engine no longer re-checks its section)."""
    from offpolicy_moe.config import load_config
    from offpolicy_moe.config.validate import ConfigError, validate

    with pytest.raises(ConfigError, match="rollout.decode_attention"):
        validate(load_config(overrides=["rollout.decode_attention=flash"]))
