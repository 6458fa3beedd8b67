"""Train/inference mismatch: correction weights (TIS, MIS, IcePop) and mismatch metrics.

TIS: Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training"
(truncated importance sampling); MIS: masked importance sampling (Liu, Li et al. 2025, "When Speed
Kills Stability"); IcePop: arXiv 2510.18855 (token mask outside [0.5, 5]).
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from ._common import Metrics, frac, masked_max, masked_mean, masked_min
from ._validate import (
    as_bool_mask,
    check_2d,
    check_choice,
    check_float,
    check_nonneg,
    check_same_shape,
    check_tensor,
    check_values,
    clamp_log_ratio,
    ratio_bound,
)

LEVELS = ("token", "sequence", "geometric")
MODES = ("truncate", "mask")


def _check_pair(name_a: str, a: torch.Tensor, name_b: str, b: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    for n, t in ((name_a, a), (name_b, b), ("mask", mask)):
        check_tensor(n, t)
    check_2d(name_a, a)
    check_float(name_a, a)
    check_same_shape(name_a, a, name_b, b)
    check_same_shape(name_a, a, "mask", mask)
    check_values(mask, [(name_a, a), (name_b, b)])
    return as_bool_mask(mask)


def correction_weights(
    old_logp: torch.Tensor,
    behav_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    level: str = "token",
    mode: str = "truncate",
    high: float = 2.0,
    low: Optional[float] = None,
) -> tuple[torch.Tensor, Metrics]:
    """Detached per-token weights [B, T] from ``rho = exp(old_logp - behav_logp)``.

    Level (log rho summed over valid tokens only, clamped to +-20 before ``exp``; to
    :func:`ratio_bound` of the dtype for float16, whose weights must fit it):

    * ``token``: ``rho_t``
    * ``sequence``: ``prod_t rho_t = exp(sum_t log rho_t)``, broadcast over the sequence
    * ``geometric``: ``exp(mean_t log rho_t)``, broadcast over the sequence

    Mode: ``truncate`` (TIS) ``w = min(rho, high)`` and ``max(w, low)`` if ``low`` is given;
    ``mask`` (MIS / IcePop) ``w = rho if low <= rho <= high else 0`` (``low=None`` means no lower
    bound; IcePop uses ``low=0.5, high=5``).  Weights are 0 at masked positions.

    Metrics (detached float32 0-d tensors over valid tokens): ``mismatch/is_mean``,
    ``mismatch/is_max``, ``mismatch/is_min`` (of the weights), ``mismatch/clipped_frac``
    (truncate) or ``mismatch/masked_frac`` (mask), ``mismatch/ess`` = ``(sum w)^2 / (N sum w^2)``.
    """
    m = _check_pair("old_logp", old_logp, "behav_logp", behav_logp, mask)
    check_choice("level", level, LEVELS)
    check_choice("mode", mode, MODES)
    check_nonneg("high", high)
    check_nonneg("low", low)
    if high <= 0:
        raise ValueError(f"high must be > 0, got {high!r}")
    if low is not None and low > high:
        raise ValueError(f"low ({low!r}) must not exceed high ({high!r})")
    dtype = torch.promote_types(old_logp.dtype, torch.float32)
    zero = torch.zeros((), dtype=dtype, device=old_logp.device)
    log_rho = torch.where(m, old_logp.detach().to(dtype) - behav_logp.detach().to(dtype), zero)
    if level == "token":
        lw = log_rho
    else:
        total = log_rho.sum(-1, keepdim=True)
        if level == "geometric":
            total = total / m.sum(-1, keepdim=True).clamp(min=1).to(dtype)
        lw = total.expand_as(log_rho)
    rho = torch.exp(clamp_log_ratio(lw, ratio_bound(old_logp.dtype)))
    too_high = rho > high
    too_low = rho < low if low is not None else torch.zeros_like(m)
    if mode == "truncate":
        w = rho.clamp(max=high) if low is None else rho.clamp(min=low, max=high)
        changed_key, changed = "mismatch/clipped_frac", too_high | too_low
    else:
        outside = too_high | too_low
        w = torch.where(outside, zero, rho)
        changed_key, changed = "mismatch/masked_frac", outside
    w = torch.where(m, w, zero).to(old_logp.dtype if torch.is_floating_point(old_logp) else dtype)
    wd = w.to(torch.float64)
    s1 = wd.sum()
    s2 = (wd * wd).sum()
    n = m.sum().to(torch.float64)
    ess = torch.where(s2 > 0, s1 * s1 / (n.clamp(min=1) * s2.clamp(min=torch.finfo(torch.float64).tiny)), torch.zeros_like(s1))
    metrics: Metrics = {
        "mismatch/is_mean": masked_mean(w, m),
        "mismatch/is_max": masked_max(w, m),
        "mismatch/is_min": masked_min(w, m),
        changed_key: frac(changed, m),
        "mismatch/ess": ess.to(torch.float32),
    }
    return w.detach(), metrics


def mismatch_metrics(train_logp: torch.Tensor, infer_logp: torch.Tensor, mask: torch.Tensor) -> Metrics:
    """How far the trainer's log-probs are from the inference engine's on the sampled tokens.

    With ``d = clamp(train_logp - infer_logp, +-20)`` and ``rho' = exp(d) = pi_train / pi_infer``
    (all means over valid tokens, detached float32 0-d tensors):

    * ``mismatch/k3_kl``: ``mean(rho' - 1 - d)``, the k3 estimate of KL(pi_infer || pi_train)
      (Schulman 2020, "Approximating KL divergence")
    * ``mismatch/k1_kl``: ``mean(-d)``
    * ``mismatch/extreme_frac``: F(2), the fraction of tokens with ``max(rho', 1/rho') > 2``
    * ``mismatch/ratio_mean``, ``mismatch/ratio_max``, ``mismatch/ratio_min``,
      ``mismatch/abs_log_ratio_mean``
    """
    m = _check_pair("train_logp", train_logp, "infer_logp", infer_logp, mask)
    dtype = torch.promote_types(train_logp.dtype, torch.float32)
    zero = torch.zeros((), dtype=dtype, device=train_logp.device)
    d = clamp_log_ratio(torch.where(m, train_logp.detach().to(dtype) - infer_logp.detach().to(dtype), zero))
    ratio = torch.exp(d)
    return {
        "mismatch/k3_kl": masked_mean(ratio - 1.0 - d, m),
        "mismatch/k1_kl": masked_mean(-d, m),
        "mismatch/extreme_frac": frac(d.abs() > math.log(2.0), m),
        "mismatch/ratio_mean": masked_mean(ratio, m),
        "mismatch/ratio_max": masked_max(ratio, m),
        "mismatch/ratio_min": masked_min(ratio, m),
        "mismatch/abs_log_ratio_mean": masked_mean(d.abs(), m),
    }


__all__ = ["correction_weights", "mismatch_metrics", "LEVELS", "MODES"]
