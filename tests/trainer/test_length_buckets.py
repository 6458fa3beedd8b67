"""Length buckets (``trainer.length_buckets``): the cut of a long-tailed batch into micro-batches of rows of like
width is the cheapest one by exhaustive search, covers every row once, respects ``grad_accum`` and
``trainer.micro_batch_tokens``, leaves batches of even lengths cut as before, and the no-grad pass and the update
on it give the whole-batch forward's numbers (log-probs to float rounding, rows in the batch's order)."""
from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from offpolicy_moe.logprobs.forward import trimmed_width
from offpolicy_moe.logprobs import length_buckets, micro_batch
from offpolicy_moe.logprobs.length_buckets import MAX_PIECES, bucket_cut, cut_cost_floor, pieces_cost, row_widths
from offpolicy_moe.logprobs.micro_batch import MicroBatching, update_cut
from offpolicy_moe.models.forward_plan import ForwardCostModel
from offpolicy_moe.trainer.trainer import Trainer
from tests.tiny import tiny_config

COST = ForwardCostModel(entry_weight=0.05, pass_overhead=40.0)


def _brute_force(widths: torch.Tensor, min_pieces: int, max_tokens) -> float:
    """The cheapest cut into runs of the rows sorted by width, over every composition (cuts between rows, not only
    between widths), each piece feasible under ``max_tokens``."""
    order = torch.sort(widths, stable=True).indices
    n, best = int(widths.numel()), float("inf")
    for k in range(0, min(n, MAX_PIECES) ):
        for cuts in itertools.combinations(range(1, n), k):
            bounds = (0, *cuts, n)
            pieces = [order[a:b] for a, b in zip(bounds, bounds[1:])]
            if len(pieces) < min_pieces:
                continue
            if max_tokens is not None and any(
                    p.numel() > 1 and p.numel() * int(widths[p].max()) > max_tokens for p in pieces):
                continue
            best = min(best, pieces_cost(widths, pieces, COST))
    return best


#: a mini-batch's row widths, the fewest pieces and the cap on padded positions (None: no cap)
CUT_CASES = dict(widths=st.lists(st.integers(1, 60), min_size=1, max_size=9), min_pieces=st.integers(1, 3),
                 cap=st.one_of(st.none(), st.integers(20, 300)))


@settings(max_examples=150, deadline=None)
@given(**CUT_CASES)
def test_bucket_cut_is_the_cheapest_cut_and_a_partition(widths, min_pieces, cap):
    w = torch.tensor(widths)
    cut = bucket_cut(w, min_pieces, cap, COST)
    best = _brute_force(w, min_pieces, cap)
    if cut is None:
        assert best == float("inf")
        return
    assert torch.equal(torch.sort(torch.cat(cut)).values, torch.arange(len(widths)))   # every row once
    assert min_pieces <= len(cut) <= MAX_PIECES
    for p in cut:
        assert torch.equal(p, torch.sort(p).values)                                   # rows in batch order
        assert cap is None or p.numel() == 1 or p.numel() * int(w[p].max()) <= cap
    assert pieces_cost(w, cut, COST) == pytest.approx(best, rel=1e-12)


@settings(max_examples=150, deadline=None)
@given(**CUT_CASES)
def test_the_cost_floor_is_below_every_cut_and_skipping_the_search_changes_no_cut(widths, min_pieces, cap):
    w = torch.tensor(widths)
    cut = bucket_cut(w, min_pieces, cap, COST)
    if cut is not None:
        assert cut_cost_floor(w, min_pieces, COST) <= pieces_cost(w, cut, COST) * (1 + 1e-12)
    rows = torch.arange(len(widths))
    with_floor = update_cut(len(widths), max(widths), 1, min_pieces, cap, None, w, COST)
    original = micro_batch.cut_cost_floor
    try:                # the floor never rules a cut out: the same cut as always searching
        micro_batch.cut_cost_floor = lambda *a: float("-inf")
        searched = update_cut(len(widths), max(widths), 1, min_pieces, cap, None, w, COST)
    finally:
        micro_batch.cut_cost_floor = original
    assert [[p.tolist() for p in m] for m in with_floor] == [[p.tolist() for p in m] for m in searched]
    assert torch.equal(torch.sort(torch.cat(with_floor[0])).values, rows)


def test_a_nearly_even_batch_is_not_searched(monkeypatch):
    """The default job's batches (widths 10-13 over 128 rows): no cut can reach the margin, so the search (a few ms
    a pass) is not run at all."""
    def no_search(*args):
        raise AssertionError("searched")

    monkeypatch.setattr(micro_batch, "bucket_cut", no_search)
    w = torch.tensor([10, 11, 12, 13] * 32)
    (pieces,) = update_cut(128, 13, 1, 1, None, None, w, ForwardCostModel(entry_weight=0.01))   # 4 layers: 0.009
    assert [p.tolist() for p in pieces] == [list(range(128))]
    monkeypatch.setattr(micro_batch, "bucket_cut", length_buckets.bucket_cut)
    assert len(update_cut(32, 200, 1, 1, None, None, torch.tensor([10] * 28 + [200, 180, 150, 120]), COST)[0]) >= 2


def test_even_lengths_keep_the_contiguous_cut_and_a_long_tail_is_bucketed():
    even = torch.full((32,), 12)
    assert [torch.equal(a, b) for a, b in zip(update_cut(32, 12, 1, 1, None, None, even, COST)[0],
                                              update_cut(32, 12, 1, 1, None)[0])] == [True]
    tail = torch.tensor([10] * 28 + [200, 180, 150, 120])
    (pieces,) = update_cut(32, 200, 1, 1, None, None, tail, COST)
    assert len(pieces) >= 2
    assert pieces_cost(tail, pieces, COST) < 0.5 * pieces_cost(tail, [torch.arange(32)], COST)
    assert torch.equal(pieces[0], torch.arange(28))            # the short rows together, in order


def test_bad_input_is_one_line():
    with pytest.raises(ValueError, match="one process only"):
        update_cut(4, 8, 1, 1, None, lambda n: n, torch.ones(4, dtype=torch.long), COST)
    with pytest.raises(ValueError, match="row widths"):
        update_cut(4, 8, 1, 1, None, None, torch.ones(3, dtype=torch.long), COST)
    with pytest.raises(ValueError, match="non-empty"):
        bucket_cut(torch.zeros(0, dtype=torch.long), 1, None, COST)
    with pytest.raises(ValueError, match="one process only"):
        MicroBatching(cost=COST, process_max=lambda n: n)


def test_row_widths_and_trimmed_width():
    am = torch.tensor([[0, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 0, 0]])
    assert row_widths(am).tolist() == [4, 5, 4]
    assert trimmed_width(am, 3) == 5
    assert trimmed_width(am[2:], 4) == 5            # at least one response column


def _long_tailed(tr: Trainer):
    """A generated batch whose last rows are made longer (their padding filled with real tokens), so the cut
    buckets it."""
    batch = tr.source.generate(0)
    P = batch.prompt_len
    extra = 24
    ids = torch.nn.functional.pad(batch.input_ids, (0, extra), value=5)
    am = torch.nn.functional.pad(batch.attention_mask, (0, extra))
    resp = torch.nn.functional.pad(batch.response_mask, (0, extra))
    long_rows = torch.arange(3)                          # the first rows: the buckets put them last
    am[long_rows] = 1
    resp[long_rows] = 1
    ids[long_rows, P:] = 5 + torch.arange(ids.shape[1] - P) % 7
    return batch.__class__(**{**batch.__dict__, "input_ids": ids, "attention_mask": am, "response_mask": resp,
                              "behav_logp": torch.nn.functional.pad(batch.behav_logp, (0, extra)),
                              "old_logp": None, "token_versions": None, "kept_tokens": None})


def test_bucketed_pieces_give_the_whole_batch_log_probs(tmp_path):
    torch.set_num_threads(1)
    cfg = tiny_config(tmp_path / "r", "rollout.dtype=float32", "trainer.share_prompt=false")
    tr = Trainer(cfg)
    batch = _long_tailed(tr)
    mb = tr.forward.micro_batching
    assert mb.cost is not None                          # on by default in one process
    pieces = mb.batch_pieces(batch.attention_mask)
    assert len(pieces) >= 2 and not torch.equal(torch.cat(pieces), torch.arange(batch.size))   # out of order
    with torch.no_grad():
        bucketed = tr.forward.logp_pieces(tr.unwrapped, batch)
        tr.forward.micro_batching = MicroBatching()
        whole = tr.forward.logp_pieces(tr.unwrapped, batch)
    assert bucketed.shape == whole.shape == batch.response_mask.shape
    torch.testing.assert_close(bucketed, whole, rtol=0, atol=1e-5)
    assert torch.equal(bucketed == 0, whole == 0)       # the padding's log-probs are 0 both ways


def test_a_trimmed_forward_equals_the_padded_one(tmp_path):
    """One piece of short rows, with and without the columns that are padding in all of them: the same log-probs
    (the trim leaves out only what every row masks)."""
    torch.set_num_threads(1)
    tr = Trainer(tiny_config(tmp_path / "r", "rollout.dtype=float32", "trainer.share_prompt=false"))
    batch = _long_tailed(tr)
    short = batch.index_select(torch.arange(3, batch.size))
    assert trimmed_width(short.attention_mask, short.prompt_len) < short.input_ids.shape[1]
    with torch.no_grad():
        trimmed = tr.forward.logp(tr.unwrapped, short)
        padded = tr.forward.logp(tr.unwrapped, short, record=True)[0]     # recording keeps every column
    torch.testing.assert_close(trimmed, padded, rtol=0, atol=1e-6)


def test_an_update_on_length_buckets_is_the_contiguous_update_up_to_rounding(tmp_path):
    """``Trainer.update`` on the long-tailed batch, bucketed (a cost model with a small per-forward overhead, so
    that the tiny batch is cut) and on one contiguous micro-batch, from the same weights: the same clipped gradient
    at the optimizer step up to float rounding (compared before Adam, which would magnify the rounding of
    near-zero entries differently on each CPU), the same loss, and the step moves the weights."""
    torch.set_num_threads(1)
    results = []
    for cost in (ForwardCostModel(entry_weight=0.05, pass_overhead=4.0), None):
        tr = Trainer(tiny_config(tmp_path / f"r{cost is None}", "rollout.dtype=float32",
                                 "trainer.share_prompt=false", "algo.routing.metrics=false"))
        torch.manual_seed(0)
        batch = _long_tailed(tr)
        tr.forward.micro_batching = MicroBatching(max_tokens=None, cost=cost)
        pieces = len(tr.forward.micro_batching.batch_pieces(batch.attention_mask))
        assert pieces >= 2 if cost is not None else pieces == 1
        grads: dict = {}
        step = tr.policy_update.checked_step

        def recording_step(step=step, grads=grads, model=tr.unwrapped):
            grads.update({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})
            step()

        tr.policy_update.checked_step = recording_step
        before = {k: v.detach().clone() for k, v in tr.unwrapped.state_dict().items()}
        metrics = tr.update(batch)
        after = {k: v.detach().clone() for k, v in tr.unwrapped.state_dict().items()}
        assert max((after[k] - before[k]).abs().max().item() for k in after) > 1e-4     # the step moved weights
        results.append((grads, metrics))
    (g_b, m_b), (g_c, m_c) = results
    assert g_b and set(g_b) == set(g_c)
    scale = max(g.abs().max().item() for g in g_c.values())
    for name in g_c:
        torch.testing.assert_close(g_b[name], g_c[name], rtol=1e-4, atol=1e-5 * scale, msg=name)
    assert m_b["actor/loss"] == pytest.approx(m_c["actor/loss"], abs=1e-5)
