"""The lean decode forward (``rollout/decode_step.py``): bit-identical logits to ``model(...)`` step after step (float32
and bfloat16, left padding, dropped rows, both attention paths), identical samples, log-probs and routes from the
engine, the stream's slots and greedy evaluation, and ``model(...)`` wherever the identity is not known."""
from __future__ import annotations

import copy

import pytest
import torch

from offpolicy_moe.config.schema import ModelConfig, TaskConfig
from offpolicy_moe.models import load_policy
from offpolicy_moe.rollout.decode_attention import use_single_query_decode
from offpolicy_moe.rollout.decode_step import DecodeForward, lean_refusal
from offpolicy_moe.rollout.greedy import greedy_completions
from offpolicy_moe.rollout.kv_cache import preallocated_cache
from offpolicy_moe.rollout.slots import SlotSampler, StreamSample
from offpolicy_moe.tasks import make_task
from tests.streaming.slot_policy import make_policy
from tests.tiny import rollout_engine


def _policy(dtype=torch.float32, seed=5):
    task = make_task(TaskConfig())
    model, tok = load_policy(ModelConfig(num_layers=2, hidden_size=32, num_experts=4, top_k=2), seed=seed, task=task)
    return model.to(dtype).eval(), tok, task


def _twin_steps(model, dtype, steps=12, drop_at=5):
    """Prefill a left-padded batch into two caches, then decode both step after step, one by ``DecodeForward`` and
    one by ``model(...)``, dropping rows at ``drop_at``; every step's logits must be equal."""
    gen = torch.Generator().manual_seed(0)
    B, P = 6, 7
    ids = torch.randint(3, 20, (B, P), generator=gen)
    am = torch.ones(B, P, dtype=torch.long)
    am[1, :3] = am[4, :5] = 0
    pos = (am.cumsum(-1) - 1).masked_fill(am == 0, 1)
    caches = [preallocated_cache(model.config, P + steps), preallocated_cache(model.config, P + steps)]
    step = DecodeForward(model)
    assert step.lean, step.refusal
    with torch.no_grad():
        for c in caches:
            model(input_ids=ids, attention_mask=am, position_ids=pos, cache=c, use_cache=True)
        mask, last, nxt = torch.cat([am, am.new_ones(B, steps)], 1), pos[:, -1:], ids[:, -1:]
        for t in range(steps):
            if t == drop_at:
                keep = torch.tensor([0, 1, 4])
                for c in caches:
                    c.batch_select_indices(keep)
                mask, last, nxt = mask[keep], last[keep], nxt[keep]
            last = last + 1
            lean = step(nxt, mask[:, :P + t + 1], last, caches[0])
            ref = model(input_ids=nxt, attention_mask=mask[:, :P + t + 1], position_ids=last, cache=caches[1],
                        use_cache=True).logits
            assert lean.dtype == ref.dtype == dtype and torch.equal(lean, ref), t
            nxt = ref[:, -1].argmax(-1, keepdim=True)
    assert step.lean_calls == steps and step.model_calls == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("attention", ["single_query", "sdpa"])
def test_lean_logits_are_bit_identical_to_the_models(dtype, attention):
    torch.set_num_threads(1)
    model, _, _ = _policy(dtype)
    if attention == "single_query":
        assert use_single_query_decode(model)
    _twin_steps(model, dtype)


def _engines(record: bool, **rollout):
    model, tok, task = make_policy()
    engines = [rollout_engine(model, tok, dtype="float32", max_new_tokens=10, temperature=1.3,
                              record_routes=record, decode_forward=way, **rollout) for way in ("lean", "model")]
    rows = task.sample_prompts(0, 6)
    return engines, [r["prompt"] for r in rows], [r["answer"] for r in rows]


@pytest.mark.parametrize("record", [False, True])
def test_the_engine_samples_the_same_tokens_log_probs_and_routes(record):
    torch.set_num_threads(1)
    (lean, plain), prompts, answers = _engines(record)
    assert lean.decode.lean and not plain.decode.lean
    a = lean.generate(prompts, answers, group_size=4, seed=3)
    b = plain.generate(prompts, answers, group_size=4, seed=3)
    assert lean.decode.lean_calls > 0 and plain.decode.lean_calls == 0
    assert torch.equal(a.input_ids, b.input_ids) and a.completions == b.completions
    assert torch.equal(a.behav_logp, b.behav_logp)
    if record:
        assert torch.equal(a.routes.ids, b.routes.ids)


def _stream(eng, tok, task):
    from offpolicy_moe.tasks import encode_prompts

    rows = task.sample_prompts(0, 4)
    ids, am = encode_prompts(tok, [r["prompt"] for r in rows])
    samples = [StreamSample((g, j), ids[g][am[g].bool()], 100 * g + j) for g in range(4) for j in range(3)]
    sampler = SlotSampler(eng, 5)
    sampler.submit(samples)
    out = {}
    while sampler.queued or sampler.active:
        out.update({f.key: f for f in sampler.step()})
    return out


@pytest.mark.parametrize("record", [False, True])
def test_the_stream_slots_sample_the_same_tokens_log_probs_and_routes(record):
    torch.set_num_threads(1)
    model, tok, task = make_policy()
    outs = []
    for way in ("lean", "model"):
        eng = rollout_engine(model, tok, dtype="float32", max_new_tokens=10, decode_forward=way, record_routes=record)
        outs.append(_stream(eng, tok, task))
        assert (eng.decode.lean_calls > 0) is (way == "lean")
    a, b = outs
    assert a.keys() == b.keys() and len(a) == 12
    for k in a:
        assert torch.equal(a[k].response_ids, b[k].response_ids) and torch.equal(a[k].behav_logp, b[k].behav_logp)
        assert torch.equal(a[k].versions, b[k].versions)
        assert (a[k].routes is None) is (not record) and (not record or torch.equal(a[k].routes, b[k].routes)), k


def test_greedy_evaluation_decodes_the_same_completions():
    torch.set_num_threads(1)
    model, tok, task = _policy()
    with torch.no_grad():
        model.lm_head.weight[tok.eos_token_id] *= 6.0     # rows finish at many lengths
    prompts = list(task.eval_prompts)[:24]
    assert greedy_completions(model, tok, prompts, max_new_tokens=20, batch_size=8) == \
        greedy_completions(model, tok, prompts, max_new_tokens=20, batch_size=8, lean=False)


def test_a_kwargs_pre_hook_on_the_model_runs_and_its_inputs_are_used():
    torch.set_num_threads(1)
    model, _, _ = _policy()
    seen = []

    def shift(module, args, kwargs):          # replaces the fed token: the lean path must use the hook's inputs
        seen.append(kwargs["input_ids"].shape)
        return args, {**kwargs, "input_ids": (kwargs["input_ids"] + 1) % module.config.vocab_size}

    handle = model.register_forward_pre_hook(shift, with_kwargs=True)
    try:
        _twin_steps(model, torch.float32, steps=4, drop_at=99)
    finally:
        handle.remove()
    assert len(seen) == 2 + 2 * 4         # two prefills, then each step once per path


def test_what_the_lean_path_does_not_know_goes_through_the_model():
    torch.set_num_threads(1)
    model, _, _ = _policy()

    class Custom(type(model)):
        def forward(self, *a, **kw):
            return super().forward(*a, **kw)

    sub = copy.deepcopy(model)
    sub.__class__ = Custom
    assert "Custom" in lean_refusal(sub)
    windowed = copy.deepcopy(model)
    windowed.config.sliding_window = 4
    assert "sliding_window" in lean_refusal(windowed)
    assert "model" in DecodeForward(model, lean=False).refusal
    from transformers import MixtralConfig, MixtralForCausalLM
    mixtral = MixtralForCausalLM(MixtralConfig(vocab_size=32, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                                               num_attention_heads=2, num_key_value_heads=1, num_local_experts=2))
    assert "mixtral" in lean_refusal(mixtral)
    # per call: a hook on a bypassed module, gradients on, or training mode fall back to model(...)
    step = DecodeForward(model)
    ids, am, pos = torch.tensor([[5]]), torch.ones(1, 1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long)
    handle = model.model.layers[0].register_forward_hook(lambda *a: None)
    with torch.no_grad():
        step(ids, am, pos, preallocated_cache(model.config, 4))
    handle.remove()
    step(ids, am, pos, preallocated_cache(model.config, 4))          # gradients on
    model.train()
    with torch.no_grad():
        step(ids, am, pos, preallocated_cache(model.config, 4))
    model.eval()
    assert step.model_calls == 3 and step.lean_calls == 0
    for width in (1, 3):        # a mask not as wide as the cache after the step (2 columns): transformers' handling
        cache = preallocated_cache(model.config, 4)
        with torch.no_grad():
            model(input_ids=torch.tensor([[5]]), cache=cache, use_cache=True)
            step(ids, torch.ones(1, width, dtype=torch.long), pos + 1, cache)
    assert step.model_calls == 5 and step.lean_calls == 0
    with torch.no_grad():
        step(ids, am, pos, preallocated_cache(model.config, 4))
    assert step.lean_calls == 1


def test_a_layer_swapped_after_construction_is_checked_again():
    torch.set_num_threads(1)
    model, _, _ = _policy()
    step = DecodeForward(model)
    ids, am, pos = torch.tensor([[5]]), torch.ones(1, 1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long)
    layer = model.model.layers[0]

    class Patched(type(layer)):
        def forward(self, *a, **kw):
            return super().forward(*a, **kw)

    patched = copy.copy(layer)
    patched.__class__ = Patched
    with torch.no_grad():
        model.model.layers[0] = patched          # swapped after the DecodeForward was built
        step(ids, am, pos, preallocated_cache(model.config, 4))
        assert step.model_calls == 1 and "layers" in step.refusal
        model.model.layers[0] = layer
        step(ids, am, pos, preallocated_cache(model.config, 4))
    assert step.lean_calls == 1 and step.refusal is None


def test_the_config_key_is_refused_outside_its_choices():
    from offpolicy_moe.config.load import load_config
    from offpolicy_moe.config.validate import ConfigError, validate

    with pytest.raises(ConfigError, match="rollout.decode_forward: unknown value 'fast'; expected one of lean, model"):
        validate(load_config(None, ["rollout.decode_forward=fast"]))
