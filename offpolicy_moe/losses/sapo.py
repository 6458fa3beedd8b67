"""SAPO: soft adaptive policy optimisation (Gao et al. 2025, Qwen team, arXiv 2511.20347).

PPO's hard clip zeroes a token's gradient the moment its ratio leaves the band.  SAPO replaces the clip
with a smooth gate ``f(r) = (4 / tau) sigmoid(tau (r - 1))``: at ``r = 1`` its slope is 1 (the on-policy
gradient), and the gradient fades smoothly as the ratio moves away, with a sharper fade (larger ``tau``)
for negative advantages, whose updates spread probability over the whole vocabulary.
"""
from __future__ import annotations

from typing import Optional

import torch

from ._closed_form import finish_lean, prepare_lean
from ._common import Metrics
from .aggregation import Count
from .option_checks import check_sapo_options
from .reference import reference_sapo
from .registry import register_builtin_loss




@register_builtin_loss("sapo", reference=reference_sapo)
def sapo_loss(
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
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
) -> tuple[torch.Tensor, Metrics]:
    """SAPO objective (arXiv 2511.20347): ``l = -A (4 / tau) sigmoid(tau (r - 1))``.

    ``r = exp(clamp(logp - old_logp, +-b))``; ``tau = tau_pos`` where ``A > 0``, else ``tau_neg`` (defaults 1.0 / 1.05,
    the paper's, verl's and TRL's).  Gradient ``-A 4 s (1 - s) r grad logp`` with ``s = sigmoid(tau (r - 1))``:
    exactly ``-A grad logp`` at ``r = 1``.  Times ``weights``; default ``agg`` ``seq-mean-token-mean`` (the paper's
    and TRL's; verl always uses it for SAPO).

    Metrics: ``sapo/grad_scale_mean`` (mean of ``4 s (1 - s)``; 1 on-policy), ``actor/ppo_kl``, ``actor/ratio_mean``.
    """
    agg = "seq-mean-token-mean" if agg is None else agg
    check_sapo_options(tau_pos, tau_neg)
    counts = dict(num_tokens=num_tokens, num_seqs=num_seqs, norm_length=norm_length)
    x = prepare_lean(logp, old_logp, advantages, mask, weights, agg, **counts)
    zero = torch.zeros((), dtype=x.raw.dtype, device=x.raw.device)
    with torch.no_grad():
        ratio = torch.exp(x.log_ratio)
        tau = torch.where(x.adv > 0, torch.full_like(x.adv, float(tau_pos)), torch.full_like(x.adv, float(tau_neg)))
        z = tau * (ratio - 1.0)
        s, s_neg = torch.sigmoid(z), torch.sigmoid(-z)      # s (1 - s) without cancellation
        loss_tok = -x.adv * s * (4.0 / tau)
        scale = 4.0 * s * s_neg
        coef = torch.where(x.log_ratio == x.raw, -x.adv * scale * ratio, zero)
    loss = finish_lean(x, logp, loss_tok, coef, agg, inputs=(old_logp, advantages, mask, weights), **counts)
    with torch.no_grad():
        n = x.n_valid.clamp(min=1)
        scale_full = scale.expand_as(x.raw) if scale.shape != x.raw.shape else scale
        metrics: Metrics = {
            "sapo/grad_scale_mean": (torch.where(x.mask, scale_full, zero).sum() / n).to(torch.float32),
            "actor/ppo_kl": (-x.log_ratio.sum() / n).to(torch.float32),
            "actor/ratio_mean": (torch.where(x.mask, ratio, zero).sum() / n).to(torch.float32),
        }
    return loss, metrics


__all__ = ["sapo_loss", "check_sapo_options"]
