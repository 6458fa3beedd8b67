"""VESPO: variational sequence-level soft policy optimisation (Shen et al. 2026, arXiv 2602.10693).

Naive sequence-level importance sampling is unbiased but its weight ``w = prod_t pi / mu`` explodes with
length and staleness; token clipping and length normalisation (GSPO) trade that variance for bias by
heuristics.  VESPO derives, from a variational problem with a variance budget, a closed-form reshaping
kernel on the UNnormalised sequence weight: the REINFORCE coefficient becomes ``phi(w) A`` with the gamma
kernel ``phi(w) = w^k exp(lambda (1 - w))`` (``phi(1) = 1``), which vanishes both for ``w -> 0`` and for
``w -> inf``, with separate shapes for positive and negative advantages.  It claims stable training at 64x
staleness and fully asynchronously, on dense and MoE models.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from ._closed_form import finish_lean, prepare_lean
from ._common import Metrics, masked_mean
from .aggregation import Count
from .option_checks import check_vespo_options
from .reference import reference_vespo, vespo_log_w, vespo_phi
from .registry import register_builtin_loss

VESPO_SHAPE = {"k_pos": 2.0, "lambda_pos": 3.0, "k_neg": 3.0, "lambda_neg": 2.0}
"""Default kernel shapes (TRL 1.16's ``vespo_*`` defaults, from the VESPO code release)."""




@register_builtin_loss("vespo", reference=reference_vespo)
def vespo_loss(
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
    k_pos: float = 2.0,
    lambda_pos: float = 3.0,
    k_neg: float = 3.0,
    lambda_neg: float = 2.0,
    fold_weights: bool = True,
) -> tuple[torch.Tensor, Metrics]:
    """VESPO objective (arXiv 2602.10693): per token ``l = -sg[phi(w_i)] A logp``, gradient ``-phi A grad logp``.

    ``log w_i = sum_t m clamp(logp - old_logp, +-20)`` (a SUM: no length normalisation).  With ``fold_weights=True``
    (default, the paper's ``w = pi / mu`` and TRL's) ``log w_i += sum_t m clamp(log weights_t, log 1e-8, 20)`` and the
    correction weights do NOT multiply the loss; this assumes token-level weights (a sequence-level weight would be
    counted once per token).  ``fold_weights=False`` multiplies ``weights`` onto the token loss.  Then ``log w`` is
    clamped to ``[log 1e-8, 20]`` and ``phi = exp(lambda + k log w - lambda w)`` with ``(k, lambda) = (k_pos,
    lambda_pos)`` where ``A >= 0``, else ``(k_neg, lambda_neg)``.  Default ``agg`` ``token-mean`` (TRL's).

    Metrics: ``vespo/phi_mean`` (over valid tokens), ``vespo/log_w_mean`` (over non-empty rows, before the clamp),
    ``actor/ppo_kl``.
    """
    agg = "token-mean" if agg is None else agg
    check_vespo_options(k_pos, lambda_pos, k_neg, lambda_neg, fold_weights)
    counts = dict(num_tokens=num_tokens, num_seqs=num_seqs, norm_length=norm_length)
    x = prepare_lean(logp, old_logp, advantages, mask, weights, agg, **counts)
    zero = torch.zeros((), dtype=x.raw.dtype, device=x.raw.device)
    with torch.no_grad():
        log_w = vespo_log_w(x.raw.clamp(-20.0, 20.0), x.mask, x.weights if fold_weights else None)
        phi = vespo_phi(log_w, x.adv, float(k_pos), float(lambda_pos), float(k_neg), float(lambda_neg))
        lp = torch.where(x.mask, logp.detach().to(x.raw.dtype), zero)
        coef = -phi * x.adv
        loss_tok = coef * lp
        coef = coef.expand_as(x.raw) if coef.shape != x.raw.shape else coef
    lean = dataclasses.replace(x, weights=None) if fold_weights else x
    loss = finish_lean(lean, logp, loss_tok, coef, agg, inputs=(old_logp, advantages, mask, weights), **counts)
    with torch.no_grad():
        has_tok = x.mask.any(-1)
        phi_full = phi.expand_as(x.raw) if phi.shape != x.raw.shape else phi
        metrics: Metrics = {
            "vespo/phi_mean": masked_mean(phi_full, x.mask),
            "vespo/log_w_mean": masked_mean(log_w.squeeze(-1), has_tok),
            "actor/ppo_kl": (-x.log_ratio.sum() / x.n_valid.clamp(min=1)).to(torch.float32),
        }
    return loss, metrics


__all__ = ["vespo_loss", "check_vespo_options", "VESPO_SHAPE"]
