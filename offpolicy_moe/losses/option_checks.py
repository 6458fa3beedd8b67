"""Checks of the built-in losses' options, on plain numbers and strings (no torch): the config validator runs them
before any compute, and each loss runs its own again on every call.  Each raises a one-line ``ValueError`` naming
the option."""
from __future__ import annotations

import math
from typing import Optional, Sequence

from .vocabulary import M2PO_SCOPES, M2PO_VARIANTS

__all__ = ["check_below_one", "check_choice", "check_cispo_options", "check_clip", "check_dppo_options",
           "check_gmpo_options", "check_grpo_options", "check_gspo_options", "check_m2po_options", "check_nonneg",
           "check_positive", "check_sapo_options", "check_vespo_options"]


def _finite_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_choice(name: str, value: str, choices: Sequence[str]) -> None:
    """``value`` is one of ``choices``."""
    if value not in choices:
        raise ValueError(f"unknown {name} {value!r}; valid values: {', '.join(map(str, choices))}")


def check_nonneg(name: str, value: Optional[float]) -> None:
    """``value`` is None or a finite number >= 0."""
    if value is not None and not (_finite_number(value) and value >= 0):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


def check_positive(name: str, value: float) -> None:
    """``value`` is a finite number > 0."""
    if not (_finite_number(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


def check_below_one(name: str, value: Optional[float]) -> None:
    """A lower clip range ``eps`` must satisfy ``0 <= eps < 1`` so that ``1 - eps`` stays positive."""
    check_nonneg(name, value)
    if value is not None and value >= 1:
        raise ValueError(f"{name} must be < 1 (the lower bound 1 - {name} must stay positive), got {value!r}")


def check_clip(name: str, value: float) -> float:
    """A clip range: ``clip_low`` in [0, 1), any other clip range >= 0; returned as a float."""
    if name == "clip_low":
        check_below_one(name, value)
    else:
        check_nonneg(name, value)
    return float(value)


def check_grpo_options(
    clip_low: Optional[float] = None, clip_high: Optional[float] = None, dual_clip: Optional[float] = None
) -> None:
    """GRPO: ``clip_low`` in [0, 1), ``clip_high`` >= 0, ``dual_clip`` > 1."""
    if clip_low is not None:
        check_clip("clip_low", clip_low)
    if clip_high is not None:
        check_clip("clip_high", clip_high)
    if dual_clip is not None and not (_finite_number(dual_clip) and dual_clip > 1.0):
        raise ValueError(f"dual_clip must be a finite number > 1 (or None), got {dual_clip!r}")


def check_gspo_options(clip_low: Optional[float] = None, clip_high: Optional[float] = None) -> None:
    """GSPO: ``clip_low`` in [0, 1), ``clip_high`` >= 0."""
    check_grpo_options(clip_low, clip_high)


def check_cispo_options(clip_low: Optional[float] = None, clip_high: Optional[float] = None) -> None:
    """CISPO: ``clip_low`` in [0, 1) or None, ``clip_high`` >= 0."""
    if clip_low is not None:
        check_clip("clip_low", clip_low)
    if clip_high is not None:
        check_clip("clip_high", clip_high)


def check_m2po_options(tau: float = 0.04, variant: str = "mask", scope: str = "global") -> None:
    """M2PO: ``tau`` > 0 finite, ``variant`` and ``scope`` known."""
    check_positive("tau", tau)
    check_choice("variant", variant, M2PO_VARIANTS)
    check_choice("scope", scope, M2PO_SCOPES)


def check_dppo_options(delta_low: Optional[float] = None, delta_high: Optional[float] = None,
                       ratio_cap: Optional[float] = None) -> None:
    """DPPO: ``delta_low``, ``delta_high`` >= 0; ``ratio_cap`` >= 1 or None."""
    check_nonneg("delta_low", delta_low)
    check_nonneg("delta_high", delta_high)
    if ratio_cap is not None:
        check_clip("ratio_cap", ratio_cap)
        if ratio_cap < 1:
            raise ValueError(f"ratio_cap must be >= 1 (or None), got {ratio_cap!r}")


def check_gmpo_options(clip_low: Optional[float] = None, clip_high: Optional[float] = None) -> None:
    """GMPO: ``clip_low``, ``clip_high`` (log-space) finite and >= 0."""
    check_nonneg("clip_low", clip_low)
    check_nonneg("clip_high", clip_high)


def check_sapo_options(tau_pos: float = 1.0, tau_neg: float = 1.05) -> None:
    """SAPO: ``tau_pos``, ``tau_neg`` finite and > 0."""
    check_positive("tau_pos", tau_pos)
    check_positive("tau_neg", tau_neg)


def check_vespo_options(k_pos: float = 2.0, lambda_pos: float = 3.0, k_neg: float = 3.0, lambda_neg: float = 2.0,
                        fold_weights: bool = True) -> None:
    """VESPO: ``k_*`` finite >= 0, ``lambda_*`` finite > 0, ``fold_weights`` a bool."""
    check_nonneg("k_pos", k_pos)
    check_nonneg("k_neg", k_neg)
    check_positive("lambda_pos", lambda_pos)
    check_positive("lambda_neg", lambda_neg)
    if not isinstance(fold_weights, bool):
        raise ValueError(f"fold_weights must be true or false, got {fold_weights!r}")
