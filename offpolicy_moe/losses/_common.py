"""Shared preprocessing for the policy objectives: checks, masking, log-space ratios."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ._validate import (
    as_bool_mask,
    check_2d,
    check_advantages,
    check_agg,
    check_float,
    check_same_shape,
    check_tensor,
    check_values,
    clamp_log_ratio,
)

Metrics = dict[str, torch.Tensor]


@dataclass
class PolicyInputs:
    """Checked, masked inputs of a policy objective (all [B, T])."""

    logp: torch.Tensor          # with gradient; 0 at masked positions
    raw_log_ratio: torch.Tensor  # logp - sg[old_logp], 0 at masked positions, NOT clamped (has gradient)
    log_ratio: torch.Tensor     # raw_log_ratio clamped to +-20 (has gradient inside the bound)
    adv: torch.Tensor           # detached, 0 at masked positions
    mask: torch.Tensor          # bool
    weights: Optional[torch.Tensor]  # detached, 0 at masked positions, or None


def prepare(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    weights: Optional[torch.Tensor],
    agg: str,
) -> PolicyInputs:
    """Validate the common arguments of every objective and build masked, log-space quantities."""
    for name, t in (("logp", logp), ("old_logp", old_logp), ("mask", mask)):
        check_tensor(name, t)
    check_2d("logp", logp)
    check_float("logp", logp)
    check_same_shape("logp", logp, "old_logp", old_logp)
    check_same_shape("logp", logp, "mask", mask)
    adv = check_advantages(advantages, logp.shape)
    if weights is not None:
        check_tensor("weights", weights)
        check_same_shape("logp", logp, "weights", weights)
    check_agg(agg)
    check_values(
        mask,
        [("logp", logp), ("old_logp", old_logp), ("advantages", advantages), ("weights", weights)],
    )
    m = as_bool_mask(mask)
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    lp = torch.where(m, logp, zero)
    raw = torch.where(m, logp - old_logp.detach().to(logp.dtype), zero)
    a = torch.where(m, adv.detach().to(logp.dtype), zero)
    w = None if weights is None else torch.where(m, weights.detach().to(logp.dtype), zero)
    return PolicyInputs(lp, raw, clamp_log_ratio(raw), a, m, w)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Detached mean of ``x`` over ``mask``; 0 when nothing is valid."""
    x = x.detach()
    s = torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device)).sum()
    return (s / mask.sum().clamp(min=1).to(x.dtype)).to(torch.float32)


def masked_max(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    x = x.detach()
    out = torch.where(mask, x, torch.full((), -torch.inf, dtype=x.dtype, device=x.device)).amax() if x.numel() else x.new_zeros(())
    return torch.where(mask.any(), out, torch.zeros_like(out)).to(torch.float32)


def masked_min(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    x = x.detach()
    out = torch.where(mask, x, torch.full((), torch.inf, dtype=x.dtype, device=x.device)).amin() if x.numel() else x.new_zeros(())
    return torch.where(mask.any(), out, torch.zeros_like(out)).to(torch.float32)


def frac(cond: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Fraction of valid tokens where ``cond`` holds (detached float32 0-d tensor)."""
    return ((cond & mask).sum().to(torch.float32) / mask.sum().clamp(min=1).to(torch.float32)).detach()


def apply_weights(loss_mat: torch.Tensor, weights: Optional[torch.Tensor]) -> torch.Tensor:
    return loss_mat if weights is None else loss_mat * weights


def check_clip(name: str, value: float) -> float:
    from ._validate import check_nonneg

    check_nonneg(name, value)
    return float(value)
