"""Recording inside generate (KV cache), the generate guard, PR2 rollout offsets and the feature cache."""
import pytest
import torch
from transformers import GenerationConfig

from routing_models import batch, make_model
from offpolicy_moe.routing import (FeatureCache, PR2Predictors, RoutingController, UnsupportedGenerationError,
                                   compare_traces)


def _prompts():
    ids, mask, _ = batch(b=3, s=6, seed=7)
    return ids, mask


def _generate(model, ids, mask, **kw):
    torch.manual_seed(0)
    return model.generate(ids, attention_mask=mask, max_new_tokens=5, min_new_tokens=5, do_sample=True, top_k=0,
                          pad_token_id=0, return_dict_in_generate=True, **kw)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_generate_trace_aligns_with_sequences(family):
    model = make_model(family)
    ctl = RoutingController(model)
    ids, mask = _prompts()
    with ctl.record() as rec:
        out = _generate(model, ids, mask)
    seq = out.sequences
    tr = rec.trace()
    b, s = seq.shape
    assert tr.ids.shape == (b, s, ctl.num_moe_layers, ctl.top_k)
    recorded = tr.recorded_mask()
    assert not bool(recorded[:, -1].any()) and bool(recorded[:, :-1].all())  # only the final sampled token missing
    full_mask = torch.cat([mask, torch.ones(b, s - ids.shape[1], dtype=mask.dtype)], 1)
    pos = (full_mask.cumsum(1) - 1).clamp_min(0)
    with torch.no_grad(), ctl.record() as rec2:
        model(seq, attention_mask=full_mask, position_ids=pos)
    plain = rec2.trace()
    valid = full_mask.bool().clone()
    valid[:, -1] = False
    assert torch.equal(tr.ids[valid], plain.ids[valid])  # identical ids except the final row and pad positions
    assert compare_traces(tr, plain, mask=valid).metrics()["routing/decision_mismatch"] == 0.0
    assert "generate" not in model.__dict__ and not ctl.active


@pytest.mark.parametrize("kwargs,match", [
    ({"num_beams": 2, "do_sample": False}, "beam search"),
    ({"generation_config": GenerationConfig(num_beams=2, max_new_tokens=3)}, "beam search"),
    ({"prompt_lookup_num_tokens": 2, "do_sample": False}, "assisted decoding"),
    ({"use_cache": False}, "use_cache=False"),
])
def test_generate_guard_refuses_unrecordable_modes(kwargs, match):
    model = make_model("qwen3_moe")
    ctl = RoutingController(model)
    ids, mask = _prompts()
    with pytest.raises(UnsupportedGenerationError, match=match):
        with ctl.record():
            model.generate(ids, attention_mask=mask, max_new_tokens=3, pad_token_id=0, **kwargs)
    with pytest.raises(UnsupportedGenerationError, match=match):
        ctl.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, pad_token_id=0, **kwargs)
    assert "generate" not in model.__dict__ and not ctl.active
    model.generate(ids, attention_mask=mask, max_new_tokens=2, pad_token_id=0, num_beams=2)  # fine when not recording


def test_assistant_model_refused_and_second_generate_refused():
    model = make_model("qwen3_moe")
    ctl = RoutingController(model)
    ids, mask = _prompts()
    with pytest.raises(UnsupportedGenerationError, match="assistant_model"):
        with ctl.record():
            model.generate(ids, attention_mask=mask, max_new_tokens=3, assistant_model=make_model("qwen3_moe"))
    with pytest.raises(ValueError, match="one record\\(\\) block per generate"):
        with ctl.record():
            _generate(model, ids, mask)
            _generate(model, ids, mask)


def test_pr2_zero_predictors_equal_r3_exactly_and_feature_cache():
    model = make_model("qwen3_moe")
    ctl = RoutingController(model)
    ids, mask = _prompts()
    with ctl.record() as rec:
        out = _generate(model, ids, mask, output_logits=True)
    preds = PR2Predictors.from_controller(ctl)
    cache = FeatureCache(sample_rate=0.5, generator=torch.Generator().manual_seed(0))
    with ctl.offsets(preds, feature_cache=cache), ctl.record() as rec_p:
        out_p = _generate(model, ids, mask, output_logits=True)
    assert torch.equal(out.sequences, out_p.sequences)
    assert all(torch.equal(a, b) for a, b in zip(out.logits, out_p.logits))
    assert rec.trace().equal(rec_p.trace())

    feats = cache.collect()
    seq = out_p.sequences
    b, s = seq.shape
    rows = sorted(set(feats.batch_index.tolist()))
    assert len(rows) == round(b * 0.5)
    assert feats.num_tokens == len(rows) * (s - 1)  # every fed position of the sampled sequences
    # the cached router logits are the trainer's logits at those tokens (same fp32 weights: equal up to KV-cache
    # rounding), captured through the replay forward the trainer runs
    full_mask = torch.cat([mask, torch.ones(b, s - ids.shape[1], dtype=mask.dtype)], 1)
    pos = (full_mask.cumsum(1) - 1).clamp_min(0)
    with torch.no_grad(), ctl.replay(rec_p.trace()), ctl.capture_router_logits(feats) as cap:
        model(seq, attention_mask=full_mask, position_ids=pos)
    real = full_mask.bool()[feats.batch_index, feats.position]
    assert torch.allclose(cap.logits()[real], feats.logits[real], atol=1e-5)
    assert torch.equal(feats.gather_trace(rec_p.trace()), rec_p.trace().long_ids()[feats.batch_index, feats.position])
    # features follow mini-batch selection like the trace
    pick = torch.tensor([rows[-1], 0])
    sub = feats.index_select(pick)
    assert set(sub.batch_index.tolist()) <= {0, 1}
    full = feats.gather_trace(rec_p.trace())
    assert torch.equal(sub.gather_trace(rec_p.trace().index_select(pick)),
                       torch.cat([full[feats.batch_index == r] for r in pick.tolist()]))
    # ... and padding changes
    r = feats.repad(full_mask, "right")
    tr_r, _ = rec_p.trace().repad(full_mask, "right")
    assert torch.equal(r.gather_trace(tr_r), feats.filter(full_mask).gather_trace(rec_p.trace()))
    with pytest.raises(ValueError, match="already holds features"):
        with ctl.offsets(preds, feature_cache=cache):
            pass


def test_offsets_change_routes_and_engine_dtype():
    model = make_model("qwen3_moe", dtype=torch.bfloat16)
    ctl = RoutingController(model)
    ids, mask, pos = batch()
    preds = PR2Predictors.from_controller(ctl)  # fp32 predictors on a bf16 engine
    with torch.no_grad():
        preds.layers[0].weight.normal_(0, 3.0)
    with torch.no_grad(), ctl.record() as r0:
        model(ids, attention_mask=mask, position_ids=pos)
    with torch.no_grad(), ctl.offsets(preds, in_weights=False), ctl.record() as r1:
        model(ids, attention_mask=mask, position_ids=pos)
    d = compare_traces(r0.trace(), r1.trace()).differs
    assert d[:, :, 0].float().mean() > 0.3
    # the selection equals top-k of softmax(logits + h W_p) computed independently
    spy = {}
    h0 = model.model.layers[0].mlp.gate.register_forward_hook(lambda m, a, o: spy.update(h=a[0], l=o[0]))
    with torch.no_grad():
        model(ids, attention_mask=mask, position_ids=pos)
    h0.remove()
    shifted = (spy["l"].float() + spy["h"].float() @ preds.layers[0].weight.T).to(torch.bfloat16)
    want = torch.topk(torch.softmax(shifted.float(), -1), 2).indices.sort(-1).values
    got = r1.trace().long_ids()[:, :, 0].reshape(-1, 2).sort(-1).values
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match=r"predictors have \(L, E, H\) = \(2, 8, 16\)"):
        with ctl.offsets(PR2Predictors(16, 8, 2)):
            pass


def test_recorder_select_rows_repeats_a_shared_prefill():
    """A prompt prefilled once and repeated to its samples (cache and recorder re-indexed alike) records the same
    trace as prefilling every row; without the re-index the batch change is refused."""
    from transformers import DynamicCache

    model = make_model("qwen3_moe")
    ctl = RoutingController(model)
    ids, mask = _prompts()                                   # 3 prompts
    rep = torch.tensor([0, 0, 1, 2, 2])
    nxt = torch.tensor([[5], [6], [7], [8], [9]])

    def run(shared: bool, reindex: bool = True):
        cache = DynamicCache(config=model.config)
        pos = (mask.cumsum(1) - 1).clamp_min(0)
        with torch.no_grad(), ctl.record() as rec:
            if shared:
                model(ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True)
                cache.batch_select_indices(rep)
                if reindex:
                    rec.select_rows(rep)
            else:
                model(ids[rep], attention_mask=mask[rep], position_ids=pos[rep], past_key_values=cache,
                      use_cache=True)
            am = torch.cat([mask[rep], torch.ones(5, 1, dtype=mask.dtype)], 1)
            model(nxt, attention_mask=am, position_ids=pos[rep, -1:] + 1, past_key_values=cache, use_cache=True)
        return rec.trace()

    shared, plain = run(True), run(False)
    assert shared.ids.shape == plain.ids.shape == (5, ids.shape[1] + 1, ctl.num_moe_layers, ctl.top_k)
    valid = torch.cat([mask[rep], torch.ones(5, 1, dtype=mask.dtype)], 1).bool()
    assert torch.equal(shared.ids[valid], plain.ids[valid])
    with pytest.raises(ValueError, match="batch size changed"):
        run(True, reindex=False)
