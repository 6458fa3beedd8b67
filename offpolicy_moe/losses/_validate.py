"""Input checks shared by every loss function.

Shape and option checks are free (no device sync) and always run.  Value checks (mask is 0/1, no NaN/Inf at valid
positions, counts not NaN or negative) cost ONE reduction per tensor and ONE host sync per call (:class:`FusedCheck`);
``with value_checks(False):`` switches them off.  Half precision: every ratio is computed in float32 and its log is
clamped to :func:`ratio_bound` of the input dtype, so ``exp`` and the gradient that flows back into a float16
``logp`` stay finite.
"""
from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Iterator, Optional, Sequence

import torch

from .option_checks import check_choice, check_nonneg, check_positive
from .vocabulary import AGG_MODES

LOG_RATIO_BOUND = 20.0
"""Every log-ratio is clamped to ``[-b, b]`` before ``exp``, ``b = ratio_bound(dtype) <= LOG_RATIO_BOUND``."""


def ratio_bound(dtype: torch.dtype) -> float:
    """Log-ratio clamp for inputs of ``dtype``: ``min(20, log(finfo(dtype).max) - 1)``.

    20 for float32, float64 and bfloat16; about 10.09 for float16 (``log(65504) - 1``), so that a
    ratio times an advantage or weight of a few units still fits the dtype.
    """
    if not dtype.is_floating_point:
        return LOG_RATIO_BOUND
    return min(LOG_RATIO_BOUND, math.log(torch.finfo(dtype).max) - 1.0)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a loss computes in: float32 for half inputs, else the input's float dtype."""
    return torch.promote_types(dtype, torch.float32) if dtype.is_floating_point else torch.float32

_VALUE_CHECKS: contextvars.ContextVar[bool] = contextvars.ContextVar("offpolicy_moe_value_checks", default=True)


@contextlib.contextmanager
def value_checks(enabled: bool = True) -> Iterator[None]:
    """Switch the data-dependent input checks (mask values, NaN/Inf) on or off inside a block; off removes the
    one host sync each loss call otherwise makes (shape and option checks always run)."""
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


def check_count(name: str, value: object) -> None:
    """A global count (``num_tokens``/``num_seqs``): None, a tensor (checked by value later) or a finite number >= 0."""
    if value is None or isinstance(value, torch.Tensor):
        if isinstance(value, torch.Tensor) and value.numel() != 1:
            raise ValueError(f"{name} must be a number or a one-element tensor, got shape {tuple(value.shape)}")
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


class NonFiniteInput(ValueError):
    """A loss input holds NaN or Inf at a valid (mask=1) position: the loss library's refusal, by type (callers
    that route non-finite values catch this class, never a message)."""


class FusedCheck:
    """Collects data-dependent checks as 0-d bool tensors and resolves them with ONE host sync.

    Finiteness of a tensor is one ``aminmax`` reduction (NaN propagates through min/max, and an
    Inf shows up as the min or max), so no bool tensor of the input's size is materialised.
    Callers pass tensors already zeroed at masked positions, so only valid positions count.
    """

    def __init__(self) -> None:
        self._items: list[tuple[str, torch.Tensor, type]] = []

    def finite(self, message: str, x: Optional[torch.Tensor]) -> None:
        """Require ``x`` (if given and non-empty) to hold no NaN/Inf; ``message`` is the error."""
        if x is None or x.numel() == 0:
            return
        lo, hi = torch.aminmax(x.detach())
        self._items.append((message, torch.isfinite(lo) & torch.isfinite(hi), NonFiniteInput))

    def holds(self, message: str, ok: torch.Tensor) -> None:
        """Require the 0-d bool tensor ``ok`` to be True."""
        self._items.append((message, ok.reshape(()), ValueError))

    def run(self) -> None:
        """One sync; raise the first failing item's error: :class:`NonFiniteInput` for :meth:`finite`, ``ValueError``
        for :meth:`holds`."""
        if not self._items:
            return
        oks = torch.stack([ok.to(self._items[0][1].device) for _, ok, _ in self._items])
        if bool(oks.all()):
            return
        for (message, _, kind), ok in zip(self._items, oks.tolist()):
            if not ok:
                raise kind(message)


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

    ONE host sync (:class:`FusedCheck`); skipped inside ``value_checks(False)``.  A [B] tensor is checked on the rows
    with a valid token.
    """
    if not _VALUE_CHECKS.get():
        return
    valid = as_bool_mask(mask)
    check = FusedCheck()
    binary = mask_is_binary(mask)
    if binary is not None:
        check.holds(MASK_MESSAGE.format(dtype=mask.dtype), binary)
    rows = None
    for name, t in named:
        if t is None:
            continue
        if t.shape == valid.shape:
            m = valid
        elif t.dim() == 1 and valid.dim() == 2 and t.shape[0] == valid.shape[0]:
            rows = valid.any(-1) if rows is None else rows
            m = rows
        else:
            m = None
        x = t.detach() if m is None else torch.where(m, t.detach(), torch.zeros((), dtype=t.dtype, device=t.device))
        check.finite(f"{name} contains NaN or Inf at a valid (mask=1) position", x)
    check.run()


def mask_is_binary(mask: torch.Tensor) -> Optional[torch.Tensor]:
    """0-d bool tensor: ``mask`` holds only 0 and 1 (None for a bool mask, which cannot fail)."""
    if mask.dtype == torch.bool:
        return None
    return ((mask == 0) | (mask == 1)).all()


MASK_MESSAGE = "mask must be boolean or contain only 0 and 1 (dtype {dtype}); found other values"


def clamp_log_ratio(x: torch.Tensor, bound: float = LOG_RATIO_BOUND) -> torch.Tensor:
    """``clamp(x, -bound, bound)`` (use :func:`ratio_bound` of the input dtype for ``bound``)."""
    return x.clamp(-bound, bound)


def check_objective_args(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                         weights: Optional[torch.Tensor], agg: Optional[str], num_tokens: object, num_seqs: object,
                         norm_length: Optional[float]) -> torch.Tensor:
    """The free checks every objective makes on its common arguments; returns the advantages laid out ``[B, T]``.
    One-line ``ValueError`` naming the argument."""
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
    check_count("num_tokens", num_tokens)
    check_count("num_seqs", num_seqs)
    if norm_length is not None:
        check_positive("norm_length", norm_length)
    return adv
