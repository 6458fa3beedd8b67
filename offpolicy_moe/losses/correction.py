"""Train/inference mismatch and staleness: correction weights (TIS, MIS, IcePop, OPSM) and mismatch metrics.

TIS: Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training"; MIS: Liu, Li et al.
2025, "When Speed Kills Stability"; IcePop: arXiv 2510.18855 (token mask outside [0.5, 5]); OPSM: DeepSeek-V3.2,
arXiv 2512.02556, eq. 9.

TRL 1.16's ``vllm_importance_sampling_mode`` ``{token,sequence}_{truncate,mask}`` is (level, mode) here, with
``vllm_importance_sampling_clip_max`` / ``_clip_min`` = ``high`` / ``low``; TRL's sequence ratio is a product like
our ``sequence`` level (not the geometric mean).  TRL's ``off_policy_mask_threshold`` is ``opsm_delta``.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from ._common import Metrics, frac, masked_max, masked_mean, masked_min
from ._validate import (
    as_bool_mask,
    check_2d,
    check_advantages,
    check_choice,
    check_float,
    check_nonneg,
    check_same_shape,
    check_tensor,
    check_values,
    clamp_log_ratio,
    ratio_bound,
)
from .vocabulary import CORRECTION_LEVELS, CORRECTION_MODES

LEVELS = CORRECTION_LEVELS
MODES = CORRECTION_MODES
OPSM_DELTA = 1e-4
"""Default OPSM threshold on the mean per-token KL (Miles' ``--opsm-delta`` default; TRL has none: off)."""


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
    advantages: Optional[torch.Tensor] = None,
    opsm_delta: Optional[float] = None,
) -> tuple[torch.Tensor, Metrics]:
    """Detached per-token weights [B, T] from ``rho = exp(old_logp - behav_logp)``.

    Level (log rho summed over valid tokens only, clamped to +-20 before ``exp``; to :func:`ratio_bound` of the
    dtype for float16): ``token`` ``rho_t``; ``sequence`` ``prod_t rho_t = exp(sum_t log rho_t)``; ``geometric``
    ``exp(mean_t log rho_t)``; the sequence levels broadcast over the sequence.

    Mode: ``truncate`` (TIS) ``w = min(rho, high)`` and ``max(w, low)`` if ``low`` is given; ``mask`` (MIS / IcePop)
    ``w = rho if low <= rho <= high else 0`` (``low=None``: no lower bound; IcePop uses ``low=0.5, high=5``);
    ``opsm``: ``w = O`` alone (``level``, ``high`` and ``low`` unused).  Weights are 0 at masked positions.

    OPSM (DeepSeek-V3.2, arXiv 2512.02556, eq. 9), as the mode or on top of truncate / mask with ``opsm_delta``:
    ``O = 0`` where ``A < 0`` and ``mean_t (behav_logp - old_logp) > delta`` (default :data:`OPSM_DELTA`), else 1;
    it needs ``advantages``.  The paper and TRL measure the KL against the policy being trained at this forward;
    here ``old_logp`` is the trainer's policy when the batch is consumed (identical with one optimiser step per batch).

    Metrics (over valid tokens): ``mismatch/is_mean``, ``mismatch/is_max``, ``mismatch/is_min`` (of the weights),
    ``mismatch/clipped_frac`` (truncate) or ``mismatch/masked_frac`` (mask, opsm), ``mismatch/ess`` =
    ``(sum w)^2 / (N sum w^2)``; with OPSM also ``mismatch/opsm_masked_frac`` and ``mismatch/opsm_seq_kl_mean``.
    """
    m = _check_pair("old_logp", old_logp, "behav_logp", behav_logp, mask)
    use_opsm = _check_options(old_logp, mask, level, mode, high, low, advantages, opsm_delta)
    dtype = torch.promote_types(old_logp.dtype, torch.float32)
    zero = torch.zeros((), dtype=dtype, device=old_logp.device)
    log_rho = torch.where(m, old_logp.detach().to(dtype) - behav_logp.detach().to(dtype), zero)
    rho = torch.exp(clamp_log_ratio(_level_log_ratio(log_rho, m, level), ratio_bound(old_logp.dtype)))
    if mode == "truncate":
        w, changed = _truncate_weights(rho, m, high, low)
        changed_key = "mismatch/clipped_frac"
    elif mode == "mask":
        w, changed = _mask_weights(rho, m, high, low, zero)
        changed_key = "mismatch/masked_frac"
    else:
        w, changed = torch.ones_like(rho), torch.zeros_like(m)
        changed_key = "mismatch/masked_frac"
    extra: Metrics = {}
    if use_opsm:
        w, changed, extra = _apply_opsm(w, changed, log_rho, advantages, m, opsm_delta, mode == "opsm", zero)
    w = torch.where(m, w, zero).to(old_logp.dtype if torch.is_floating_point(old_logp) else dtype)
    metrics: Metrics = {
        "mismatch/is_mean": masked_mean(w, m),
        "mismatch/is_max": masked_max(w, m),
        "mismatch/is_min": masked_min(w, m),
        changed_key: frac(changed, m),
        "mismatch/ess": _effective_sample_size(w, m),
        **extra,
    }
    return w.detach(), metrics


def _check_options(old_logp: torch.Tensor, mask: torch.Tensor, level: str, mode: str, high: float,
                   low: Optional[float], advantages: Optional[torch.Tensor], opsm_delta: Optional[float]) -> bool:
    """Check the options of :func:`correction_weights` before any compute; return whether OPSM applies."""
    check_choice("level", level, LEVELS)
    check_choice("mode", mode, MODES)
    check_nonneg("high", high)
    check_nonneg("low", low)
    check_nonneg("opsm_delta", opsm_delta)
    if high <= 0:
        raise ValueError(f"high must be > 0, got {high!r}")
    if low is not None and low > high:
        raise ValueError(f"low ({low!r}) must not exceed high ({high!r})")
    use_opsm = mode == "opsm" or opsm_delta is not None
    if use_opsm:
        if advantages is None:
            raise ValueError("OPSM (correction mode 'opsm' or opsm_delta) needs the advantages; pass advantages=")
        check_tensor("advantages", advantages)
        check_advantages(advantages, old_logp.shape, "old_logp")
        check_values(mask, [("advantages", advantages)])
    return use_opsm


def _level_log_ratio(log_rho: torch.Tensor, m: torch.Tensor, level: str) -> torch.Tensor:
    """The log-ratio [B, T] of a correction level, from per-token ``log_rho`` (0 at masked positions); the
    sequence levels broadcast over the sequence (``geometric`` is GSPO's length-normalised ratio)."""
    if level == "token":
        return log_rho
    total = log_rho.sum(-1, keepdim=True)
    if level == "geometric":
        total = total / m.sum(-1, keepdim=True).clamp(min=1).to(log_rho.dtype)
    return total.expand_as(log_rho)


def _truncate_weights(rho: torch.Tensor, m: torch.Tensor, high: float,
                      low: Optional[float]) -> tuple[torch.Tensor, torch.Tensor]:
    too_high = rho > high
    too_low = rho < low if low is not None else torch.zeros_like(m)
    w = rho.clamp(max=high) if low is None else rho.clamp(min=low, max=high)
    return w, too_high | too_low


def _mask_weights(rho: torch.Tensor, m: torch.Tensor, high: float, low: Optional[float],
                  zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    too_high = rho > high
    too_low = rho < low if low is not None else torch.zeros_like(m)
    outside = too_high | too_low
    return torch.where(outside, zero, rho), outside


def _apply_opsm(w: torch.Tensor, changed: torch.Tensor, log_rho: torch.Tensor, advantages: torch.Tensor,
                m: torch.Tensor, opsm_delta: Optional[float], opsm_alone: bool,
                zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Metrics]:
    """``w * O`` with ``O`` from :func:`opsm_keep`, and its metrics; when OPSM is the mode itself
    (``opsm_alone``) the tokens it drops count as changed."""
    keep, seq_kl = opsm_keep(log_rho, advantages, m, OPSM_DELTA if opsm_delta is None else float(opsm_delta))
    w = torch.where(keep, w, zero)
    changed = changed | ~keep if opsm_alone else changed
    has_tok = m.any(-1)
    extra: Metrics = {"mismatch/opsm_masked_frac": frac(~keep, m),
                      "mismatch/opsm_seq_kl_mean": masked_mean(seq_kl.squeeze(-1), has_tok)}
    return w, changed, extra


def _effective_sample_size(w: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Kish's effective sample size ``(sum w)^2 / (N sum w^2)`` over the ``N`` valid tokens, divided by ``N``
    (computed in float64, float32 0-d); 0 when every weight is 0."""
    wd = w.to(torch.float64)
    s1 = wd.sum()
    s2 = (wd * wd).sum()
    n = m.sum().to(torch.float64)
    ess = torch.where(s2 > 0, s1 * s1 / (n.clamp(min=1) * s2.clamp(min=torch.finfo(torch.float64).tiny)), torch.zeros_like(s1))
    return ess.to(torch.float32)


def opsm_keep(log_rho: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
              delta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """OPSM keep mask [B, T] and per-sequence KL [B, 1] (DeepSeek-V3.2, arXiv 2512.02556, eq. 9).

    ``log_rho = old_logp - behav_logp`` (0 at masked positions); ``KL_i = mean_t m (-log_rho)``, the
    sequence-mean ``log(pi_behav / pi)``; keep unless ``A < 0 and KL_i > delta`` (as TRL's
    ``get_off_policy_mask``: keep where ``A >= 0`` or ``KL <= delta``).
    """
    seq_kl = (-log_rho).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1).to(log_rho.dtype)
    adv = advantages.detach()
    adv = adv.unsqueeze(-1) if adv.dim() == 1 else adv
    keep = (adv >= 0) | (seq_kl <= delta)
    return keep.expand_as(log_rho), seq_kl


def mismatch_metrics(train_logp: torch.Tensor, infer_logp: torch.Tensor, mask: torch.Tensor) -> Metrics:
    """How far the trainer's log-probs are from the inference engine's on the sampled tokens.

    With ``d = clamp(train_logp - infer_logp, +-20)`` and ``rho' = exp(d)``, means over valid tokens:
    ``mismatch/k3_kl`` ``mean(rho' - 1 - d)``, the k3 estimate of KL(pi_infer || pi_train) (Schulman 2020,
    "Approximating KL divergence"); ``mismatch/k1_kl`` ``mean(-d)``; ``mismatch/extreme_frac`` the fraction with
    ``max(rho', 1/rho') > 2``; ``mismatch/ratio_mean`` / ``_max`` / ``_min``, ``mismatch/abs_log_ratio_mean``.
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


__all__ = ["correction_weights", "mismatch_metrics", "opsm_keep", "LEVELS", "MODES", "OPSM_DELTA"]
