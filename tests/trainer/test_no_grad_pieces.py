"""The passes without gradient over a whole batch (old-logp recompute, reference, proximal, the R3 counterfactual)
run on the update's micro-batches (``MicroBatching.pieces``): no forward holds more than
``trainer.micro_batch_tokens`` padded positions, the values are the whole-batch forward's up to float rounding, and
the recompute pass gives the update forward's log-probs bit for bit, so fusing it away changes nothing at any cut."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from offpolicy_moe.logprobs.micro_batch import MicroBatching, max_over_processes, micro_batch_count, update_cut
from offpolicy_moe.trainer.trainer import Trainer
from tests.tiny import run_fused_or_not, tiny_config


@settings(max_examples=300, deadline=None)
@given(rows=st.integers(0, 70), seq=st.integers(1, 300), ups=st.integers(1, 5), accum=st.integers(1, 9),
       cap=st.one_of(st.none(), st.integers(1, 5000)))
def test_update_cut_is_the_minibatch_then_microbatch_partition(rows, seq, ups, accum, cap):
    cut = update_cut(rows, seq, ups, accum, cap)
    minis = torch.arange(rows).tensor_split(ups)        # the mini-batches, as the update has always made them
    assert len(cut) == ups
    for mini, pieces in zip(minis, cut):
        if mini.numel() == 0:
            assert pieces == []
            continue
        assert torch.equal(torch.cat(pieces), mini)      # contiguous, in order, nothing lost or repeated
        assert len(pieces) == micro_batch_count(int(mini.numel()), seq, accum, cap)
        for p in pieces:
            assert p.numel() >= 1
            if cap is not None and p.numel() > 1:
                # tensor_split's parts differ by at most one row: the cap holds up to that row
                assert (p.numel() - 1) * seq <= cap or len(pieces) == accum
    flat = MicroBatching(ups, accum, cap).pieces(rows, seq)
    assert torch.equal(torch.cat(flat) if flat else torch.arange(0), torch.arange(rows))


def _no_grad_forward_rows(cfg) -> tuple[list[int], list[int]]:
    """Rows of every log-prob forward of the trainer's model (``use_cache=False``: not the greedy evaluation's
    generation), split into forwards without and with gradient."""
    tr = Trainer(cfg)
    no_grad, grad = [], []

    def spy(module, args, kwargs):
        if kwargs.get("use_cache") is not False:
            return
        ids = kwargs["input_ids"]
        (grad if torch.is_grad_enabled() else no_grad).append(int(ids.shape[0]))

    handle = tr.unwrapped.register_forward_pre_hook(spy, with_kwargs=True)
    try:
        tr.run()
    finally:
        handle.remove()
    return no_grad, grad


def test_recompute_pass_forwards_hold_at_most_the_cap(tmp_path):
    """Staleness 1 (a separate old-logp pass) and a reference model (KL): with a cap of one position, every
    forward (with or without gradient) holds one sequence.  The old pass ran the whole batch of 16 at once."""
    torch.set_num_threads(1)
    common = ["buffer.staleness=1", "trainer.steps=3", "trainer.share_prompt=false", "algo.kl.coef=0.1",
              "algo.routing.metrics=true", "rollout.dtype=float32"]
    no_grad, grad = _no_grad_forward_rows(tiny_config(tmp_path / "cap", *common, "trainer.micro_batch_tokens=1"))
    assert no_grad and grad
    assert set(no_grad) == {1} and set(grad) == {1}
    no_grad, _ = _no_grad_forward_rows(tiny_config(tmp_path / "nocap", *common, "trainer.micro_batch_tokens=null"))
    assert max(no_grad) == 16                              # without a cap: one forward per batch


def test_fused_old_logp_equals_recompute_pass_when_the_update_is_cut(tmp_path):
    """On-policy, one update, the batch cut into 4 micro-batches (by grad_accum, then by the token cap): the run
    that recomputes old_logp in a separate pass is bit for bit the run that takes it from the update forward,
    because the pass runs on the update's micro-batches (a whole-batch pass differs in float rounding)."""
    torch.set_num_threads(1)
    for name, cut in (("accum", ["trainer.grad_accum=4", "trainer.micro_batch_tokens=null"]),
                      ("cap", ["trainer.grad_accum=1", "trainer.micro_batch_tokens=40"])):
        common = ["buffer.staleness=0", "trainer.updates_per_step=1", "rollout.dtype=float32", "trainer.steps=2",
                  "algo.routing.metrics=false", "rollout.prompts_per_step=8", "rollout.max_new_tokens=4", *cut]
        fused_rows, fused_w = run_fused_or_not(tiny_config(tmp_path / f"{name}_fused", *common), True)
        ref_rows, ref_w = run_fused_or_not(tiny_config(tmp_path / f"{name}_ref", *common), False)
        assert fused_rows == ref_rows, name
        for k in ref_w:
            assert torch.equal(fused_w[k], ref_w[k]), (name, k)


def test_pieces_equal_the_whole_batch_forward(tmp_path):
    """``logp_pieces`` (values and recorded routes) against one forward of the whole batch: same routes, log-probs
    equal to float rounding."""
    torch.set_num_threads(1)
    cfg = tiny_config(tmp_path / "r", "rollout.dtype=float32", "trainer.micro_batch_tokens=1",
                      "algo.routing.metrics=true", "trainer.share_prompt=false")
    tr = Trainer(cfg)
    batch = tr.source.generate(0)
    whole = MicroBatching()
    pieces = tr.forward.micro_batching
    assert len(pieces.pieces(batch.size, int(batch.input_ids.shape[1]))) == batch.size
    with torch.no_grad():
        lp_p, tr_p = tr.forward.logp_pieces(tr.unwrapped, batch, None, record=True)
        tr.forward.micro_batching = whole
        lp_w, tr_w = tr.forward.logp_pieces(tr.unwrapped, batch, None, record=True)
        replay_p = None
        tr.forward.micro_batching = pieces
        replay_p = tr.forward.logp_pieces(tr.unwrapped, batch, tr_w)
    assert lp_p.shape == lp_w.shape == batch.response_mask.shape
    torch.testing.assert_close(lp_p, lp_w, rtol=0, atol=1e-5)
    assert torch.equal(tr_p.ids, tr_w.ids)
    torch.testing.assert_close(replay_p, lp_w, rtol=0, atol=1e-5)     # replaying the routes, piece by piece


def _agree_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        mb = MicroBatching(2, 1, 100, max_over_processes(torch.device("cpu")))
        rows, seq = (8, 40) if rank == 0 else (7, 13)      # uneven shards: 320 vs 91 positions per mini-batch
        counts = [len(mini) for mini in mb.cut(rows, seq)]
        local = [len(mini) for mini in update_cut(rows, seq, 2, 1, 100)]
        Path(out_dir, f"{rank}.json").write_text(json.dumps({"agreed": counts, "local": local}))
    finally:
        torch.distributed.destroy_process_group()


def test_micro_batch_counts_agree_across_processes(tmp_path):
    """Two processes with shards of different rows and padded lengths cut into the same number of micro-batches
    (the larger), so a sharded model makes the same number of forwards on each; alone they would differ."""
    torch.multiprocessing.spawn(_agree_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2)
    r0, r1 = (json.loads((tmp_path / f"{r}.json").read_text()) for r in (0, 1))
    assert r0["local"] == [2, 2] and r1["local"] == [1, 1]          # 4 x 40 = 160 > 100; 4 x 13 = 52 <= 100
    assert r0["agreed"] == r1["agreed"] == [2, 2]


def test_micro_batching_with_process_max_partitions_rows():
    mb = MicroBatching(2, 1, None, lambda n: n + 2)                 # a stand-in "other process" needing 2 more
    cut = mb.cut(9, 5)
    assert [len(mini) for mini in cut] == [3, 3]
    assert torch.equal(torch.cat([torch.cat(mini) for mini in cut]), torch.arange(9))
    assert [len(mini) for mini in MicroBatching(1, 1, None, lambda n: 50).cut(3, 5)] == [3]   # never more than rows


def test_micro_batching_refuses_counts_below_one():
    import pytest

    for args in ((0, 1, None), (1, 0, None), (1, 1, 0)):
        with pytest.raises(ValueError, match="MicroBatching needs"):
            MicroBatching(*args)
