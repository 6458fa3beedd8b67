"""Input checks shared by every loss function.

Shape and option checks are free (no device sync) and always run.  Value checks (mask is 0/1,
no NaN/Inf at valid positions) need one host sync per call; they run by default and can be
switched off inside a ``with value_checks(False):`` block for hot loops that already trust their
inputs.
"""
from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Iterator, Optional, Sequence

import torch

LOG_RATIO_BOUND = 20.0
"""Every log-ratio is clamped to ``[-LOG_RATIO_BOUND, LOG_RATIO_BOUND]`` before ``exp``."""

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")

_VALUE_CHECKS: contextvars.ContextVar[bool] = contextvars.ContextVar("offpolicy_moe_value_checks", default=True)


@contextlib.contextmanager
def value_checks(enabled: bool = True) -> Iterator[None]:
    """Switch the data-dependent input checks (mask values, NaN/Inf) on or off inside a block.

    Shape and option checks always run.  Turning value checks off removes the one host sync that
    each loss call otherwise performs.
    """
    token = _VALUE_CHECKS.set(bool(enabled))
    try:
        yield
    finally:
        _VALUE_CHECKS.reset(token)


def value_checks_enabled() -> bool:
    return _VALUE_CHECKS.get()


def check_tensor(name: str, x: object) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def check_2d(name: str, x: torch.Tensor) -> None:
    if x.dim() != 2:
        raise ValueError(f"{name} must be 2-D [B, T], got shape {tuple(x.shape)}")


def check_same_shape(name_a: str, a: torch.Tensor, name_b: str, b: torch.Tensor) -> None:
    if a.shape != b.shape:
        raise ValueError(
            f"shape mismatch: {name_a} has shape {tuple(a.shape)} but {name_b} has shape {tuple(b.shape)}"
        )


def check_float(name: str, x: torch.Tensor) -> None:
    if not torch.is_floating_point(x):
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")


def check_agg(mode: str) -> None:
    if mode not in AGG_MODES:
        raise ValueError(f"unknown aggregation mode {mode!r}; valid modes: {', '.join(AGG_MODES)}")


def check_choice(name: str, value: str, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ValueError(f"unknown {name} {value!r}; valid values: {', '.join(map(str, choices))}")


def check_nonneg(name: str, value: Optional[float]) -> None:
    if value is None:
        return
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


def check_positive(name: str, value: float) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


def as_bool_mask(mask: torch.Tensor) -> torch.Tensor:
    """Return ``mask`` as a bool tensor (values are checked separately, see :func:`check_values`)."""
    return mask if mask.dtype == torch.bool else mask != 0


def check_advantages(advantages: torch.Tensor, ref_shape: torch.Size, ref_name: str = "logp") -> torch.Tensor:
    """Accept advantages of shape [B] or [B, T]; return them broadcast to [B, T] (a view)."""
    check_tensor("advantages", advantages)
    if advantages.shape == ref_shape:
        return advantages
    if advantages.dim() == 1 and len(ref_shape) == 2 and advantages.shape[0] == ref_shape[0]:
        return advantages.unsqueeze(-1).expand(ref_shape)
    raise ValueError(
        f"shape mismatch: advantages has shape {tuple(advantages.shape)} but {ref_name} has shape "
        f"{tuple(ref_shape)} (advantages must be [B] or [B, T])"
    )


def check_values(mask: torch.Tensor, named: Sequence[tuple[str, Optional[torch.Tensor]]]) -> None:
    """Raise ValueError if ``mask`` is not 0/1 or a named tensor is NaN/Inf at a valid position.

    One host sync for all checks together; skipped inside ``value_checks(False)``.
    """
    if not _VALUE_CHECKS.get():
        return
    valid = as_bool_mask(mask)
    oks = []
    if mask.dtype != torch.bool:
        oks.append(((mask == 0) | (mask == 1)).all())
    present = [(n, t) for n, t in named if t is not None]
    for _, t in present:
        t_valid = valid if t.shape == valid.shape else valid.any(-1) if t.dim() == 1 else None
        finite = torch.isfinite(t.detach())
        oks.append((finite | ~t_valid).all() if t_valid is not None else finite.all())
    if not oks:
        return
    if bool(torch.stack(oks).all()):
        return
    # error path: find the culprit
    i = 0
    if mask.dtype != torch.bool:
        if not bool(oks[0]):
            raise ValueError(
                f"mask must be boolean or contain only 0 and 1 (dtype {mask.dtype}); found other values"
            )
        i = 1
    for (name, _), ok in zip(present, oks[i:]):
        if not bool(ok):
            raise ValueError(f"{name} contains NaN or Inf at a valid (mask=1) position")


def clamp_log_ratio(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
