"""GMPO: geometric-mean policy optimisation (Zhao et al. 2025, arXiv 2507.20673; ICLR 2026).

GRPO maximises the ARITHMETIC mean over a sequence's tokens of ``clip(r_t) A``; one outlier ratio then
dominates the update.  GMPO maximises the GEOMETRIC mean of the clipped token ratios,
``A_i prod_t clip(r_t)^(1/|o_i|)``, which an outlier moves far less, and so tolerates a wider clip range:
``(exp(-0.4), exp(0.4))`` in the paper against GRPO's ``(0.8, 1.2)``.  Clipping is per token, in log
space and one-sided by the sign of the advantage (the PPO trust region), before the mean is taken.
"""
from __future__ import annotations

from typing import Optional

import torch

from ._closed_form import count_valid, finish_lean, prepare_lean, share
from ._common import Metrics, masked_mean
from .aggregation import Count
from .option_checks import check_gmpo_options
from .reference import reference_gmpo
from .registry import register_builtin_loss

GMPO_CLIP = (0.4, 0.4)
"""Default log-space ``(clip_low, clip_high)``: the paper's ``(exp(-0.4), exp(0.4))`` (verl uses its
``clip_ratio`` default 0.2)."""




@register_builtin_loss("gmpo", reference=reference_gmpo)
def gmpo_loss(
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
    """GMPO objective (arXiv 2507.20673, eq. 4), sequence loss ``-A_i R_i`` with
    ``log R_i = mean_t c_t``, ``c_t = sgn(A_i) min(sgn(A_i) log r_t, sgn(A_i) clip(log r_t, -clip_low, clip_high))``.

    ``A_i`` is the masked mean of ``advantages`` over row i (as in verl); ``mean_t c_t`` is clamped to ``+-b``
    before ``exp``.  Defaults ``clip_low = clip_high = 0.4`` (log space).  Token form: every valid token of row i
    carries ``l = -A_i R_i`` with gradient ``-A_i R_i u_t`` (``u_t = 1`` where ``c_t`` is not clipped), so the
    default ``agg="seq-mean-token-mean"`` gives exactly the paper's ``mean_i -A_i R_i``.  ``weights`` multiply the
    token loss (verl folds token weights in as a geometric mean, which agrees for the sequence-level corrections).

    Metrics: ``actor/clipfrac`` (tokens whose ``c_t`` is clipped), ``actor/clipfrac_low`` (``A < 0``),
    ``actor/clipfrac_high`` (``A > 0``), ``gmpo/seq_ratio_mean`` (mean ``R_i`` over non-empty rows),
    ``actor/ppo_kl``.
    """
    agg = "seq-mean-token-mean" if agg is None else agg
    check_gmpo_options(clip_low, clip_high)
    lo = float(GMPO_CLIP[0] if clip_low is None else clip_low)
    hi = float(GMPO_CLIP[1] if clip_high is None else clip_high)
    counts = dict(num_tokens=num_tokens, num_seqs=num_seqs, norm_length=norm_length)
    x = prepare_lean(logp, old_logp, advantages, mask, weights, agg, **counts)
    zero = torch.zeros((), dtype=x.raw.dtype, device=x.raw.device)
    with torch.no_grad():
        n_tok = x.mask.sum(-1, keepdim=True)
        n = n_tok.clamp(min=1).to(x.raw.dtype)
        adv = torch.where(x.mask, x.adv.expand_as(x.raw), zero)
        a_seq = adv.sum(-1, keepdim=True) / n                       # [B, 1]
        clipped_high = (a_seq > 0) & (x.raw > hi)
        clipped_low = (a_seq < 0) & (x.raw < -lo)
        c = torch.where(clipped_high, torch.full_like(x.raw, hi),
                        torch.where(clipped_low, torch.full_like(x.raw, -lo), x.raw))
        mean_log = torch.where(x.mask, c, zero).sum(-1, keepdim=True) / n
        inside = mean_log.abs() <= x.bound
        seq_r = torch.exp(mean_log.clamp(-x.bound, x.bound))
        loss_tok = (-a_seq * seq_r).expand_as(x.raw)
        flows = ~(clipped_high | clipped_low) & inside
        coef = torch.where(flows, -a_seq * seq_r, zero)
    loss = finish_lean(x, logp, loss_tok, coef, agg, inputs=(old_logp, advantages, mask, weights), **counts)
    with torch.no_grad():
        nv = x.n_valid
        has_tok = (n_tok > 0).squeeze(-1)
        metrics: Metrics = {
            "actor/clipfrac": share(count_valid(clipped_high | clipped_low, x.mask), nv),
            "actor/clipfrac_low": share(count_valid(clipped_low, x.mask), nv),
            "actor/clipfrac_high": share(count_valid(clipped_high, x.mask), nv),
            "gmpo/seq_ratio_mean": masked_mean(seq_r.squeeze(-1), has_tok),
            "actor/ppo_kl": (-x.log_ratio.sum() / nv.clamp(min=1)).to(torch.float32),
        }
    return loss, metrics


__all__ = ["gmpo_loss", "check_gmpo_options", "GMPO_CLIP"]
