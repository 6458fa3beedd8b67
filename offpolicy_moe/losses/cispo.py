"""CISPO: clipped importance-sampling-weight policy optimisation (MiniMax-M1, arXiv 2506.13585).

PPO clips the ratio inside the surrogate, so a clipped token gets no gradient at all.  CISPO clips
the importance WEIGHT instead and stops its gradient, then multiplies it onto the REINFORCE term:
every valid token keeps the gradient ``sg[clip(r)] * A * grad logp``.
"""
from __future__ import annotations

from typing import Optional

import torch

from ._common import Metrics, apply_weights, frac, masked_max, masked_mean, prepare
from .aggregation import Count, aggregate
from .option_checks import check_cispo_options
from .reference import reference_cispo
from .registry import register_builtin_loss

CISPO_CLIP_HIGH = 4.0
"""Default ``clip_high``: the weight is capped at ``1 + 4 = 5`` (our default; the paper tunes only the upper bound)."""




@register_builtin_loss("cispo", reference=reference_cispo)
def cispo_loss(
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
    """CISPO objective (MiniMax-M1, arXiv 2506.13585, eq. 4-5).

    ``r = exp(clamp(logp - old_logp, +-b))``, ``w = sg[clip(r, 1 - clip_low, 1 + clip_high)]`` and per token
    ``l = -w A logp`` (times ``weights``): ``grad l = -w A grad logp`` on EVERY valid token, clipped or not.
    ``clip_low=None`` (default): no lower bound, as in the paper; ``clip_high`` 4 (weight cap 5).  Default
    aggregation ``token-mean`` (the paper normalises by the batch's token count).

    Metrics: ``actor/clipfrac`` (weight clipped), ``actor/clipfrac_low`` (r < 1 - clip_low), ``actor/clipfrac_high``
    (r > 1 + clip_high), ``actor/ppo_kl``, ``actor/ratio_mean``, ``actor/ratio_max``.
    """
    agg = "token-mean" if agg is None else agg
    check_cispo_options(clip_low, clip_high)
    hi = 1.0 + float(CISPO_CLIP_HIGH if clip_high is None else clip_high)
    lo = None if clip_low is None else 1.0 - float(clip_low)
    x = prepare(logp, old_logp, advantages, mask, weights, agg,
                num_tokens=num_tokens, num_seqs=num_seqs, norm_length=norm_length)
    ratio = torch.exp(x.log_ratio.detach())
    w = ratio.clamp(min=lo, max=hi)
    loss_mat = -(w * x.adv) * x.logp
    loss = aggregate(
        apply_weights(loss_mat, x.weights), x.mask, agg,
        num_tokens=num_tokens, num_seqs=num_seqs, norm_length=norm_length,
    )
    high = ratio > hi
    low = ratio < lo if lo is not None else torch.zeros_like(x.mask)
    metrics: Metrics = {
        "actor/clipfrac": frac(low | high, x.mask),
        "actor/clipfrac_low": frac(low, x.mask),
        "actor/clipfrac_high": frac(high, x.mask),
        "actor/ppo_kl": masked_mean(-x.log_ratio, x.mask),
        "actor/ratio_mean": masked_mean(ratio, x.mask),
        "actor/ratio_max": masked_max(ratio, x.mask),
    }
    return loss, metrics


__all__ = ["cispo_loss", "check_cispo_options", "CISPO_CLIP_HIGH"]
