"""The sampling loop's pre-allocated KV cache: the same keys/values as transformers' concatenating ``DynamicLayer``
after every update, row repetition, row selection and growth past the planned capacity, and samples drawn with it
identical to ``model.generate``'s on long responses with compaction."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st
import torch
from transformers.cache_utils import DynamicLayer

from tests.tiny import rollout_engine
from offpolicy_moe.rollout.kv_cache import PreallocatedLayer, preallocated_cache


def test_preallocated_layer_equals_dynamic_layer():
    g = torch.Generator().manual_seed(0)
    dyn, pre = DynamicLayer(), PreallocatedLayer(capacity=5)
    steps = [("update", 3), ("update", 1), ("repeat", 2), ("update", 1), ("select", [0, 3, 5]), ("update", 2),
             ("update", 4)]                              # the last two grow past the capacity of 5 positions
    B = 4
    for op, arg in steps:
        if op == "update":
            k = torch.randn(B, 2, arg, 3, generator=g)
            v = torch.randn(B, 2, arg, 3, generator=g)
            a, b = dyn.update(k, v), pre.update(k, v)
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        elif op == "repeat":
            dyn.batch_repeat_interleave(arg)
            pre.batch_repeat_interleave(arg)
            B *= arg
        else:
            idx = torch.tensor(arg)
            dyn.batch_select_indices(idx)
            pre.batch_select_indices(idx)
            B = len(arg)
        assert torch.equal(dyn.keys, pre.keys) and torch.equal(dyn.values, pre.values)
        assert dyn.get_seq_length() == pre.get_seq_length()
    assert pre.get_seq_length() == 11
    with pytest.raises(ValueError, match="capacity"):
        PreallocatedLayer(0)


def test_crop_keeps_the_first_positions_as_the_dynamic_layer_does():
    g = torch.Generator().manual_seed(1)
    dyn, pre = DynamicLayer(), PreallocatedLayer(capacity=4)
    for op, arg in [("update", 3), ("crop", -1), ("update", 2), ("crop", 0), ("update", 1), ("crop", -2),
                    ("update", 3)]:
        if op == "update":
            k, v = torch.randn(2, 2, arg, 3, generator=g), torch.randn(2, 2, arg, 3, generator=g)
            a, b = dyn.update(k, v), pre.update(k, v)
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        else:
            dyn.crop(arg)
            pre.crop(arg)
        assert torch.equal(dyn.keys, pre.keys) and torch.equal(dyn.values, pre.values)
        assert dyn.get_seq_length() == pre.get_seq_length()
    assert pre.get_seq_length() == 6
    with pytest.raises(ValueError, match="negative count"):
        pre.crop(2)


def test_preallocated_cache_swaps_full_attention_layers_only():
    from offpolicy_moe.config.schema import ModelConfig
    from offpolicy_moe.models import load_policy

    model, _ = load_policy(ModelConfig(num_layers=2, hidden_size=32, num_experts=4, top_k=2), seed=0)
    cache = preallocated_cache(model.config, 16)
    assert len(cache.layers) == 2 and all(isinstance(layer, PreallocatedLayer) for layer in cache.layers)
    ids = torch.randint(3, 19, (3, 6))
    with torch.no_grad():
        out = model(input_ids=ids, past_key_values=cache, use_cache=True)
        ref = model(input_ids=ids, use_cache=False)
        torch.testing.assert_close(out.logits, ref.logits, rtol=0, atol=1e-6)
        nxt = model(input_ids=ids[:, :1], past_key_values=cache, use_cache=True).logits
        full = model(input_ids=torch.cat([ids, ids[:, :1]], 1), use_cache=False).logits[:, -1:]
    torch.testing.assert_close(nxt, full, rtol=0, atol=1e-5)


def test_long_native_samples_equal_generate_with_compaction():
    """40 new tokens, early EOS on many rows (compaction drops them mid-way), fp32 and bf16: the tokens are
    generate's exactly, the behaviour log-probs to float rounding (prefill shared across a group)."""
    from offpolicy_moe.config.schema import ModelConfig, TaskConfig
    from offpolicy_moe.rollout.engine import HFRolloutEngine
    from offpolicy_moe.models import load_policy
    from offpolicy_moe.tasks import make_task

    torch.set_num_threads(1)
    task = make_task(TaskConfig())
    model, tok = load_policy(ModelConfig(num_layers=1, hidden_size=32, num_experts=4, top_k=2), seed=3, task=task)
    rows = task.sample_prompts(0, 4)
    prompts, answers = [r["prompt"] for r in rows], [r["answer"] for r in rows]
    for dtype, temp, top_p in (("float32", 1.0, 1.0), ("bfloat16", 0.8, 0.9)):
        out = {}
        for sampler in ("hf", "native"):
            # transformers' SDPA kernel in the decode steps too (the single-query path: test_decode_attention.py)
            eng = rollout_engine(model, tok, dtype=dtype, max_new_tokens=40, temperature=temp, top_p=top_p,
                                  sampler=sampler, decode_attention="sdpa")
            out[sampler] = eng.generate(prompts, answers, group_size=4, seed=7)
        a, b = out["hf"], out["native"]
        lens = b.response_mask.sum(-1)
        assert int(lens.min()) < 20 and int(lens.max()) > 20          # compaction happened, long rows remain
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.response_mask, b.response_mask)
        torch.testing.assert_close(a.behav_logp, b.behav_logp, rtol=0, atol=1e-5)


@settings(max_examples=60, deadline=None)
@given(capacity=st.integers(1, 24), ops=st.lists(st.tuples(st.sampled_from(["update", "repeat", "select"]),
                                                         st.integers(1, 5)), min_size=1, max_size=10))
def test_row_copies_equal_the_dynamic_layer_at_every_fill(capacity, ops):
    """Row repetition and selection copy only the filled columns while they are at most half the capacity, and the
    whole buffer past that (two branches): both give the concatenating layer's keys and values, and the buffers keep
    their capacity."""
    g = torch.Generator().manual_seed(capacity)
    dyn, pre = DynamicLayer(), PreallocatedLayer(capacity=capacity)
    B = 2
    for op, arg in [("update", 1), *ops]:
        if op == "update":
            k, v = torch.randn(B, 2, arg, 3, generator=g), torch.randn(B, 2, arg, 3, generator=g)
            dyn.update(k, v), pre.update(k, v)
        elif op == "repeat":
            if B * arg > 64:
                continue
            dyn.batch_repeat_interleave(arg), pre.batch_repeat_interleave(arg)
            B *= arg
        else:
            idx = torch.randint(0, B, (arg,), generator=g)          # rows may repeat (an inverse permutation)
            allocated = pre.allocated
            dyn.batch_select_indices(idx), pre.batch_select_indices(idx)
            B = arg
            assert pre.allocated == allocated
        assert torch.equal(dyn.keys, pre.keys) and torch.equal(dyn.values, pre.values)
        assert pre.keys.shape[0] == B and pre._kbuf.shape[-2] >= pre.get_seq_length()
