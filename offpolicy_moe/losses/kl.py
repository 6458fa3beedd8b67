"""Per-token estimators of KL(pi_theta || pi_ref) for an optional reference-KL penalty.

Estimators from J. Schulman, "Approximating KL divergence" (2020, blog note).  The straight-through
"k3+" keeps k3's low-variance value for logging but uses k2's gradient, ``d * grad logp``, which is
the on-policy estimate of the gradient of KL(pi_theta || pi_ref); k3's own gradient is not.
"""
from __future__ import annotations

from typing import Optional

import torch

from ._validate import (
    as_bool_mask,
    check_choice,
    check_float,
    check_same_shape,
    check_tensor,
    check_values,
    clamp_log_ratio,
    compute_dtype,
    ratio_bound,
)
from .vocabulary import KL_KINDS


def kl_penalty(
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    kind: str = "k3",
    *,
    mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Per-token KL estimate (same shape as ``logp``); ``ref_logp`` is treated as a constant.

    With ``d = logp - ref_logp``:
    ``k1 = d``; ``k2 = d^2 / 2``; ``k3 = exp(-d') + d' - 1`` with ``d' = clamp(d, +-20)``;
    ``k3+ = k2 - sg[k2] + sg[k3]`` (value k3, gradient k2).  With ``mask``, masked positions are 0.
    Half-precision inputs are computed (and returned) in float32, with ``d'`` clamped to
    :func:`ratio_bound` of the input dtype.
    """
    check_tensor("logp", logp)
    check_tensor("ref_logp", ref_logp)
    check_float("logp", logp)
    check_same_shape("logp", logp, "ref_logp", ref_logp)
    check_choice("kind", kind, KL_KINDS)
    if mask is not None:
        check_tensor("mask", mask)
        check_same_shape("logp", logp, "mask", mask)
        check_values(mask, [("logp", logp), ("ref_logp", ref_logp)])
        m = as_bool_mask(mask)
        dtype = compute_dtype(logp.dtype)
        zero = torch.zeros((), dtype=dtype, device=logp.device)
        d = torch.where(m, logp.to(dtype) - ref_logp.detach().to(dtype), zero)
    else:
        dtype = compute_dtype(logp.dtype)
        d = logp.to(dtype) - ref_logp.detach().to(dtype)
    if kind == "k1":
        return d
    k2 = 0.5 * d * d
    if kind == "k2":
        return k2
    dc = clamp_log_ratio(d, ratio_bound(logp.dtype))
    k3 = torch.exp(-dc) + dc - 1.0
    if kind == "k3":
        return k3
    return k2 - k2.detach() + k3.detach()


__all__ = ["kl_penalty", "KL_KINDS"]
