"""Shared pieces of the global-scope test: the batch, the loss cases, and the gloo worker."""
from __future__ import annotations

import os

import torch

from offpolicy_moe.losses import global_counts, m2po_adaptive_cap, m2po_mask
from offpolicy_moe.losses import grpo_loss, gspo_loss, m2po_loss, unclipped_loss

B, T, TAU = 12, 10, 0.01
AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
RANK_ROWS = [(0, 5), (5, 12)]           # uneven split across 2 ranks
MICRO_CUTS = {0: [0, 2, 5], 1: [5, 6, 12]}  # each rank: 2 uneven micro-batches (global row indices)
CASES = {
    "grpo": (grpo_loss, {"dual_clip": 2.0}),
    "gspo": (gspo_loss, {"clip_low": 0.03, "clip_high": 0.04}),
    "unclipped": (unclipped_loss, {}),
    "m2po": (m2po_loss, {"tau": TAU}),
    "m2po_clip": (m2po_loss, {"tau": TAU, "variant": "adaptive_clip"}),
}


def batch():
    g = torch.Generator().manual_seed(1234)
    logp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    old = logp + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    mask = torch.rand(B, T, generator=g) < 0.7
    mask[3] = False  # an empty sequence
    w = torch.rand(B, T, generator=g, dtype=torch.float64) * 2
    return logp, old, adv, mask, w


def split_run(cuts, logp_leaf, old, adv, mask, w, process_group=None):
    """Run every case over micro-batches [cuts[k], cuts[k+1]) (global row indices) of the leaf rows
    ``logp_leaf`` (which start at row cuts[0]); returns {(case, agg): (loss, grad)} and the masks."""
    base = cuts[0]
    sl = [slice(a - base, b - base) for a, b in zip(cuts, cuts[1:])]
    gs = [slice(a, b) for a, b in zip(cuts, cuts[1:])]
    masks = [mask[s] for s in gs]
    n_tok, n_seq = global_counts(masks, process_group=process_group)
    lrs = [logp_leaf[s].detach() - old[g] for s, g in zip(sl, gs)]
    keeps = m2po_mask(lrs, [adv[g] for g in gs], masks, tau=TAU, process_group=process_group)
    cap = m2po_adaptive_cap(lrs, [adv[g] for g in gs], masks, tau=TAU, process_group=process_group)
    out = {}
    for name, (fn, opts) in CASES.items():
        for agg in AGGS:
            total = 0.0
            for k, (s, g) in enumerate(zip(sl, gs)):
                extra = {}
                if name == "m2po":
                    extra["m2po_keep"] = keeps[k]
                if name == "m2po_clip":
                    extra["m2po_cap"] = cap
                loss, _ = fn(logp_leaf[s], old[g], adv[g], mask[g], agg=agg, weights=w[g],
                             num_tokens=n_tok, num_seqs=n_seq, norm_length=T, **opts, **extra)
                total = total + loss
            (grad,) = torch.autograd.grad(total, logp_leaf)
            out[(name, agg)] = (total.detach(), grad)
    return out, keeps, cap


def worker(rank: int, world: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        logp, old, adv, mask, w = batch()
        a, b = RANK_ROWS[rank]
        leaf = logp[a:b].clone().requires_grad_(True)
        out, keeps, cap = split_run(MICRO_CUTS[rank], leaf, old, adv, mask, w, process_group=dist.group.WORLD)
        # scope="global" with a process group and no precomputed mask: one call per rank
        leaf2 = logp[a:b].clone().requires_grad_(True)
        loss, _ = m2po_loss(leaf2, old[a:b], adv[a:b], mask[a:b], tau=TAU, process_group=dist.group.WORLD,
                            num_tokens=int(mask.sum()))
        (g2,) = torch.autograd.grad(loss, leaf2)
        torch.save({"out": out, "keeps": keeps, "cap": cap, "m2po_pg": (loss.detach(), g2)},
                   os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()
