"""Kept sets of top-k / top-p sampling (``KeptTokens``): the ragged layout and its re-layouts, what the engine records
(checked against a brute-force top-k / top-p on a full forward), and their travel through the batch's row
selection, the worker pipe (pack / unpack) and a checkpoint's restricted loader."""
from __future__ import annotations

import pytest
import torch

from offpolicy_moe.config.schema import RolloutConfig
from offpolicy_moe.models.kept_tokens import KeptTokens, index_dtype, step_support
from offpolicy_moe.rollout.batch import RolloutBatch
from offpolicy_moe.rollout.engine import (ENGINES, EngineCapabilities, HFRolloutEngine, make_engine,
                                          register_engine)
from offpolicy_moe.rollout.messages import pack, unpack
from offpolicy_moe.run.checkpoint import load_checkpoint, save_checkpoint
from tests.tiny import rollout_engine, tiny_policy

PROMPTS = ["1+2=", "7+8=", "3+3=", "9+0="]
ANSWERS = ["3", "15", "6", "9"]


@pytest.fixture(scope="module")
def tiny():
    return tiny_policy()


def random_mask(B: int, T: int, V: int, seed: int = 0) -> torch.Tensor:
    """Kept sets of mixed sizes: positions keep about 2% or 40% of the vocabulary (small sets are stored as ids,
    large ones as bitmasks), one position keeps nothing (count 0) and one everything."""
    g = torch.Generator().manual_seed(seed)
    density = torch.where(torch.rand(B, T, 1, generator=g) < 0.5, 0.02, 0.4)
    mask = torch.rand(B, T, V, generator=g) < density
    mask[0, -1] = False                      # a position without a kept set
    mask[-1, 0] = True                       # the whole vocabulary, kept
    return mask


# ---------------------------------------------------------------------------------------------------- the layout
@pytest.mark.parametrize("V", [300, 40000])
def test_from_mask_dense_and_contains_are_exact(V):
    """int16 (V = 300: bitmasks of 19 words) and int32 words (V = 40000: 1250 words, the sign bit in use)."""
    mask = random_mask(3, 4, V)
    kept = KeptTokens.from_mask(mask)
    dtype = torch.int16 if V < 32768 else torch.int32
    assert kept.shape == (3, 4) and kept.counts.dtype == dtype and kept.ids.dtype == dtype
    assert kept.counts.tolist() == mask.sum(-1).tolist()
    W = kept.words
    assert W == -(-V // (16 if V < 32768 else 32))
    counts = mask.sum(-1)
    assert bool((counts <= W).any()) and bool((counts > W).any())        # both forms present
    want = mask.clone()
    want[0, -1] = True                       # count 0: the whole vocabulary
    assert torch.equal(kept.dense(), want)
    assert torch.equal(kept.dense(slice(1, 3), slice(2, 4)), want[1:3, 2:4])
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        targets = torch.randint(0, V, (3, 4), generator=g)
        inside = want.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        assert torch.equal(kept.contains(targets), inside)
    kept_ids = want.nonzero()                    # every kept token is found, ids and bitmask alike
    for b, t, j in kept_ids[torch.randperm(kept_ids.shape[0], generator=g)[:50]].tolist():
        targets = torch.zeros(3, 4, dtype=torch.long)
        targets[b, t] = j
        assert bool(kept.contains(targets)[b, t])
    h = kept.ids.element_size()
    assert kept.nbytes == h * (12 + int(counts.clamp(max=W).sum()))
    assert kept.nbytes < h * 12 + V // 8 * 12 + 12 * h                   # never more than a bitmask per token


def test_from_steps_is_row_major():
    """Steps arrive column by column; the layout is row-major: the same as building it from the dense mask."""
    mask = random_mask(3, 5, 90, seed=2)
    steps = [step_support(torch.where(mask[:, t], torch.zeros(3, 90), torch.full((3, 90), float("-inf"))))
             for t in range(5)]
    a = KeptTokens.from_steps([c for c, _ in steps], [i for _, i in steps], 90)
    b = KeptTokens.from_mask(mask)
    assert torch.equal(a.counts, b.counts) and torch.equal(a.ids, b.ids)


def test_step_support_reads_the_finite_scores_of_the_chosen_rows():
    """Small sets as ids; a set of more than W = 3 ids (V = 40) as its bitmask in 3 int16 words."""
    scores = torch.full((4, 40), float("-inf"))
    scores[0, [0, 2]] = 0.0
    scores[1, [1, 0]] = 1.0
    scores[2] = 0.0                                      # a finished row: not recorded
    scores[3, [0, 1, 17, 33, 39]] = 0.5
    counts, ids = step_support(scores, torch.tensor([True, True, False, True]))
    assert counts.tolist() == [2, 2, 0, 5]
    assert ids.tolist() == [0, 2, 0, 1, 0b11, 0b10, (1 << 1) | (1 << 7)]


def test_relayouts_follow_the_dense_mask():
    mask = random_mask(4, 3, 70, seed=3)
    kept = KeptTokens.from_mask(mask)
    dense = kept.dense()
    idx = torch.tensor([2, 0, 2])
    assert torch.equal(kept.index_select(idx).dense(), dense[idx])
    assert torch.equal(kept.narrow(1, 3).dense(), dense[:, 1:3])
    sel = torch.tensor([[True, False, True]] * 4)
    full = torch.ones(70, dtype=torch.bool)
    assert torch.equal(kept.masked(sel).dense(), torch.where(sel.unsqueeze(-1), dense, full))
    assert torch.equal(kept.pad_to(5).dense()[:, :3], dense) and bool(kept.pad_to(5).dense()[:, 3:].all())
    both = KeptTokens.cat([kept, kept.index_select(torch.tensor([1]))])
    assert torch.equal(both.dense(), torch.cat([dense, dense[1:2]]))
    pos = torch.tensor([[5, -1], [0, 11]])        # flat (b * T + t) indices, -1: none
    re = kept.relayout(pos).dense()
    assert torch.equal(re[0, 0], dense[1, 2]) and bool(re[0, 1].all())
    assert torch.equal(re[1, 0], dense[0, 0]) and torch.equal(re[1, 1], dense[3, 2])


def test_index_dtype_follows_the_vocabulary():
    assert index_dtype(32767) == torch.int16 and index_dtype(32768) == torch.int32
    kept = KeptTokens.from_mask(torch.ones(1, 1, 40000, dtype=torch.bool))
    assert kept.ids.dtype == torch.int32 and kept.nbytes == 4 * (1 + 1250)     # a bitmask of 1250 words


@pytest.mark.parametrize("counts,ids,vocab,msg", [
    (torch.tensor([[1, 2]]), torch.tensor([0, 1]), 50, "2 ids for segments of 3 words"),
    (torch.tensor([[1, -1]]), torch.tensor([0]), 5, "counts must be in"),
    (torch.tensor([[1]]), torch.tensor([50]), 50, "ids must be in"),
    (torch.tensor([1]), torch.tensor([0]), 5, "counts must be integer [B, T]"),
    (torch.tensor([[1.0]]), torch.tensor([0]), 5, "counts must be integer"),
])
def test_malformed_kept_sets_are_refused(counts, ids, vocab, msg):
    with pytest.raises(ValueError, match=msg.replace("[", r"\[").replace("]", r"\]")):
        KeptTokens(counts, ids, vocab)


# ---------------------------------------------------------------------------------------------------- the engine
def brute_force_kept(model, seq, am, P, temperature, top_p, top_k):
    """``[B, T, V]`` kept sets from a full forward: top-k then the smallest most-likely prefix reaching top-p."""
    with torch.no_grad():
        logits = model(input_ids=seq, attention_mask=am, position_ids=(am.cumsum(-1) - 1).clamp(min=0)).logits.float()
    z = logits[:, P - 1:-1] / temperature
    keep = torch.ones_like(z, dtype=torch.bool)
    if top_k > 0:
        kth = z.topk(top_k, dim=-1).values[..., -1:]
        keep &= z >= kth
    p = torch.softmax(z.masked_fill(~keep, float("-inf")), -1)
    order = p.argsort(-1, descending=True)
    ps = p.gather(-1, order)
    prefix = (ps.cumsum(-1) - ps) < top_p
    nucleus = torch.zeros_like(keep).scatter(-1, order, prefix)
    return keep & nucleus


@pytest.mark.parametrize("sampler,settings", [
    ("native", dict(top_p=0.9)), ("native", dict(top_k=5)), ("native", dict(top_p=0.8, top_k=7, batch_size=5)),
    ("hf", dict(top_p=0.9)), ("hf", dict(top_p=0.8, top_k=7, batch_size=5)),
])
def test_engine_records_the_kept_set_of_every_response_token(tiny, sampler, settings):
    """Native (with shared prefills, compaction of finished rows, chunks of 5 rows) and ``generate``: the kept set
    of each response token is the brute-force top-k / top-p support at its position, the sampled token is inside
    it, and positions outside the response carry none."""
    model, tok = tiny
    eng = rollout_engine(model, tok, dtype="float32", max_new_tokens=6, sampler=sampler, temperature=0.7,
                         **settings)
    batch = eng.generate(PROMPTS, ANSWERS, group_size=3, seed=5)
    kept, m = batch.kept_tokens, batch.response_mask.bool()
    assert kept is not None and kept.shape == tuple(batch.response_mask.shape)
    assert bool((kept.counts[m] > 0).all()) and bool((kept.counts[~m] == 0).all())
    assert bool(kept.contains(batch.response_ids).all())
    ref = brute_force_kept(model, batch.input_ids, batch.attention_mask, batch.prompt_len, 0.7,
                           settings.get("top_p", 1.0), settings.get("top_k", 0))
    assert torch.equal(kept.dense()[m], ref[m])
    assert float(kept.counts[m].float().mean()) < len(tok)     # the truncation kept fewer than V tokens


def test_default_sampling_records_no_kept_sets(tiny):
    model, tok = tiny
    for sampler in ("native", "hf"):
        batch = rollout_engine(model, tok, max_new_tokens=3, sampler=sampler).generate(PROMPTS, ANSWERS,
                                                                                        group_size=2, seed=0)
        assert batch.kept_tokens is None


def test_an_engine_without_kept_sets_is_refused_under_truncation(tiny):
    model, tok = tiny

    class Plain(HFRolloutEngine):
        capabilities = EngineCapabilities(records_routes=True, router_offsets=True)

    register_engine("plain_test", Plain)
    try:
        make_engine(model, tok, RolloutConfig(engine="plain_test", max_new_tokens=4))      # no truncation: accepted
        for cfg in (RolloutConfig(engine="plain_test", max_new_tokens=4, top_p=0.9),
                    RolloutConfig(engine="plain_test", max_new_tokens=4, top_k=3)):
            with pytest.raises(ValueError, match="does not support returning the kept sets"):
                make_engine(model, tok, cfg)
    finally:
        ENGINES.pop("plain_test")


# ---------------------------------------------------------------------------------------------------- travel
def test_batch_rows_pipe_and_checkpoint_keep_the_kept_sets(tiny, tmp_path):
    model, tok = tiny
    batch = rollout_engine(model, tok, dtype="float32", max_new_tokens=5, top_p=0.85, top_k=9).generate(
        PROMPTS, ANSWERS, group_size=3, seed=1)
    dense = batch.kept_tokens.dense()
    part = batch.index_select(torch.tensor([7, 2, 11]))
    assert torch.equal(part.kept_tokens.dense(), dense[[7, 2, 11]])
    assert all(bool(p.kept_tokens.contains(p.response_ids).all()) for p in batch.split(3))

    piped = RolloutBatch.from_state_dict(unpack(pack(batch.state_dict())))           # a rollout worker's pipe
    assert torch.equal(piped.kept_tokens.counts, batch.kept_tokens.counts)
    assert torch.equal(piped.kept_tokens.ids, batch.kept_tokens.ids)

    path = save_checkpoint(tmp_path, 3, model=model, extra={"queue": [(4, batch.state_dict())]})
    loaded = RolloutBatch.from_state_dict(load_checkpoint(path, require=()).state["queue"][0][1])
    assert torch.equal(loaded.kept_tokens.counts, batch.kept_tokens.counts)
    assert torch.equal(loaded.kept_tokens.ids, batch.kept_tokens.ids)
    assert loaded.kept_tokens.vocab_size == batch.kept_tokens.vocab_size

    old = batch.state_dict()
    del old["kept_tokens"]                   # a state written before kept sets existed
    assert RolloutBatch.from_state_dict(old).kept_tokens is None


def test_a_batch_refuses_kept_sets_of_another_shape(tiny):
    model, tok = tiny
    batch = rollout_engine(model, tok, max_new_tokens=3, top_p=0.9).generate(PROMPTS, ANSWERS, group_size=1, seed=0)
    with pytest.raises(ValueError, match="kept_tokens shape"):
        RolloutBatch(**{**batch.__dict__, "kept_tokens": batch.kept_tokens.narrow(0, 1)})
