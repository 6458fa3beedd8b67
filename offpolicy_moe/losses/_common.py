"""Shared preprocessing for the policy objectives: checks, masking, log-space ratios."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ._validate import (
    MASK_MESSAGE,
    FusedCheck,
    as_bool_mask,
    check_objective_args,
    clamp_log_ratio,
    compute_dtype,
    mask_is_binary,
    ratio_bound,
    value_checks_enabled,
)

Metrics = dict[str, torch.Tensor]


@dataclass
class PolicyInputs:
    """Checked, masked inputs of a policy objective (all [B, T], in the compute dtype)."""

    logp: torch.Tensor          # with gradient; 0 at masked positions
    raw_log_ratio: torch.Tensor  # logp - sg[old_logp], 0 at masked positions, NOT clamped (has gradient)
    log_ratio: torch.Tensor     # raw_log_ratio clamped to +-bound (has gradient inside the bound)
    adv: torch.Tensor           # detached, 0 at masked positions
    mask: torch.Tensor          # bool
    weights: Optional[torch.Tensor]  # detached, 0 at masked positions, or None
    bound: float                # the log-ratio clamp, ratio_bound(input dtype)


def prepare(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    weights: Optional[torch.Tensor],
    agg: str,
    *,
    num_tokens: object = None,
    num_seqs: object = None,
    norm_length: Optional[float] = None,
    extra_checks: Sequence[tuple[str, torch.Tensor]] = (),
) -> PolicyInputs:
    """Validate the common arguments of every objective and build masked, log-space quantities.

    The value checks (:func:`check_values`, plus ``extra_checks``) cost ONE host sync; half-precision inputs are
    computed in float32 (see :func:`ratio_bound`).
    """
    adv = check_objective_args(logp, old_logp, advantages, mask, weights, agg, num_tokens, num_seqs, norm_length)
    m = as_bool_mask(mask)
    dtype = compute_dtype(logp.dtype)
    zero = torch.zeros((), dtype=dtype, device=logp.device)
    lp = torch.where(m, logp.to(dtype), zero)
    raw = torch.where(m, lp - old_logp.detach().to(dtype), zero)
    a = torch.where(m, adv.detach().to(dtype), zero)
    w = None if weights is None else torch.where(m, weights.detach().to(dtype), zero)
    if value_checks_enabled():
        check = FusedCheck()
        binary = mask_is_binary(mask)
        if binary is not None:
            check.holds(MASK_MESSAGE.format(dtype=mask.dtype), binary)
        check.finite("logp contains NaN or Inf at a valid (mask=1) position", lp)
        check.finite("old_logp contains NaN or Inf at a valid (mask=1) position", raw)
        check.finite("advantages contains NaN or Inf at a valid (mask=1) position", a)
        check.finite("weights contains NaN or Inf at a valid (mask=1) position", w)
        for name, c in (("num_tokens", num_tokens), ("num_seqs", num_seqs)):
            if isinstance(c, torch.Tensor):
                check.holds(f"{name} must be a finite number >= 0 (got a NaN, Inf or negative tensor)",
                            (c.detach().double() >= 0).all() & torch.isfinite(c.detach().double()).all())
        for message, ok in extra_checks:
            check.holds(message, ok)
        check.run()
    bound = ratio_bound(logp.dtype)
    return PolicyInputs(lp, raw, clamp_log_ratio(raw, bound), a, m, w, bound)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Detached mean of ``x`` over ``mask`` (summed in at least float32); 0 when nothing is valid."""
    x = x.detach().to(compute_dtype(x.dtype))
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
