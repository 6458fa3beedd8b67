"""Continuous batching (``rollout/slots.py``): refilled slots give the log-probs and routes of a plain teacher-forced
forward, a sample's tokens depend on its seed only, weight updates in flight are versioned per token, one decode
forward per step, one-line refusals."""
from __future__ import annotations

import copy

import pytest
import torch

from offpolicy_moe.rollout import slots as slots_module
from offpolicy_moe.rollout.slots import SlotSampler, StreamSample
from tests.tiny import rollout_engine
from tests.streaming.slot_policy import make_policy

MAX_NEW = 12


@pytest.fixture(scope="module")
def policy():
    """A 2-layer tiny MoE whose EOS is likely enough that rows finish at many different steps."""
    return make_policy()


def _samples(tok, task, groups: int = 4, per_group: int = 2) -> list[StreamSample]:
    """``groups`` prompts of different lengths (3, 5, 7, ... tokens), ``per_group`` samples each, distinct seeds."""
    from offpolicy_moe.tasks import encode_prompts

    rows = task.sample_prompts(0, groups)
    ids, am = encode_prompts(tok, [r["prompt"] for r in rows])
    out = []
    for g in range(groups):
        p = ids[g][am[g].bool()]
        p = torch.cat([p] * 3)[:3 + 2 * g]
        out += [StreamSample((g, j), p.clone(), 1000 * g + j) for j in range(per_group)]
    return out


def _run(sampler: SlotSampler, samples, forwards=None) -> dict:
    sampler.submit(samples)
    out, steps = {}, 0
    while sampler.queued or sampler.active:
        before = len(forwards) if forwards is not None else 0
        for f in sampler.step():
            assert f.key not in out
            out[f.key] = f
        steps += 1
        if forwards is not None:          # one decode forward per step, plus a prefill when something was admitted
            assert len(forwards) - before <= 2
        assert steps <= 10 * MAX_NEW * (len(samples) + 1)
    assert sampler.active == sampler.queued == 0 and sampler.step() == []
    return out


def _count_forwards(model):
    seen = []
    h = model.register_forward_pre_hook(lambda m, a, kw: seen.append(tuple(kw["input_ids"].shape)), with_kwargs=True)
    return seen, h


def _teacher_forced(model, prompt, response, controller=None):
    """Log-probs of ``response`` under one plain forward of ``prompt + response`` (and its routes when asked)."""
    full = torch.cat([prompt, response]).unsqueeze(0)
    with torch.no_grad():
        if controller is not None:
            with controller.record() as rec:
                logits = model(input_ids=full).logits[0].float()
            routes = rec.trace().ids[0].long()
        else:
            logits, routes = model(input_ids=full).logits[0].float(), None
    p = prompt.numel()
    lp = logits[p - 1:-1].log_softmax(-1).gather(1, response.unsqueeze(1)).squeeze(1)
    return lp, routes


@pytest.fixture(scope="module")
def streamed(policy):
    """12 samples of 4 prompt lengths through 3 slots (slots refilled mid-stream), routes recorded."""
    model, tok, task = policy
    eng = rollout_engine(model, tok, dtype="float32", max_new_tokens=MAX_NEW, record_routes=True)
    samples = _samples(tok, task, per_group=3)
    sampler = SlotSampler(eng, 3)
    seen, h = _count_forwards(eng.model)
    try:
        out = _run(sampler, samples, seen)
    finally:
        h.remove()
    return eng, sampler, samples, out, seen


def test_refilled_slots_match_a_teacher_forced_forward(streamed):
    eng, sampler, samples, out, seen = streamed
    assert sorted(out) == sorted(s.key for s in samples)
    eos = eng.tokenizer.eos_token_id
    lengths = set()
    for s in samples:
        f = out[s.key]
        n = f.response_ids.numel()
        assert torch.equal(f.prompt_ids, s.prompt_ids) and 1 <= n <= MAX_NEW
        assert f.behav_logp.dtype == torch.float32 and f.versions.tolist() == [0] * n
        is_eos = (f.response_ids == eos).nonzero().flatten().tolist()
        assert is_eos == [n - 1] if n < MAX_NEW else is_eos in ([], [n - 1])     # stops at the first EOS
        ref, _ = _teacher_forced(eng.model, f.prompt_ids, f.response_ids)
        torch.testing.assert_close(f.behav_logp, ref, rtol=0, atol=1e-5)
        lengths.add(n)
    assert len(lengths) >= 3 and MAX_NEW in lengths             # rows finished at EOS at several steps and at the cap
    decodes = [shape for shape in seen if shape[1] == 1]
    assert decodes and all(shape == (3, 1) for shape in decodes)   # every decode feeds all slots at once
    assert seen[0][0] == 1          # the first admission (3 samples of group 0) prefilled its prompt on one row
    assert sampler.trims >= 1 and sampler.grows >= 1       # the shared cache was trimmed on the left, and grew


def test_routes_are_those_of_the_teacher_forced_forward(streamed):
    eng, _, samples, out, _ = streamed
    for s in samples:
        f = out[s.key]
        p, n = f.prompt_ids.numel(), f.response_ids.numel()
        assert f.routes is not None and f.routes.shape == (p + n, eng.controller.num_moe_layers, 2)
        _, ref = _teacher_forced(eng.model, f.prompt_ids, f.response_ids, eng.controller)
        assert torch.equal(f.routes[:-1].sort(-1).values, ref[:-1].sort(-1).values)   # every fed position
        assert bool((f.routes[-1] == -1).all())                                       # the last: never fed


def test_a_samples_tokens_depend_on_its_seed_only(policy):
    model, tok, task = policy
    samples = _samples(tok, task, groups=3, per_group=3)
    outs = {}
    for slots in (1, 4):
        eng = rollout_engine(model, tok, dtype="float32", max_new_tokens=MAX_NEW)
        outs[slots] = _run(SlotSampler(eng, slots), samples)
    assert outs[1].keys() == outs[4].keys()
    for k in outs[1]:
        assert torch.equal(outs[1][k].response_ids, outs[4][k].response_ids), k
        torch.testing.assert_close(outs[1][k].behav_logp, outs[4][k].behav_logp, rtol=0, atol=1e-5)
    # and another seed gives another sample
    other = [StreamSample(s.key, s.prompt_ids, s.seed + 7) for s in samples]
    eng = rollout_engine(model, tok, dtype="float32", max_new_tokens=MAX_NEW)
    moved = _run(SlotSampler(eng, 4), other)
    assert any(not torch.equal(moved[k].response_ids, outs[4][k].response_ids) for k in moved)


@pytest.mark.parametrize("vocab", [1, 20, 151_936])
def test_one_race_call_gives_the_draws_of_one_call_per_token(vocab):
    """What drawing a row's next tokens' race in one call rests on: torch's CPU ``exponential_`` draws serially, so
    ``n`` tokens' values in one ``[n, V]`` call are those of ``n`` calls of ``[V]``, in order."""
    n = 3
    one, per = torch.Generator().manual_seed(11), torch.Generator().manual_seed(11)
    at_once = torch.empty((n, vocab), dtype=torch.float64).exponential_(generator=one)
    each = torch.stack([torch.empty(vocab, dtype=torch.float64).exponential_(generator=per) for _ in range(n)])
    assert torch.equal(at_once, each)


def test_races_drawn_ahead_give_the_tokens_of_a_draw_per_token(policy, monkeypatch):
    model, tok, task = policy
    samples = _samples(tok, task, groups=3, per_group=3)
    outs = {}
    for ahead in (1, 5, slots_module.RACE_TOKENS):       # 5: a row's race runs out mid-sample and is drawn again
        monkeypatch.setattr(slots_module, "RACE_TOKENS", ahead)
        eng = rollout_engine(model, tok, dtype="float32", max_new_tokens=MAX_NEW)
        outs[ahead] = _run(SlotSampler(eng, 4), samples)
    for ahead, out in outs.items():
        assert out.keys() == outs[1].keys()
        for k in out:
            assert torch.equal(out[k].response_ids, outs[1][k].response_ids), (ahead, k)
            assert torch.equal(out[k].behav_logp, outs[1][k].behav_logp), (ahead, k)


def test_weights_updated_in_flight_are_versioned_per_token(policy):
    """Every 3 steps the hook syncs perturbed weights.  A running row keeps the keys/values its older forwards cached,
    so the exact reference is an incremental decode that feeds each position under the version that fed it: token
    ``t``'s scores come from the weights of ``versions[t]`` on top of the cache built so far."""
    from transformers import DynamicCache

    from offpolicy_moe.models.layout import cache_kwarg

    model, tok, task = policy
    eng = rollout_engine(model, tok, dtype="float32", max_new_tokens=MAX_NEW)
    states = {0: {k: v.clone() for k, v in eng.model.state_dict().items()}}
    gen = torch.Generator().manual_seed(3)
    calls = {"n": 0}

    def hook(engine):
        calls["n"] += 1
        if calls["n"] % 3 == 0:
            new = {k: v + 0.05 * v.std().nan_to_num() * torch.randn(v.shape, generator=gen)
                   if v.is_floating_point() and v.numel() > 1 else v.clone() for k, v in states[engine.version].items()}
            engine.sync(new, engine.version + 1)
            states[engine.version] = {k: v.clone() for k, v in new.items()}

    eng.call_between_tokens(hook)
    out = _run(SlotSampler(eng, 3), _samples(tok, task))
    assert len(states) >= 4
    ref_model = copy.deepcopy(eng.model)
    spans = 0
    for f in out.values():
        v = f.versions.tolist()
        assert v == sorted(v)
        spans += len(set(v)) >= 2
        p = f.prompt_ids.numel()
        lps, cache = [], DynamicCache(config=ref_model.config)
        kw = {cache_kwarg(ref_model): cache}
        with torch.no_grad():
            for t in range(f.response_ids.numel()):
                ref_model.load_state_dict(states[v[t]])
                ids = f.prompt_ids if t == 0 else f.response_ids[t - 1:t]
                first = 0 if t == 0 else p + t - 1
                pos = torch.arange(first, first + ids.numel()).unsqueeze(0)
                logits = ref_model(input_ids=ids.unsqueeze(0), position_ids=pos, use_cache=True,
                                   **kw).logits[0, -1].float()
                lps.append(logits.log_softmax(-1)[f.response_ids[t]])
        torch.testing.assert_close(f.behav_logp, torch.stack(lps), rtol=0, atol=1e-5)
        if len(set(v)) == 1:           # one version throughout: the plain teacher-forced forward of that version
            ref_model.load_state_dict(states[v[0]])
            ref, _ = _teacher_forced(ref_model, f.prompt_ids, f.response_ids)
            torch.testing.assert_close(f.behav_logp, ref, rtol=0, atol=1e-5)
    assert spans >= 1


@pytest.mark.parametrize("slots, rollout, match", [
    (0, {}, "slots >= 1"),
    (2, {"top_p": 0.9}, "samples the full distribution"),
    (2, {"top_k": 5}, "samples the full distribution"),
    (2, {"sampler": "hf"}, "sampler=native"),
])
def test_bad_settings_are_refused_in_one_line(policy, slots, rollout, match):
    model, tok, _ = policy
    eng = rollout_engine(model, tok, dtype="float32", max_new_tokens=4, **rollout)
    with pytest.raises(ValueError, match=match) as exc:
        SlotSampler(eng, slots)
    assert "\n" not in str(exc.value)


def test_preallocated_layer_row_writes_shifts_and_trims():
    from offpolicy_moe.rollout.kv_cache import PreallocatedLayer

    layer = PreallocatedLayer(4)
    k = torch.arange(2 * 1 * 3 * 2, dtype=torch.float32).view(2, 1, 3, 2)
    layer.write_rows(torch.tensor([2, 0]), k, -k, end=3, batch=3)
    assert layer.keys.shape == (3, 1, 3, 2) and layer.allocated == 4
    assert torch.equal(layer.keys[2], k[0]) and torch.equal(layer.values[0], -k[1])
    assert bool((layer.keys[1] == 0).all())                    # never-written rows are zeros, not garbage
    layer.pad_left(3)                                          # beyond the allocation: grows, data moved right
    assert layer.get_seq_length() == 6 and layer.allocated >= 6
    assert torch.equal(layer.keys[2, :, 3:], k[0]) and bool((layer.keys[:, :, :3] == 0).all())
    layer.write_rows(torch.tensor([1]), k[:1, :, :2] + 100, k[:1, :, :2], end=6, batch=3)
    layer.trim_left(4)
    assert layer.get_seq_length() == 2
    assert torch.equal(layer.keys[2], k[0, :, 1:]) and torch.equal(layer.keys[1], k[0, :, :2] + 100)
    with pytest.raises(ValueError):
        layer.trim_left(3)


@pytest.mark.parametrize("decode_attention", ["sdpa", "single_query"])
def test_router_perturbation_is_applied_and_attention_paths_agree(policy, decode_attention):
    """Under ``rollout.router_perturb`` every forward routes on ``logits + h dW^T``: the teacher-forced forward under
    the same offsets gives the log-probs (and not the plain one); both decode attention paths are exact."""
    model, tok, task = policy
    eng = rollout_engine(model, tok, dtype="float32", max_new_tokens=MAX_NEW, router_perturb=2.0, seed=1,
                         decode_attention=decode_attention)
    assert eng.router_perturbation is not None
    out = _run(SlotSampler(eng, 2), _samples(tok, task, groups=3, per_group=1))
    moved = 0.0
    for f in out.values():
        with eng.controller.offsets(eng.router_perturbation, in_weights=True):
            ref, _ = _teacher_forced(eng.model, f.prompt_ids, f.response_ids)
        torch.testing.assert_close(f.behav_logp, ref, rtol=0, atol=1e-5)
        plain, _ = _teacher_forced(eng.model, f.prompt_ids, f.response_ids)
        moved = max(moved, float((plain - ref).abs().max()))
    assert moved > 1e-3


def test_router_noise_runs_with_one_prefill_row_per_sample(policy):
    model, tok, task = policy
    eng = rollout_engine(model, tok, dtype="float32", max_new_tokens=5, router_noise=0.5, record_routes=True)
    seen, h = _count_forwards(eng.model)
    try:
        out = _run(SlotSampler(eng, 4), _samples(tok, task, groups=2, per_group=2))
    finally:
        h.remove()
    assert seen[0][0] == 4                       # noise makes a group's samples differ: no shared prefill row
    for f in out.values():
        assert f.routes.shape[0] == f.prompt_ids.numel() + f.response_ids.numel()
        assert bool((f.routes[:-1] >= 0).all()) and bool((f.routes[-1] == -1).all())


def test_a_long_prompt_admitted_beside_running_rows_shifts_them(policy):
    """A 20-token prompt joins two running 3-token rows while the cache has fewer columns: every row moves right
    (:meth:`PreallocatedLayer.pad_left`) and all three still match the teacher-forced forward."""
    model, tok, task = policy
    eng = rollout_engine(model, tok, dtype="float32", max_new_tokens=MAX_NEW)
    short = _samples(tok, task, groups=1, per_group=2)
    long_prompt = torch.cat([short[0].prompt_ids] * 7)[:20]
    sampler = SlotSampler(eng, 3)
    sampler.eos = -1                     # no row stops early: the short rows are surely running at the admission
    sampler.submit(short)
    assert sampler.step() == [] and sampler.step() == [] and sampler.active == 2
    cols = sampler._L
    sampler.submit([StreamSample((9, 0), long_prompt, 5)])
    out = {f.key: f for f in sampler.step()}
    assert cols < 20 <= sampler._L and sampler.active == 3
    out.update(_run(sampler, []))
    assert len(out) == 3
    for f in out.values():
        assert f.response_ids.numel() == MAX_NEW
        ref, _ = _teacher_forced(eng.model, f.prompt_ids, f.response_ids)
        torch.testing.assert_close(f.behav_logp, ref, rtol=0, atol=1e-5)


def test_non_finite_scores_raise_a_generation_error(policy):
    from offpolicy_moe.run.nonfinite import NonFiniteError

    model, tok, task = policy
    eng = rollout_engine(model, tok, dtype="float32", max_new_tokens=4)
    with torch.no_grad():
        eng.model.lm_head.weight[5, 0] = float("nan")
    sampler = SlotSampler(eng, 2)
    sampler.submit(_samples(tok, task, groups=1, per_group=1))
    with pytest.raises(NonFiniteError, match="sampling probabilities"):
        sampler.step()
