"""``trainer.micro_batch_tokens``: a mini-batch holding more padded token positions than the cap is cut into more
micro-batches, exactly the cut ``trainer.grad_accum`` would make (so the same update, bit for bit), and a batch
cut that way is never fused with routing measurements (they need the routes of the whole batch's forward)."""
from __future__ import annotations

import pytest
import torch

from offpolicy_moe.logprobs.micro_batch import micro_batch_count
from offpolicy_moe.trainer.launch import train
from tests.trainer.test_trainer import final_weights, read_metrics, strip_perf


@pytest.mark.parametrize("rows,seq,accum,cap,want", [
    (128, 263, 1, None, 1),          # no cap
    (128, 263, 1, 16384, 3),         # 33,664 positions -> ceil(33664 / 16384)
    (256, 263, 1, 16384, 5),
    (128, 71, 1, 16384, 1),          # 9,088 positions fit
    (128, 128, 1, 16384, 1),         # exactly the cap fits
    (128, 129, 1, 16384, 2),
    (128, 263, 8, 16384, 8),         # grad_accum asks for more
    (4, 1000, 1, 10, 4),             # never more micro-batches than rows
    (3, 5, 7, 100, 3),
])
def test_micro_batch_count(rows, seq, accum, cap, want):
    assert micro_batch_count(rows, seq, accum, cap) == want


def test_cap_cuts_like_grad_accum(make_cfg):
    """A cap of 1 position cuts every mini-batch of 8 rows into 8 micro-batches: the run is bit for bit the run
    with grad_accum=8 and no cap."""
    base = ("buffer.staleness=1", "trainer.steps=3", "trainer.updates_per_step=2", "algo.routing.metrics=false",
            "rollout.dtype=float32")
    a = make_cfg(*base, "trainer.grad_accum=8", "trainer.micro_batch_tokens=null")
    b = make_cfg(*base, "trainer.grad_accum=1", "trainer.micro_batch_tokens=1")
    c = make_cfg(*base, "trainer.grad_accum=1", "trainer.micro_batch_tokens=null")
    for cfg in (a, b, c):
        train(cfg)
    wa, wb, wc = (final_weights(x.run_dir, 3) for x in (a, b, c))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert strip_perf(read_metrics(a.run_dir)) == strip_perf(read_metrics(b.run_dir))
    assert max((wa[k] - wc[k]).abs().max().item() for k in wa) < 1e-5      # one micro-batch: rounding only


def test_cut_batch_is_not_fused_with_routing_measurements(make_cfg):
    """On-policy, one update, routing measured: a batch the cap cuts takes the separate old-logp pass, like
    grad_accum > 1 (a fused pass would keep the routes of the last micro-batch only)."""
    base = ("trainer.steps=2", "algo.routing.metrics=true", "rollout.dtype=float32")
    a = make_cfg(*base, "trainer.grad_accum=16", "trainer.micro_batch_tokens=null")
    b = make_cfg(*base, "trainer.grad_accum=1", "trainer.micro_batch_tokens=1")
    train(a)
    train(b)
    ra, rb = strip_perf(read_metrics(a.run_dir)), strip_perf(read_metrics(b.run_dir))
    assert ra == rb
    assert any(k.startswith("routing/") for k in ra[-1])
