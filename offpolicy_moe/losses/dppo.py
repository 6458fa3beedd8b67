"""DPPO: divergence proximal policy optimisation (Qi et al. 2026, "Rethinking the Trust Region in LLM
Reinforcement Learning", arXiv 2602.04879).

PPO's clip bounds the probability RATIO of the sampled token, a one-sample estimate of the policy divergence
that over-penalises rare tokens and under-penalises frequent ones.  DPPO masks a token instead when a direct
estimate of the divergence between ``pi_old`` and ``pi`` at that position leaves the trust region in the
direction the advantage pushes.  The binary approximations compare the two Bernoulli distributions "this token
or another": total variation ``|p - p_old|`` (``dppo_tv``) or KL ``KL(Ber(p_old) || Ber(p))`` (``dppo_kl``).
Kept tokens carry the plain importance-weighted policy gradient ``-A r`` (no clip).
"""
from __future__ import annotations

from typing import Optional

import torch

from ._closed_form import count_valid, finish_lean, prepare_lean, share
from ._common import Metrics
from .aggregation import Count
from .option_checks import check_dppo_options
from .reference import dppo_keep, reference_dppo_kl, reference_dppo_tv
from .registry import register_builtin_loss

DPPO_DELTA = (0.2, 0.2)
"""Default ``(delta_low, delta_high)``: verl's ``clip_ratio`` default and prime-rl's ``dppo_mask_{low,high}``."""




def _dppo(kind, logp, old_logp, advantages, mask, agg, weights, counts, delta_low, delta_high, ratio_cap):
    agg = "token-mean" if agg is None else agg
    check_dppo_options(delta_low, delta_high, ratio_cap)
    lo = float(DPPO_DELTA[0] if delta_low is None else delta_low)
    hi = float(DPPO_DELTA[1] if delta_high is None else delta_high)
    x = prepare_lean(logp, old_logp, advantages, mask, weights, agg, **counts)
    zero = torch.zeros((), dtype=x.raw.dtype, device=x.raw.device)
    with torch.no_grad():
        keep = dppo_keep(kind, logp.detach().to(x.raw.dtype), old_logp.detach().to(x.raw.dtype), x.adv, lo, hi)
        ratio = torch.exp(x.log_ratio)
        capped = ratio if ratio_cap is None else ratio.clamp(max=float(ratio_cap))
        # l = -M A sg[min(r, c) / r] r: value -M A min(r, c), d l / d logp = -M A min(r, c) inside the clamp
        loss_tok = torch.where(keep, -x.adv * capped, zero)
        coef = torch.where(keep & (x.log_ratio == x.raw), -x.adv * capped, zero)
    loss = finish_lean(x, logp, loss_tok, coef, agg, inputs=(old_logp, advantages, mask, weights), **counts)
    with torch.no_grad():
        n = x.n_valid
        dropped = ~keep
        pushed_up = (x.adv > 0).expand_as(keep) if x.adv.shape != keep.shape else x.adv > 0
        metrics: Metrics = {
            "actor/clipfrac": share(count_valid(dropped, x.mask), n),
            "actor/clipfrac_low": share(count_valid(dropped & ~pushed_up, x.mask), n),
            "actor/clipfrac_high": share(count_valid(dropped & pushed_up, x.mask), n),
            "dppo/capped_frac": share(count_valid(keep & (ratio != capped), x.mask), n),
            "actor/ppo_kl": (-x.log_ratio.sum() / n.clamp(min=1)).to(torch.float32),
            "actor/ratio_mean": (torch.where(x.mask, ratio, zero).sum() / n.clamp(min=1)).to(torch.float32),
        }
    return loss, metrics


@register_builtin_loss("dppo_tv", reference=reference_dppo_tv)
def dppo_tv_loss(
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
    delta_low: Optional[float] = None,
    delta_high: Optional[float] = None,
    ratio_cap: Optional[float] = None,
) -> tuple[torch.Tensor, Metrics]:
    """DPPO-Binary-TV (arXiv 2602.04879): a total-variation trust region on the sampled token.

    With ``p = exp(logp)``, ``p_old = exp(old_logp)`` and ``r = exp(clamp(logp - old_logp, +-b))``, a valid token is
    kept (``M = 1``) unless ``A > 0 and p - p_old > delta_high`` or ``A <= 0 and p - p_old < -delta_low``.  Per token
    ``l = -M A r`` (gradient ``-M A r grad logp``), times ``weights``, then :func:`aggregate` (default ``token-mean``).
    Defaults ``delta_low = delta_high = 0.2``.  ``ratio_cap = c`` (verl's ``clip_ratio_c``; off by default, as in the
    paper) truncates the weight: ``l = -M A sg[min(r, c) / r] r``, verl's ``-A sg[min(r, c)] logp`` gradient.

    Metrics: ``actor/clipfrac`` (masked share of valid tokens), ``actor/clipfrac_low`` / ``_high`` (masked
    with ``A <= 0`` / ``A > 0``), ``dppo/capped_frac``, ``actor/ppo_kl``, ``actor/ratio_mean``.
    """
    counts = dict(num_tokens=num_tokens, num_seqs=num_seqs, norm_length=norm_length)
    return _dppo("tv", logp, old_logp, advantages, mask, agg, weights, counts, delta_low, delta_high, ratio_cap)


@register_builtin_loss("dppo_kl", reference=reference_dppo_kl)
def dppo_kl_loss(
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
    delta_low: Optional[float] = None,
    delta_high: Optional[float] = None,
    ratio_cap: Optional[float] = None,
) -> tuple[torch.Tensor, Metrics]:
    """DPPO-Binary-KL (arXiv 2602.04879): a KL trust region on the sampled token.

    ``D = p_old log(p_old / p) + (1 - p_old) log((1 - p_old) / (1 - p))``, the KL between "this token or another" under
    ``pi_old`` and ``pi`` (``0 log 0 = 0``; ``log1p(-exp(.))``, no epsilon: verl's ``1e-8`` matters only within
    about ``1e-8`` of 1).  A valid token is masked when ``A > 0 and p > p_old and D > delta_high`` or ``A <= 0 and
    p < p_old and D > delta_low``.  The loss, ``ratio_cap``, defaults and metrics are those of :func:`dppo_tv_loss`.
    """
    counts = dict(num_tokens=num_tokens, num_seqs=num_seqs, norm_length=norm_length)
    return _dppo("kl", logp, old_logp, advantages, mask, agg, weights, counts, delta_low, delta_high, ratio_cap)


__all__ = ["dppo_tv_loss", "dppo_kl_loss", "check_dppo_options", "DPPO_DELTA"]
