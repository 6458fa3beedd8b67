"""M2PO: second-moment trust region for stale data (Zheng, Zhao, Chen 2025, arXiv 2510.01161).

Trust-region tokens are the valid tokens whose ratio moves in the direction the advantage pushes:
``T = {t : m_t and ((A_t > 0 and r_t > 1) or (A_t < 0 and r_t < 1))}``, with
``M2_t = clamp(log r_t, +-20)^2`` (float32 for half inputs).  The selection is global over the optimizer
mini-batch: :func:`m2po_global_pass` takes the log-ratios of ALL its micro-batches (and ranks) and hands each
micro-batch its ``m2po_keep`` (or ``m2po_cap``).
"""
from __future__ import annotations

import math
from typing import Optional, Sequence, Union

import torch

from ._common import Metrics, apply_weights, frac, masked_mean, prepare
from ._validate import (
    as_bool_mask,
    check_2d,
    check_advantages,
    check_positive,
    check_same_shape,
    check_tensor,
    check_values,
    clamp_log_ratio,
    ratio_bound,
    value_checks,
)
from .aggregation import Count, aggregate
from .option_checks import check_m2po_options
from .reference import reference_m2po
from .registry import register_builtin_loss

TensorOrList = Union[torch.Tensor, Sequence[torch.Tensor]]


# ----------------------------------------------------------------------------------------------
# trust-region values

def _trust_region(log_ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, idx: str):
    """Return (trust-region bool [B,T], M2 values [B,T] with +inf outside the trust region, valid mask)."""
    check_tensor(f"log_ratio{idx}", log_ratio)
    check_tensor(f"mask{idx}", mask)
    check_2d(f"log_ratio{idx}", log_ratio)
    check_same_shape(f"log_ratio{idx}", log_ratio, f"mask{idx}", mask)
    adv = check_advantages(advantages, log_ratio.shape, f"log_ratio{idx}")
    check_values(mask, [(f"log_ratio{idx}", log_ratio), (f"advantages{idx}", advantages)])
    valid = as_bool_mask(mask)
    dtype = torch.promote_types(log_ratio.dtype, torch.float32)
    lr = torch.where(valid, log_ratio.detach().to(dtype), torch.zeros((), dtype=dtype, device=log_ratio.device))
    lr = clamp_log_ratio(lr, ratio_bound(log_ratio.dtype))
    a = adv.detach()
    tr = valid & (((a > 0) & (lr > 0)) | ((a < 0) & (lr < 0)))
    m2 = torch.where(tr, lr * lr, torch.full((), math.inf, dtype=dtype, device=lr.device))
    return tr, m2, valid


def _as_lists(log_ratio: TensorOrList, advantages: TensorOrList, mask: TensorOrList):
    if isinstance(log_ratio, torch.Tensor):
        if not isinstance(advantages, torch.Tensor) or not isinstance(mask, torch.Tensor):
            raise TypeError("log_ratio, advantages and mask must all be tensors or all be lists of tensors")
        return [log_ratio], [advantages], [mask], False
    lrs, advs, ms = list(log_ratio), list(advantages), list(mask)
    if not (len(lrs) == len(advs) == len(ms)):
        raise ValueError(
            f"list length mismatch: {len(lrs)} log_ratio, {len(advs)} advantages, {len(ms)} mask tensors"
        )
    if not lrs:
        raise ValueError("m2po selection needs at least one micro-batch")
    return lrs, advs, ms, True


def _gather_values(values: torch.Tensor, process_group) -> tuple[torch.Tensor, int]:
    """All-gather variable-length 1-D ``values`` rank-major; return (all values, offset of ours)."""
    import torch.distributed as dist

    world = dist.get_world_size(process_group)
    rank = dist.get_rank(process_group)
    n = torch.tensor([values.numel()], dtype=torch.int64, device=values.device)
    sizes_t = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(sizes_t, n, group=process_group)
    sizes = [int(s) for s in torch.cat(sizes_t).tolist()]
    longest = max(sizes)
    offset = sum(sizes[:rank])
    if longest == 0:
        return values.new_zeros((0,)), 0
    padded = values.new_full((longest,), math.inf)
    padded[: values.numel()] = values
    bufs = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(bufs, padded, group=process_group)
    return torch.cat([b[:s] for b, s in zip(bufs, sizes)]), offset


def _collect(log_ratio, advantages, mask, process_group):
    """Flat M2 values (global order) and a function mapping a flat per-value result back to masks."""
    lrs, advs, ms, is_list = _as_lists(log_ratio, advantages, mask)
    parts = [_trust_region(l, a, m, f"[{i}]" if is_list else "") for i, (l, a, m) in enumerate(zip(lrs, advs, ms))]
    dtype = parts[0][1].dtype
    if any(p[1].dtype != dtype for p in parts):
        dtype = torch.float64
    if process_group is None:
        # sync-free path: +inf marks non-trust-region positions; they sort last and are never kept
        flat = torch.cat([p[1].reshape(-1).to(dtype) for p in parts])
        sizes = [p[1].numel() for p in parts]

        def unflatten(per_value: torch.Tensor) -> list[torch.Tensor]:
            chunks = torch.split(per_value, sizes)
            return [c.view(p[1].shape) for c, p in zip(chunks, parts)]

        return flat, parts, unflatten, is_list
    local = torch.cat([p[1][p[0]].to(dtype) for p in parts])
    flat, offset = _gather_values(local, process_group)
    counts = [int(c) for c in torch.stack([p[0].sum() for p in parts]).tolist()]

    def unflatten_dist(per_value: torch.Tensor) -> list[torch.Tensor]:
        mine = per_value[offset: offset + local.numel()]
        outs, start = [], 0
        for p, c in zip(parts, counts):
            full = torch.zeros_like(p[0], dtype=per_value.dtype)
            full[p[0]] = mine[start: start + c]
            outs.append(full)
            start += c
        return outs

    return flat, parts, unflatten_dist, is_list


# ----------------------------------------------------------------------------------------------
# exact selection

def _keep_sorted_prefix(values: torch.Tensor, tau: float) -> torch.Tensor:
    """Per-value bool: kept by Algorithm 1.  ``values`` is 1-D; +inf entries are never kept.

    Stable ascending sort; keep the longest prefix whose running mean is <= tau (running means of
    an ascending sequence never decrease, so this equals dropping the maximum until the mean fits;
    equal values keep the smaller flat position, as the greedy loop removes larger positions first).
    """
    n = values.numel()
    if n == 0:
        return torch.zeros(0, dtype=torch.bool, device=values.device)
    sorted_v, order = torch.sort(values, stable=True)
    csum = torch.cumsum(sorted_v.to(torch.float64), 0)
    pos = torch.arange(1, n + 1, device=values.device, dtype=torch.float64)
    fits = csum <= tau * pos
    k = torch.where(fits, pos, torch.zeros((), dtype=torch.float64, device=values.device)).max()
    keep_sorted = pos <= k
    return torch.empty_like(keep_sorted).scatter_(0, order, keep_sorted)


def m2po_mask(
    log_ratio: TensorOrList,
    advantages: TensorOrList,
    mask: TensorOrList,
    *,
    tau: float = 0.04,
    process_group=None,
) -> Union[torch.Tensor, list[torch.Tensor]]:
    """M2PO token mask (Algorithm 1 of arXiv 2510.01161), computed exactly in one pass.

    Greedy definition: while ``mean_{t in T} M2_t > tau``, drop the trust-region token with the largest ``M2_t``
    (ties: the larger flat position first); equivalently, keep the longest prefix of the stable ascending sort of M2
    over T whose running mean is <= tau (one sort + one cumsum, no host sync).  True where the token contributes:
    valid tokens outside T and the kept ones.  Lists of micro-batch tensors give ONE selection over all of them
    (flat order: micro-batch, then row-major); with ``process_group`` over all ranks (all-gathered rank-major).
    """
    check_positive("tau", tau)
    flat, parts, unflatten, is_list = _collect(log_ratio, advantages, mask, process_group)
    kept = unflatten(_keep_sorted_prefix(flat, float(tau)))
    outs = [valid & (~tr | keep) for (tr, _, valid), keep in zip(parts, kept)]
    return outs if is_list else outs[0]


def m2po_adaptive_cap(
    log_ratio: TensorOrList,
    advantages: TensorOrList,
    mask: TensorOrList,
    *,
    tau: float = 0.04,
    process_group=None,
) -> torch.Tensor:
    """Cap ``c`` of the official M2PO code's adaptive clip (arXiv 2510.01161, code release).

    The largest ``c`` with ``sum_{t in T} min(M2_t, c) <= tau |T|`` (``+inf`` when the trust
    region already fits, or is empty); a 0-d float64 tensor, global over lists / ranks like
    :func:`m2po_mask`.  The loss then PPO-clips ``r`` to ``[exp(-sqrt(c)), exp(sqrt(c))]``.
    With ascending values v and prefix sums P: ``f(v_k) = P_k + (n-k) v_k`` is nondecreasing in k;
    ``k* = #{k : f(v_k) <= tau n}`` and ``c = (tau n - P_{k*}) / (n - k*)``.
    """
    check_positive("tau", tau)
    flat, _, _, _ = _collect(log_ratio, advantages, mask, process_group)
    dev = flat.device
    if flat.numel() == 0:
        return torch.tensor(math.inf, dtype=torch.float64, device=dev)
    v = torch.sort(flat.to(torch.float64)).values
    finite = torch.isfinite(v)
    n = finite.sum().to(torch.float64)
    vf = torch.where(finite, v, torch.zeros((), dtype=torch.float64, device=dev))
    psum = torch.cumsum(vf, 0)
    k = torch.arange(1, v.numel() + 1, device=dev, dtype=torch.float64)
    budget = float(tau) * n
    ok = finite & (psum + (n - k) * vf <= budget)
    kstar = ok.sum()
    p_kstar = torch.where(kstar > 0, psum[(kstar - 1).clamp(min=0)], torch.zeros((), dtype=torch.float64, device=dev))
    rest = (n - kstar.to(torch.float64)).clamp(min=1.0)
    cap = (budget - p_kstar) / rest
    return torch.where(kstar.to(torch.float64) >= n, torch.full_like(cap, math.inf), cap)


# ----------------------------------------------------------------------------------------------
# the loss and its registry entry


def m2po_global_pass(log_ratios, advantages, masks, options, process_group=None) -> list[dict]:
    """The mini-batch-wide M2PO selection: one :func:`m2po_mask` (or :func:`m2po_adaptive_cap`) over
    all micro-batches (and ranks), returned as each micro-batch's ``m2po_keep`` (or ``m2po_cap``)."""
    tau = float(options.get("tau", 0.04))
    if options.get("variant", "mask") == "adaptive_clip":
        cap = m2po_adaptive_cap(log_ratios, advantages, masks, tau=tau, process_group=process_group)
        return [{"m2po_cap": cap} for _ in log_ratios]
    keeps = m2po_mask(log_ratios, advantages, masks, tau=tau, process_group=process_group)
    return [{"m2po_keep": k} for k in keeps]


@register_builtin_loss("m2po", global_pass=m2po_global_pass, reference=reference_m2po)
def m2po_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    agg: Optional[str] = None,
    weights: Optional[torch.Tensor] = None,
    num_tokens: Count = None,
    num_seqs: Count = None,
    norm_length: Optional[float] = None,
    tau: float = 0.04,
    variant: str = "mask",
    scope: str = "global",
    process_group=None,
    m2po_keep: Optional[torch.Tensor] = None,
    m2po_cap: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, Metrics]:
    """M2PO objective (arXiv 2510.01161).

    ``variant="mask"`` (paper, default): ``l_t = -M_t A_t r_t`` with NO clipping, ``M`` from :func:`m2po_mask`,
    aggregated over ALL valid tokens (dropped tokens stay in the denominator, paper footnote 2).
    ``variant="adaptive_clip"`` (official code): PPO clip of ``r`` to ``[exp(-sqrt(c)), exp(sqrt(c))]`` with ``c``
    from :func:`m2po_adaptive_cap`.

    A given ``m2po_keep`` (resp. ``m2po_cap``) is used as is (the mini-batch-wide selection); otherwise
    ``scope="global"`` selects over this call's tokens (and ranks, with ``process_group``), ``scope="local"`` over
    this call's tokens only (the official code's per-micro-batch behaviour).

    Metrics (local to this call): ``m2po/m2_before`` / ``m2po/m2_after`` (mean M2 over trust-region tokens before /
    after masking), ``m2po/masked_frac``, ``m2po/trust_region_frac``, ``actor/ppo_kl``, ``actor/ratio_mean``;
    adaptive_clip adds ``m2po/log_ratio_bound`` (sqrt(c), capped at 20) and ``actor/clipfrac``.
    """
    agg = "token-mean" if agg is None else agg
    check_m2po_options(tau, variant, scope)
    x = prepare(logp, old_logp, advantages, mask, weights, agg,
                num_tokens=num_tokens, num_seqs=num_seqs, norm_length=norm_length,
                extra_checks=_cap_checks(m2po_cap, logp.device))
    group = process_group if scope == "global" else None
    with value_checks(False):  # already checked by prepare()
        return _m2po_loss_body(x, logp, agg, num_tokens, num_seqs, norm_length, tau, variant, group,
                               m2po_keep, m2po_cap)


def _cap_checks(m2po_cap, device) -> list:
    """A numeric ``m2po_cap`` is checked now (>= 0, inf allowed); a tensor one joins the fused value check."""
    if m2po_cap is None:
        return []
    if not isinstance(m2po_cap, torch.Tensor):
        if isinstance(m2po_cap, bool) or not isinstance(m2po_cap, (int, float)) or not m2po_cap >= 0:
            raise ValueError(f"m2po_cap must be a number >= 0 (inf allowed), got {m2po_cap!r}")
        return []
    if m2po_cap.numel() != 1:
        raise ValueError(f"m2po_cap must be a number or a one-element tensor, got shape {tuple(m2po_cap.shape)}")
    return [("m2po_cap must be >= 0 (inf allowed), got a negative or NaN tensor",
             (m2po_cap.detach().reshape(()) >= 0).to(device))]


def _m2po_loss_body(x, logp, agg, num_tokens, num_seqs, norm_length, tau, variant, group, m2po_keep, m2po_cap):
    tr, m2, _ = _trust_region(x.log_ratio, x.adv, x.mask, "")
    m2_fin = torch.where(tr, m2, torch.zeros_like(m2))
    ratio = torch.exp(x.log_ratio)
    metrics: Metrics = {
        "m2po/m2_before": masked_mean(m2_fin, tr),
        "m2po/trust_region_frac": frac(tr, x.mask),
        "actor/ppo_kl": masked_mean(-x.log_ratio, x.mask),
        "actor/ratio_mean": masked_mean(ratio, x.mask),
    }
    if variant == "mask":
        if m2po_keep is None:
            keep = m2po_mask(x.log_ratio.detach(), x.adv, x.mask, tau=tau, process_group=group)
        else:
            check_tensor("m2po_keep", m2po_keep)
            check_same_shape("logp", logp, "m2po_keep", m2po_keep)
            keep = as_bool_mask(m2po_keep) & x.mask
        zero = torch.zeros((), dtype=ratio.dtype, device=logp.device)
        loss_mat = torch.where(keep, -x.adv * ratio, zero)
        metrics["m2po/m2_after"] = masked_mean(m2_fin, tr & keep)
        metrics["m2po/masked_frac"] = frac(~keep, x.mask)
    else:
        if m2po_cap is None:
            cap = m2po_adaptive_cap(x.log_ratio.detach(), x.adv, x.mask, tau=tau, process_group=group)
        else:
            cap = torch.as_tensor(m2po_cap, dtype=torch.float64, device=logp.device).reshape(())
        bound = cap.sqrt().clamp(max=x.bound).to(ratio.dtype)
        unclipped = -x.adv * ratio
        clipped = -x.adv * torch.clamp(ratio, min=torch.exp(-bound), max=torch.exp(bound))
        use_clipped = clipped > unclipped
        loss_mat = torch.where(use_clipped, clipped, unclipped)
        metrics["m2po/log_ratio_bound"] = bound.detach().to(torch.float32)
        metrics["actor/clipfrac"] = frac(use_clipped, x.mask)
        clipped_m2 = torch.minimum(m2_fin, cap.to(m2_fin.dtype))
        metrics["m2po/m2_after"] = masked_mean(clipped_m2, tr)
        metrics["m2po/masked_frac"] = frac(use_clipped, x.mask)
    loss = aggregate(
        apply_weights(loss_mat, x.weights), x.mask, agg,
        num_tokens=num_tokens, num_seqs=num_seqs, norm_length=norm_length,
    )
    return loss, metrics


__all__ = ["m2po_mask", "m2po_adaptive_cap", "m2po_loss", "m2po_global_pass", "check_m2po_options"]
