"""Importance-ratio diagnostics that every registered objective reports: M2 and the effective sample size.

Whatever its trust region (a clip, a mask, a gate, a kernel), every objective weighs token ``t`` by a function of the
same importance ratio ``r_t = pi_theta(y_t) / pi_old(y_t)``; these two numbers describe that ratio on the tokens the
objective saw, so that stale-data methods can be compared on the same footing.  The registry
(:func:`~offpolicy_moe.losses.registry.register_policy_loss`) adds both to the metrics of every loss.
"""
from __future__ import annotations

from typing import Mapping

import torch

from ._validate import as_bool_mask, clamp_log_ratio, compute_dtype, ratio_bound

RATIO_DIAGNOSTICS = ("actor/m2", "actor/ess")
"""The metric names :func:`ratio_diagnostics` returns."""


def ratio_diagnostics(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> Mapping[str, torch.Tensor]:
    """M2 and the normalised ESS of the token importance ratios (detached float32 0-d tensors, no host sync).

    With ``d_t = clamp(logp_t - old_logp_t, +-b)`` (``b`` = :func:`ratio_bound` of ``logp``'s dtype, the clamp every
    objective applies) over the N valid (``mask``) tokens:

    * ``actor/m2 = (1/N) sum_t d_t^2``, the statistic M2PO's Algorithm 1 bounds (arXiv 2510.01161; there over the
      trust-region tokens, here over all);
    * ``actor/ess = (sum_t e^{d_t})^2 / (N sum_t e^{2 d_t})`` (Kong 1992; Owen, "Monte Carlo theory, methods and
      examples", 2013, ch. 9), in ``[1/N, 1]``; computed with ``d_t - max_t d_t`` in the exponent (the ratio is
      invariant to a common factor of the weights), so it is finite for every finite input.

    No valid token gives ``M2 = 0`` and ``ESS = 1``.  Half-precision inputs are computed in float32.
    """
    with torch.no_grad():
        m = as_bool_mask(mask)
        dtype = compute_dtype(logp.dtype)
        zero = torch.zeros((), dtype=dtype, device=logp.device)
        d = clamp_log_ratio(logp.detach().to(dtype) - old_logp.detach().to(dtype), ratio_bound(logp.dtype))
        d = torch.where(m, d, zero)
        n = m.sum().to(dtype)
        m2 = (d * d).sum() / n.clamp(min=1)
        top = torch.where(m, d, torch.full((), -torch.inf, dtype=dtype, device=d.device)).amax() if d.numel() else zero
        top = torch.where(torch.isfinite(top), top, zero)
        w = torch.where(m, torch.exp(d - top), zero)      # in (0, 1]; the largest weight is exactly 1
        s1, s2 = w.sum(), (w * w).sum()
        ess = torch.where(n > 0, s1 * s1 / (n * s2).clamp(min=torch.finfo(dtype).tiny), torch.ones((), dtype=dtype,
                                                                                              device=d.device))
    return {"actor/m2": m2.to(torch.float32), "actor/ess": ess.to(torch.float32)}


__all__ = ["RATIO_DIAGNOSTICS", "ratio_diagnostics"]
