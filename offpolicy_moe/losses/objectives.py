"""Clipped and unclipped policy-gradient objectives: GRPO/PPO, GSPO(-token), no trust region.

Each follows the calling convention of :mod:`offpolicy_moe.losses.registry`; ``agg=None`` picks the
objective's default aggregation mode.
"""
from __future__ import annotations

import math
import warnings
from typing import Optional

import torch

from ._closed_form import count_valid, finish_lean, prepare_lean, share
from ._common import Metrics, apply_weights, frac, masked_max, masked_mean, prepare
from .aggregation import Count, aggregate
from .option_checks import check_grpo_options, check_gspo_options
from .reference import reference_grpo, reference_gspo, reference_unclipped
from .registry import register_builtin_loss

GRPO_CLIP = (0.2, 0.2)
GSPO_CLIP = (3e-4, 4e-4)






@register_builtin_loss("grpo", reference=reference_grpo)
def grpo_loss(
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
    clip_low: Optional[float] = None,
    clip_high: Optional[float] = None,
    dual_clip: Optional[float] = None,
) -> tuple[torch.Tensor, Metrics]:
    """PPO/GRPO clipped surrogate (PPO arXiv 1707.06347; GRPO arXiv 2402.03300; DAPO clip-higher 2503.14476).

    ``r = exp(clamp(logp - old_logp, +-20))``, ``l = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))``; with
    ``dual_clip = c > 1`` (arXiv 1912.09729) tokens with ``A < 0`` get ``l = min(l, -A c)``.  ``l *= weights``; default
    aggregation ``token-mean``; defaults ``clip_low = clip_high = 0.2``.

    Metrics: ``actor/clipfrac`` (clipped branch active), ``actor/clipfrac_low`` (A<0, r<1-lo),
    ``actor/clipfrac_high`` (A>0, r>1+hi), ``actor/dual_clipfrac``, ``actor/ppo_kl``
    (masked mean of ``old_logp - logp``), ``actor/ratio_mean``, ``actor/ratio_max``.
    """
    agg = "token-mean" if agg is None else agg
    check_grpo_options(clip_low, clip_high, dual_clip)
    lo = float(GRPO_CLIP[0] if clip_low is None else clip_low)
    hi = float(GRPO_CLIP[1] if clip_high is None else clip_high)
    counts = dict(num_tokens=num_tokens, num_seqs=num_seqs, norm_length=norm_length)
    x = prepare_lean(logp, old_logp, advantages, mask, weights, agg, **counts)
    with torch.no_grad():
        ratio = torch.exp(x.log_ratio)
        a_r = x.adv * ratio
        a_clip = x.adv * ratio.clamp(1.0 - lo, 1.0 + hi)
        clipped = a_clip < a_r                     # -A clip(r) > -A r: the clipped branch is the max
        loss_tok = -torch.minimum(a_r, a_clip)
        # d loss_t / d logp_t: -A r on the unclipped branch inside the log-ratio bound, else 0
        grad_flows = ~clipped & (x.log_ratio == x.raw)
        dual = None
        if dual_clip is not None:
            cap = x.adv * -float(dual_clip)
            dual = (x.adv < 0) & (cap < loss_tok)
            loss_tok = torch.where(dual, cap, loss_tok)
            grad_flows &= ~dual
        coef = torch.where(grad_flows, -a_r, torch.zeros((), dtype=a_r.dtype, device=a_r.device))
    loss = finish_lean(x, logp, loss_tok, coef, agg, inputs=(old_logp, advantages, mask, weights), **counts)
    with torch.no_grad():
        n = x.n_valid
        valid_ratio = torch.where(x.mask, ratio, torch.zeros((), dtype=ratio.dtype, device=ratio.device))
        low = count_valid(clipped & (x.adv < 0), x.mask)
        high = count_valid(clipped & (x.adv > 0), x.mask)
        metrics: Metrics = {
            "actor/clipfrac": share(low + high, n),
            "actor/clipfrac_low": share(low, n),
            "actor/clipfrac_high": share(high, n),
            "actor/dual_clipfrac": share(count_valid(dual, x.mask), n) if dual is not None else share(n * 0, n),
            "actor/ppo_kl": (-x.log_ratio.sum() / n.clamp(min=1)).to(torch.float32),
            "actor/ratio_mean": (valid_ratio.sum() / n.clamp(min=1)).to(torch.float32),
            "actor/ratio_max": (valid_ratio.amax() if ratio.numel() else n * 0).to(torch.float32),
        }
    return loss, metrics


@register_builtin_loss("gspo", reference=reference_gspo)
def gspo_loss(
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
    clip_low: Optional[float] = None,
    clip_high: Optional[float] = None,
) -> tuple[torch.Tensor, Metrics]:
    """GSPO, token form (Group Sequence Policy Optimization, arXiv 2507.18071).

    ``log s_i = sum_t m (logp - old_logp) / max(sum_t m, 1)`` (clamped to +-20), and per token
    ``log s_{i,t} = logp - sg[logp] + sg[log s_i]``: value ``s_i``, gradient ``s_i grad logp``.
    ``l = max(-A s, -A clip(s, 1 - clip_low, 1 + clip_high))`` (defaults 3e-4 / 4e-4), times ``weights``; the
    default ``agg`` ``seq-mean-token-mean`` makes the gradient sequence-level GSPO's when A is per sequence
    (token-sum modes warn: they weight each sequence by its length).

    Metrics: ``actor/clipfrac`` (valid tokens whose sequence ratio is clipped), ``actor/clipfrac_low``,
    ``actor/clipfrac_high``, ``actor/ppo_kl``, ``gspo/seq_ratio_mean``, ``gspo/seq_clipfrac``.
    """
    agg = "seq-mean-token-mean" if agg is None else agg
    check_gspo_options(clip_low, clip_high)
    lo = float(GSPO_CLIP[0] if clip_low is None else clip_low)
    hi = float(GSPO_CLIP[1] if clip_high is None else clip_high)
    if agg in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
        warnings.warn(
            f"gspo_loss with agg={agg!r} weights each sequence by its length; GSPO's objective is "
            "'seq-mean-token-mean'",
            stacklevel=2,
        )
    counts = dict(num_tokens=num_tokens, num_seqs=num_seqs, norm_length=norm_length)
    x = prepare_lean(logp, old_logp, advantages, mask, weights, agg, **counts)
    with torch.no_grad():
        n_tok = x.mask.sum(-1)
        seq_log = (x.raw.sum(-1) / n_tok.clamp(min=1).to(x.raw.dtype)).clamp(-x.bound, x.bound)
        seq_s = torch.exp(seq_log)
        s = seq_s.unsqueeze(-1)                     # [B, 1]: every token of sequence i has the value s_i
        a_s = x.adv * s
        a_clip = x.adv * s.clamp(1.0 - lo, 1.0 + hi)
        clipped = a_clip < a_s
        loss_tok = -torch.minimum(a_s, a_clip)
        # d/d logp_t of -A exp(logp_t - sg[logp_t] + sg[log s_i]) is -A s_i (0 on the clipped branch)
        coef = torch.where(clipped, torch.zeros((), dtype=a_s.dtype, device=a_s.device), -a_s)
        coef = coef.expand_as(x.raw) if coef.shape != x.raw.shape else coef
    loss = finish_lean(x, logp, loss_tok, coef, agg, inputs=(old_logp, advantages, mask, weights), **counts)
    with torch.no_grad():
        n = x.n_valid
        has_tok = n_tok > 0
        low = count_valid(clipped & (x.adv < 0), x.mask)
        high = count_valid(clipped & (x.adv > 0), x.mask)
        seq_clipped = ((seq_s < 1.0 - lo) | (seq_s > 1.0 + hi)) & has_tok
        metrics: Metrics = {
            "actor/clipfrac": share(low + high, n),
            "actor/clipfrac_low": share(low, n),
            "actor/clipfrac_high": share(high, n),
            "actor/ppo_kl": (-x.log_ratio.sum() / n.clamp(min=1)).to(torch.float32),
            "gspo/seq_ratio_mean": masked_mean(seq_s, has_tok),
            "gspo/seq_clipfrac": frac(seq_clipped, has_tok),
        }
    return loss, metrics


@register_builtin_loss("unclipped", reference=reference_unclipped)
def unclipped_loss(
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
) -> tuple[torch.Tensor, Metrics]:
    """Importance-weighted policy gradient with no trust region: ``l = -A r`` (times ``weights``).

    ``r = exp(clamp(logp - old_logp, +-20))``.  The "no TR" baseline of M2PO (arXiv 2510.01161),
    which trains well until it collapses at high staleness.  Default aggregation ``token-mean``.
    Metrics: ``actor/ppo_kl``, ``actor/ratio_mean``, ``actor/ratio_max``.
    """
    agg = "token-mean" if agg is None else agg
    x = prepare(logp, old_logp, advantages, mask, weights, agg,
                num_tokens=num_tokens, num_seqs=num_seqs, norm_length=norm_length)
    ratio = torch.exp(x.log_ratio)
    loss = aggregate(
        apply_weights(-x.adv * ratio, x.weights), x.mask, agg,
        num_tokens=num_tokens, num_seqs=num_seqs, norm_length=norm_length,
    )
    metrics: Metrics = {
        "actor/ppo_kl": masked_mean(-x.log_ratio, x.mask),
        "actor/ratio_mean": masked_mean(ratio, x.mask),
        "actor/ratio_max": masked_max(ratio, x.mask),
    }
    return loss, metrics


def metrics_to_floats(metrics: dict, *, drop_nonfinite: bool = False) -> dict[str, float]:
    """Convert a metrics dict of 0-d tensors / numbers to Python floats with a single host sync (the package's one
    metric-to-float conversion); ``drop_nonfinite``: leave out NaN / Inf values (and ``None``)."""
    metrics = {k: v for k, v in metrics.items() if v is not None}
    keys = [k for k, v in metrics.items() if isinstance(v, torch.Tensor)]
    out = {k: float(v) for k, v in metrics.items() if not isinstance(v, torch.Tensor)}
    if keys:
        ts = [metrics[k].detach().to(torch.float64).reshape(()) for k in keys]
        if len({t.device for t in ts}) > 1:
            ts = [t.cpu() for t in ts]
        vals = torch.stack(ts).tolist()
        out.update(zip(keys, vals))
    return {k: out[k] for k in metrics if not drop_nonfinite or math.isfinite(out[k])}


__all__ = [
    "grpo_loss", "gspo_loss", "unclipped_loss", "metrics_to_floats", "check_grpo_options", "check_gspo_options",
    "GRPO_CLIP", "GSPO_CLIP",
]
