"""Global scope: whole batch == micro-batches with global counts == 2 gloo processes.

Covers the M2PO mask and adaptive cap and the gradient of every objective in every aggregation mode.
"""
import socket

import pytest
import torch

import loss_dist_worker as W
from loss_refs import greedy_m2po
from offpolicy_moe.losses import m2po_adaptive_cap, m2po_loss, m2po_mask

pytestmark = pytest.mark.filterwarnings("ignore:gspo_loss")


def _whole():
    logp, old, adv, mask, w = W.batch()
    ref = {}
    for name, (fn, opts) in W.CASES.items():
        for agg in W.AGGS:
            leaf = logp.clone().requires_grad_(True)
            loss, _ = fn(leaf, old, adv, mask, agg=agg, weights=w, norm_length=W.T, **opts)
            (g,) = torch.autograd.grad(loss, leaf)
            ref[(name, agg)] = (loss.detach(), g)
    keep = m2po_mask(logp - old, adv, mask, tau=W.TAU)
    cap = m2po_adaptive_cap(logp - old, adv, mask, tau=W.TAU)
    return ref, keep, cap


def test_whole_batch_selection_is_nontrivial_and_greedy():
    logp, old, adv, mask, _ = W.batch()
    keep = m2po_mask(logp - old, adv, mask, tau=W.TAU)
    assert torch.equal(keep, greedy_m2po(logp - old, adv, mask, W.TAU))
    assert int((mask & ~keep).sum()) > 0


def test_micro_batches_with_global_counts_equal_whole_batch():
    ref, keep, cap = _whole()
    logp, old, adv, mask, w = W.batch()
    leaf = logp.clone().requires_grad_(True)
    out, keeps, cap_split = W.split_run([0, 2, 5, 6, 12], leaf, old, adv, mask, w)
    assert torch.equal(torch.cat(keeps), keep)
    assert float(cap_split) == float(cap)
    for key, (loss, grad) in ref.items():
        torch.testing.assert_close(out[key][0], loss, rtol=1e-12, atol=1e-14, msg=str(key))
        torch.testing.assert_close(out[key][1], grad, rtol=1e-12, atol=1e-14, msg=str(key))


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_gloo_processes_equal_whole_batch(tmp_path):
    import torch.distributed as dist
    import torch.multiprocessing as mp

    if not dist.is_available():
        pytest.skip("torch.distributed not available")
    mp.spawn(W.worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    ref, keep, cap = _whole()
    assert torch.equal(torch.cat(ranks[0]["keeps"] + ranks[1]["keeps"]), keep)
    assert float(ranks[0]["cap"]) == float(cap) == float(ranks[1]["cap"])
    for key, (loss, grad) in ref.items():
        total = ranks[0]["out"][key][0] + ranks[1]["out"][key][0]
        g = torch.cat([ranks[0]["out"][key][1], ranks[1]["out"][key][1]])
        torch.testing.assert_close(total, loss, rtol=1e-12, atol=1e-14, msg=str(key))
        torch.testing.assert_close(g, grad, rtol=1e-12, atol=1e-14, msg=str(key))
    # m2po_loss(scope="global", process_group=...) without a precomputed mask, one call per rank
    logp, old, adv, mask, _ = W.batch()
    leaf = logp.clone().requires_grad_(True)
    whole, _ = m2po_loss(leaf, old, adv, mask, tau=W.TAU)
    (g_whole,) = torch.autograd.grad(whole, leaf)
    torch.testing.assert_close(ranks[0]["m2po_pg"][0] + ranks[1]["m2po_pg"][0], whole.detach())
    torch.testing.assert_close(torch.cat([ranks[0]["m2po_pg"][1], ranks[1]["m2po_pg"][1]]), g_whole)
