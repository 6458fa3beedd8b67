"""The shared-prompt trainer forward (``response_logprobs(share_prompt=True)``, ``trainer.share_prompt``), the fast
completion decoder and the engine's in-place weight sync.

The shared forward must be the plain forward's function of the weights: log-probs and gradients equal to float
rounding on batches with left padding of several prompt lengths, shuffled rows, early EOS and temperature; it must
really feed fewer tokens (``U * P + B * (T - 1)``), and fall back to the plain forward where it cannot apply.
"""
from __future__ import annotations

import pytest
import torch

from offpolicy_moe.trainer.trainer import Trainer
from tests.tiny import rollout_engine, tiny_config, tiny_policy


def _model():
    return tiny_policy(num_layers=2, seed=0)


def _batch(U=5, G=4, P=6, T=5, seed=0):
    """``U`` distinct prompts x ``G`` samples, prompts left-padded to ``P`` with 1..3 pad positions on some, rows
    shuffled, responses right-padded after an early EOS on some rows."""
    g = torch.Generator().manual_seed(seed)
    pid = torch.randint(3, 19, (U, P), generator=g)
    pam = torch.ones(U, P, dtype=torch.long)
    for u in range(U):
        pad = u % 4
        pam[u, :pad] = 0
        pid[u, :pad] = 0
    pid, pam = pid.repeat_interleave(G, 0), pam.repeat_interleave(G, 0)
    rid = torch.randint(3, 19, (U * G, T), generator=g)
    ram = torch.ones(U * G, T, dtype=torch.long)
    for b in range(0, U * G, 3):
        cut = 1 + b % (T - 1)
        ram[b, cut:] = 0
        rid[b, cut:] = 0
    perm = torch.randperm(U * G, generator=g)
    return (torch.cat([pid, rid], 1)[perm], torch.cat([pam, ram], 1)[perm], ram[perm])


def _grads(model, fn):
    model.zero_grad(set_to_none=True)
    fn().sum().backward()
    return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def test_prompt_groups_matches_brute_force():
    from offpolicy_moe.models.layout import prompt_groups

    ids, am, _ = _batch()
    P = 6
    ids = ids.clone()
    ids[:, :P] = torch.where(am[:, :P].bool(), ids[:, :P], torch.randint(0, 3, ids[:, :P].shape))  # pad ids vary
    first, inverse = prompt_groups(ids, am, P)
    # brute force: rows are the same prompt iff masks equal and ids equal where the mask is 1
    B = ids.shape[0]
    def same(a, b):
        return torch.equal(am[a, :P], am[b, :P]) and torch.equal(ids[a, :P][am[a, :P].bool()],
                                                                 ids[b, :P][am[b, :P].bool()])
    for a in range(B):
        for b in range(B):
            assert same(a, b) == bool(inverse[a] == inverse[b]), (a, b)
    assert first.numel() == 5
    for u in range(first.numel()):
        rows = torch.nonzero(inverse == u).flatten()
        assert int(first[u]) == int(rows.min())


@pytest.mark.parametrize("mode", ["pack", "cache"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_shared_forward_equals_plain_values_and_gradients(mode, temperature):
    from offpolicy_moe.models.response_logprobs import response_logprobs

    torch.manual_seed(0)
    model, _ = _model()
    model.train()
    ids, am, ram = _batch()
    # groups of unequal size (a mini-batch split cuts groups): drop some rows
    keep = torch.tensor([b for b in range(ids.shape[0]) if b % 7 != 3])
    ids, am, ram = ids[keep], am[keep], ram[keep]
    plain = lambda: response_logprobs(model, ids, am, 6, temperature=temperature, response_mask=ram)  # noqa: E731
    shared = lambda: response_logprobs(model, ids, am, 6, temperature=temperature, response_mask=ram,  # noqa: E731
                                       share_prompt=mode)
    a, b = plain(), shared()
    assert a.shape == b.shape == ram.shape
    assert torch.isfinite(b).all() and (b[ram == 0] == 0).all()
    torch.testing.assert_close(b, a, rtol=0, atol=2e-5)
    ga, gb = _grads(model, plain), _grads(model, shared)
    assert ga.keys() == gb.keys() and len(ga) > 10
    for k in ga:
        scale = max(ga[k].abs().max().item(), 1e-3)
        torch.testing.assert_close(gb[k], ga[k], rtol=0, atol=2e-5 * scale, msg=lambda s, k=k: f"{k}: {s}")


def _count_tokens(model):
    seen = []

    def hook(module, args, kwargs):
        ids = kwargs.get("input_ids")
        seen.append(int(ids.numel()))
    return seen, model.register_forward_pre_hook(hook, with_kwargs=True)


def test_shared_forward_feeds_each_prompt_once():
    from offpolicy_moe.models.response_logprobs import response_logprobs

    model, _ = _model()
    ids, am, ram = _batch(U=5, G=4, P=6, T=5)
    seen, h = _count_tokens(model)
    try:
        response_logprobs(model, ids, am, 6, response_mask=ram, share_prompt=True)
        assert seen == [5 * (6 + 4 * 4)]              # packed: U rows of P + G * (T - 1)
        seen.clear()
        response_logprobs(model, ids, am, 6, response_mask=ram, share_prompt="cache")
        assert seen == [5 * 6, 20 * (5 - 1)]          # U * P, then B * (T - 1)
        seen.clear()
        response_logprobs(model, ids, am, 6, response_mask=ram)
        assert seen == [20 * 11]                      # plain: B * (P + T)
        for mode in ("pack", "cache"):                # T = 1: the prompt alone predicts the only response token
            seen.clear()
            one = response_logprobs(model, ids[:, :7], am[:, :7], 6, response_mask=ram[:, :1], share_prompt=mode)
            assert seen == [5 * 6]
            ref = response_logprobs(model, ids[:, :7], am[:, :7], 6, response_mask=ram[:, :1])
            torch.testing.assert_close(one, ref, rtol=0, atol=2e-5)
        with pytest.raises(ValueError, match="share_prompt"):
            response_logprobs(model, ids, am, 6, share_prompt="always")
    finally:
        h.remove()


def test_shared_forward_falls_back_when_it_cannot_apply():
    from offpolicy_moe.models.response_logprobs import response_logprobs
    from offpolicy_moe.models.prompt_packing import plan_group_packing

    model, _ = _model()
    ids, am, ram = _batch(U=5, G=4)
    seen, h = _count_tokens(model)
    try:
        # fewer than half of the rows repeat a prompt: 11 distinct prompts in 20 rows -> plain
        distinct = ids.clone()
        distinct[:11, 5] = torch.arange(3, 14)
        assert plan_group_packing(distinct, am, 6) is None
        response_logprobs(model, distinct, am, 6, response_mask=ram, share_prompt=True)
        assert seen == [20 * 11]
        # the dense mask would not fit the budget -> no packing
        assert plan_group_packing(ids, am, 6, max_mask_elements=5 * 22 * 22 - 1) is None
        assert plan_group_packing(ids, am, 6, max_mask_elements=5 * 22 * 22) is not None
        # activation checkpointing keeps no cache in training: the cache way falls back, packing still applies
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        seen.clear()
        response_logprobs(model, ids, am, 6, response_mask=ram, share_prompt="cache")
        assert seen == [20 * 11]
        seen.clear()
        lp = response_logprobs(model, ids, am, 6, response_mask=ram, share_prompt="pack")
        assert seen == [5 * 22]
        lp.sum().backward()
    finally:
        h.remove()


def test_two_groups_with_one_prompt_are_packed_as_two_rows():
    """Groups that happen to draw the same prompt must not make one row twice as long (that widens every row)."""
    from offpolicy_moe.models.response_logprobs import response_logprobs
    from offpolicy_moe.models.prompt_packing import plan_group_packing

    ids, am, ram = _batch(U=5, G=4, P=6, T=5)
    plan = plan_group_packing(ids, am, 6)
    u0 = plan.inverse[0]
    same_as_0 = plan.inverse == u0
    other = int(torch.nonzero(plan.inverse != u0).flatten()[0])
    dup = plan.inverse == plan.inverse[other]
    ids, am = ids.clone(), am.clone()
    ids[dup, :6], am[dup, :6] = ids[0, :6], am[0, :6]          # a second group with row 0's prompt
    plan = plan_group_packing(ids, am, 6)
    assert plan.num_rows == 5 and plan.length == 6 + 4 * 4
    rows, n = plan.inverse[same_as_0 | dup].unique(return_counts=True)
    assert rows.numel() == 2 and n.tolist() == [4, 4]      # the 8 samples of that prompt fill two rows of 4
    model, _ = _model()
    torch.testing.assert_close(response_logprobs(model, ids, am, 6, response_mask=ram, share_prompt="pack"),
                               response_logprobs(model, ids, am, 6, response_mask=ram), rtol=0, atol=2e-5)


def test_pack_trace_matches_brute_force_and_refuses_disagreeing_prompts():
    from offpolicy_moe.models.prompt_packing import plan_group_packing
    from offpolicy_moe.routing import RouteTrace

    ids, am, _ = _batch(U=5, G=4, P=6, T=5)
    B, S = ids.shape
    plan = plan_group_packing(ids, am, 6)
    g = torch.Generator().manual_seed(3)
    per_prompt = torch.randint(0, 8, (5, 6, 2, 2), generator=g)
    first, inverse = plan.first, plan.inverse
    raw = torch.randint(0, 8, (B, S, 2, 2), generator=g)
    raw[:, :6] = per_prompt[inverse]               # the samples of a prompt agree on its routes
    trace = RouteTrace.from_ids(raw.to(torch.uint8), num_experts=8, top_k=2)
    packed = plan.pack_trace(trace)
    assert packed.ids.shape == (5, 22, 2, 2)
    # brute force: walk the plain batch and write each token where the packing put it
    want = torch.full((5, 22, 2, 2), trace.sentinel, dtype=torch.uint8)
    slot_of = {}
    for b in range(B):
        u = int(inverse[b])
        k = slot_of.get(u, 0)
        slot_of[u] = k + 1
        want[u, :6] = raw[b, :6].to(torch.uint8)
        for t in range(4):
            want[u, 6 + k * 4 + t] = raw[b, 6 + t].to(torch.uint8)
            assert int(plan.input_ids[u, 6 + k * 4 + t]) == int(ids[b, 6 + t])
    assert torch.equal(packed.ids, want)
    # a sample whose (real) prompt route differs from its group's: not packable
    bad = raw.clone()
    b = int(torch.nonzero(inverse == inverse[first[0]]).flatten()[-1])
    col = int(torch.nonzero(am[b, :6]).flatten()[0])
    bad[b, col, 0] = (bad[b, col, 0] + 1) % 8
    assert plan.pack_trace(RouteTrace.from_ids(bad.to(torch.uint8), num_experts=8, top_k=2)) is None


def test_trainer_update_with_and_without_shared_prompt(tmp_path):
    """One update on the same fixed batch: parameters equal to 1e-6 with and without ``trainer.share_prompt``;
    with R3 replay the trainer never shares (the replay hooks expect the [B, S] layout) and still trains."""

    torch.set_num_threads(1)
    common = ["preset=[grpo]", "rollout.dtype=float32", "algo.routing.metrics=false",
              "trainer.mismatch_metrics=false", "rollout.max_new_tokens=4"]
    gen = Trainer(tiny_config(tmp_path / "gen", *common))
    init = {k: v.detach().clone() for k, v in gen.unwrapped.state_dict().items()}
    batch = gen.source.generate(0)
    batch.answers = [c if i % 2 == 0 else a for i, (a, c) in enumerate(zip(batch.answers, batch.completions))]
    out = {}
    for share in (True, False):
        tr = Trainer(tiny_config(tmp_path / f"s{share}", *common, f"trainer.share_prompt={str(share).lower()}"))
        tr.unwrapped.load_state_dict(init)
        b = batch.index_select(torch.arange(batch.size))
        b = tr.stage.prepare(b, current=tr.step).batch
        tr.update(b)
        out[share] = {k: v.detach().clone() for k, v in tr.unwrapped.named_parameters()}
    moved = max((out[False][k] - init[k]).abs().max().item() for k in out[False])
    assert moved > 1e-3
    # Adam's first step is ~lr * sign(g): where |g| is near eps, rounding-level gradient differences move an
    # element by a few 1e-6 (lr = 1e-2 here), so the bound is 1e-3 of a step
    for k in out[True]:
        torch.testing.assert_close(out[True][k], out[False][k], rtol=0, atol=1e-5)
    # R3: the same with the engine's routes replayed; the replayed forward is packed (trace re-laid out)
    r3 = {}
    for share in (True, False):
        tr = Trainer(tiny_config(tmp_path / f"r3{share}", *common, "preset=[grpo,r3]",
                                 f"trainer.share_prompt={str(share).lower()}"))
        tr.unwrapped.load_state_dict(init)
        tr.publish(0)
        b = tr.source.generate(0)
        b.answers = [c if i % 2 == 0 else a for i, (a, c) in enumerate(zip(b.answers, b.completions))]
        seen, h = _count_tokens(tr.unwrapped)
        try:
            b = tr.stage.prepare(b, current=tr.step).batch
            tr.update(b)
        finally:
            h.remove()
        P, T = b.prompt_len, b.input_ids.shape[1] - b.prompt_len
        # on-policy: old_logp comes from the update forward itself (one forward): 4 prompts x (P + 4 samples x
        # (T - 1)) packed, or the plain [B, S]
        assert seen == ([4 * (P + 4 * (T - 1))] if share else [b.input_ids.numel()]), seen
        r3[share] = {k: v.detach().clone() for k, v in tr.unwrapped.named_parameters()}
    for k in r3[True]:
        torch.testing.assert_close(r3[True][k], r3[False][k], rtol=0, atol=1e-5)


def test_fast_completion_decoding_equals_tokenizer_decode():
    from offpolicy_moe.tasks import build_char_tokenizer, decode_completions
    from offpolicy_moe.tasks.tokenizer import id_pieces

    tok = build_char_tokenizer()
    assert id_pieces(tok) is not None
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, len(tok), (300, 7), generator=g)
    got = decode_completions(tok, ids)
    for row, text in zip(ids.tolist(), got):
        if tok.eos_token_id in row:
            row = row[:row.index(tok.eos_token_id)]
        assert text == tok.decode(row, skip_special_tokens=False)
    # an out-of-vocabulary id is the tokenizer's business (it decodes it to nothing): same answer as decode
    assert decode_completions(tok, [[5, 999]]) == [tok.decode([5, 999], skip_special_tokens=False)]


def test_engine_sync_copies_casts_and_refuses_mismatched_weights():
    from offpolicy_moe.rollout.engine import HFRolloutEngine

    model, tok = _model()
    eng = rollout_engine(model, tok, dtype="bfloat16", max_new_tokens=2)
    sd = {k: v + 0.5 for k, v in model.state_dict().items()}
    eng.sync(sd, 3)
    assert eng.version == 3
    for k, v in eng.model.state_dict().items():
        assert v.dtype == torch.bfloat16
        assert torch.equal(v, sd[k].to(torch.bfloat16)), k
    bad = dict(sd)
    bad.pop(next(iter(bad)))
    with pytest.raises(KeyError, match="missing"):
        eng.sync(bad, 4)
    wrong = dict(sd)
    k0 = next(iter(wrong))
    wrong[k0] = torch.zeros(3)
    with pytest.raises(ValueError, match="shape"):
        eng.sync(wrong, 4)


def test_recorded_routes_of_a_packed_forward_equal_a_plain_recording(tmp_path):
    """R2 records the trainer's own routes in the old-log-prob pass and routing/* compares them with the engine's:
    packed, the recording is unpacked to the plain layout and equals the plain forward's recording on every fed
    position (the last response position, never fed, holds the sentinel, as in the engine's traces)."""
    from offpolicy_moe.models.prompt_packing import plan_group_packing

    torch.set_num_threads(1)
    common = ["preset=[grpo,r2]", "rollout.dtype=bfloat16", "algo.routing.metrics=true", "rollout.max_new_tokens=4",
              "buffer.staleness=1"]
    got = {}
    for share in (True, False):
        tr = Trainer(tiny_config(tmp_path / f"s{share}", *common, f"trainer.share_prompt={str(share).lower()}"))
        b = tr.source.generate(0)
        seen, h = _count_tokens(tr.unwrapped)
        try:
            b = tr.stage.prepare(b, current=tr.step).batch
        finally:
            h.remove()
        got[share] = (b, seen)
    (bs, seen_s), (bp, seen_p) = got[True], got[False]
    assert torch.equal(bs.input_ids, bp.input_ids)
    plan = plan_group_packing(bs.input_ids, bs.attention_mask, bs.prompt_len)
    # the recording pass (R2 / routing metrics) and the replayed "with R3" counterfactual pass: both packed
    assert seen_s == [plan.num_rows * plan.length] * 2 and seen_p == [bp.input_ids.numel()] * 2
    own_s, own_p = bs.trainer_routes.ids, bp.trainer_routes.ids
    assert own_s.shape == own_p.shape
    assert torch.equal(own_s[:, :-1], own_p[:, :-1])
    assert (own_s[:, -1] == bs.trainer_routes.sentinel).all()
    for k in bp.extras:
        if k.startswith("routing/"):
            assert bs.extras[k] == pytest.approx(bp.extras[k], abs=1e-9), k
    torch.testing.assert_close(bs.old_logp, bp.old_logp, rtol=0, atol=2e-5)
    # unpack(pack(trace)) restores every fed position
    back = plan.unpack_trace(plan.pack_trace(bp.trainer_routes))
    assert torch.equal(back.ids[:, :-1], own_p[:, :-1])
    with pytest.raises(ValueError, match="packed trace"):
        plan.unpack_trace(bp.trainer_routes)


def test_packing_only_for_full_attention_with_4d_masks():
    """Sliding-window / chunked layers build windowed masks from plain positions: not packed (cache way instead)."""
    from types import SimpleNamespace

    from offpolicy_moe.models.prompt_packing import takes_4d_mask

    def m(**cfg):
        return SimpleNamespace(config=SimpleNamespace(**cfg))

    assert takes_4d_mask(m(_attn_implementation="sdpa", use_sliding_window=False, sliding_window=4096))
    assert takes_4d_mask(m(_attn_implementation="eager", sliding_window=None))
    assert takes_4d_mask(m(_attn_implementation="sdpa", layer_types=["full_attention"] * 2, sliding_window=None))
    assert not takes_4d_mask(m(_attn_implementation="flash_attention_2", sliding_window=None))
    assert not takes_4d_mask(m(_attn_implementation="sdpa", use_sliding_window=True, sliding_window=16))
    assert not takes_4d_mask(m(_attn_implementation="sdpa", sliding_window=16))           # Mistral-style config
    assert not takes_4d_mask(m(_attn_implementation="sdpa", sliding_window=128,
                               layer_types=["sliding_attention", "full_attention"]))      # GPT-OSS
    assert not takes_4d_mask(m(_attn_implementation="sdpa", attention_chunk_size=8192, sliding_window=None))
    model, _ = _model()
    assert takes_4d_mask(model)       # the embedded tiny Qwen3-MoE packs


@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral", "deepseek_v3", "olmoe"])
def test_packed_replay_equals_plain_replay_on_other_families(family):
    """R3 on a packed batch (trace re-laid out) gives the plain replayed forward's log-probs and gradients."""
    from tests.routing.routing_models import make_model

    from offpolicy_moe.models.response_logprobs import response_logprobs
    from offpolicy_moe.models.prompt_packing import plan_group_packing, takes_4d_mask
    from offpolicy_moe.routing import RoutingController

    model = make_model(family)
    model.train()
    assert takes_4d_mask(model)
    ctl = RoutingController(model)
    ids, am, ram = _batch(U=3, G=4, P=6, T=5, seed=2)
    with torch.no_grad(), ctl.record() as rec:
        response_logprobs(model, ids, am, 6, response_mask=ram)
    trace = rec.trace()
    plan = plan_group_packing(ids, am, 6)
    packed_trace = plan.pack_trace(trace)
    assert packed_trace is not None

    def plain():
        with ctl.replay(trace):
            return response_logprobs(model, ids, am, 6, response_mask=ram)

    def packed():
        with ctl.replay(packed_trace):
            return response_logprobs(model, ids, am, 6, response_mask=ram, packing=plan)

    torch.testing.assert_close(packed(), plain(), rtol=0, atol=2e-5)
    ga, gb = _grads(model, plain), _grads(model, packed)
    for k in ga:
        scale = max(ga[k].abs().max().item(), 1e-3)
        torch.testing.assert_close(gb[k], ga[k], rtol=0, atol=5e-5 * scale, msg=lambda s, k=k: f"{k}: {s}")


def test_reference_model_replays_the_same_routes_as_the_actor(tmp_path):
    """KL to the reference under R3: the reference policy gets its own routing controller and replays the engine's
    routes like the actor, so at the first on-policy update (reference = current weights) the KL is exactly 0.
    Without replay on the reference (its own top-k where the noisy engine chose other experts) it is not."""

    torch.set_num_threads(1)
    cfg = ["preset=[grpo,r3]", "algo.kl.coef=0.1", "rollout.router_noise=0.5", "rollout.dtype=float32",
           "algo.routing.metrics=false", "trainer.eval_every=0"]
    kl = {}
    for replay_ref in (True, False):
        tr = Trainer(tiny_config(tmp_path / f"ref{replay_ref}", *cfg))
        tr.open_loggers()
        tr.start()
        assert tr.ref_model is not None and tr.ref_controller is not None
        if not replay_ref:
            tr.forward.ref_controller = None
        b = tr.source.generate(0)
        b.answers = [c if i % 2 == 0 else a for i, (a, c) in enumerate(zip(b.answers, b.completions))]
        b = tr.stage.prepare(b, current=tr.step).batch
        kl[replay_ref] = tr.update(b)["actor/kl_ref"]
        tr.logger.close()
    assert kl[True] == 0.0
    assert kl[False] > 1e-6


def test_bad_layouts_are_refused_by_name():
    """A trace, logits or packing that do not match the planned batch, and bad recorder row indices: clear errors."""
    from offpolicy_moe.models.response_logprobs import response_logprobs
    from offpolicy_moe.models.prompt_packing import plan_group_packing
    from offpolicy_moe.routing import RouteTrace, RoutingController

    ids, am, ram = _batch(U=5, G=4, P=6, T=5)
    plan = plan_group_packing(ids, am, 6)
    for shape in ((20, 12, 2, 2), (19, 11, 2, 2)):           # one position too many / one row short
        tr = RouteTrace.from_ids(torch.zeros(shape, dtype=torch.uint8), num_experts=8, top_k=2)
        with pytest.raises(ValueError, match=r"route trace has \[B, S\]"):
            plan.pack_trace(tr)
    with pytest.raises(ValueError, match="packed logits"):
        plan.response_logits(torch.zeros(5, 21, 7))
    with pytest.raises(ValueError, match="packed logits"):
        plan.response_logprobs(torch.zeros(5, 21, 7), ids[:, 6:], 1.0)
    model, _ = _model()
    with pytest.raises(ValueError, match="packing was planned for"):
        response_logprobs(model, ids[:8], am[:8], 6, packing=plan)
    with pytest.raises(ValueError, match="packing was planned for"):
        response_logprobs(model, ids[:, :10], am[:, :10], 6, packing=plan)
    ctl = RoutingController(model)
    with torch.no_grad(), ctl.record() as rec:
        model(input_ids=ids[:3, :6])
        with pytest.raises(ValueError, match="out of range"):
            rec.select_rows(torch.tensor([0, 3]))
        with pytest.raises(ValueError, match="1-D"):
            rec.select_rows(torch.tensor([[0, 1]]))
        for rows, batch in (([0, 0], 4), ([4], 4), ([[0]], 4), ([0, 1], 0)):
            with pytest.raises(ValueError, match="scatter_rows"):
                rec.scatter_rows(torch.tensor(rows), batch)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_packed_logprobs_equal_the_laid_out_logits(temperature):
    """``GroupPacking.response_logprobs`` (log-probs over the packed positions) against the log-probs of the
    logits laid out like the plain batch (``response_logits``): same values and gradients."""
    from offpolicy_moe.models.prompt_packing import plan_group_packing
    from offpolicy_moe.models.token_logprobs import token_logprobs

    ids, am, _ = _batch(U=5, G=4, P=6, T=5)
    plan = plan_group_packing(ids, am, 6)
    g = torch.Generator().manual_seed(0)
    z = torch.randn(plan.num_rows, plan.length, 19, generator=g, requires_grad=True)
    got = plan.response_logprobs(z, ids[:, 6:], temperature)
    want = token_logprobs(plan.response_logits(z), ids[:, 6:], temperature)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    w = torch.randn(got.shape, generator=g)
    g_got, = torch.autograd.grad((got * w).sum(), z)
    g_want, = torch.autograd.grad((want * w).sum(), z)
    torch.testing.assert_close(g_got, g_want, rtol=0, atol=1e-6)
