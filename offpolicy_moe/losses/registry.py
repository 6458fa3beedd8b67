"""Registry of policy objectives: plug a user's loss into the trainer by name.

Calling convention (every registered function must accept it)::

    loss, metrics = fn(logp, old_logp, advantages, mask, *,
                       agg=None, weights=None, num_tokens=None, num_seqs=None, norm_length=None,
                       **options)

* ``logp`` [B, T] (with gradient), ``old_logp`` [B, T] (constant), ``advantages`` [B] or [B, T],
  ``mask`` [B, T] bool/0-1, ``weights`` [B, T] detached correction weights or None;
* ``agg`` an aggregation mode of :func:`aggregate` or None (the objective's default);
  ``num_tokens`` / ``num_seqs`` global counts (see :mod:`offpolicy_moe.losses.aggregation`),
  ``norm_length`` the ``seq-mean-token-sum-norm`` constant;
* ``**options`` the objective's own keyword options (``clip_low``, ``tau``, ...); list them with
  :func:`policy_loss_options`;
* returns a scalar loss tensor and a ``dict[str, Tensor | float]`` of detached metrics.

The registry is a plain module-level mapping filled at import time (the four built-in objectives)
and by the user's ``@register_policy_loss`` decorations.
"""
from __future__ import annotations

import inspect
from typing import Callable

from .m2po import m2po_loss
from .objectives import grpo_loss, gspo_loss, unclipped_loss

PolicyLoss = Callable[..., tuple]

_REQUIRED_KEYWORDS = ("agg", "weights", "num_tokens", "num_seqs", "norm_length")
_BASE_PARAMS = ("logp", "old_logp", "advantages", "mask") + _REQUIRED_KEYWORDS
_REGISTRY: dict[str, PolicyLoss] = {}


def _check_signature(name: str, fn: PolicyLoss) -> None:
    if not callable(fn):
        raise TypeError(f"policy loss {name!r} must be callable, got {type(fn).__name__}")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # builtins / C functions: trust the caller
    params = sig.parameters
    has_var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    has_var_pos = any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params.values())
    positional = [
        p for p in params.values()
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]
    if len(positional) < 4 and not has_var_pos:
        raise TypeError(
            f"policy loss {name!r} must take (logp, old_logp, advantages, mask) positionally; "
            f"its signature is {sig}"
        )
    missing = [k for k in _REQUIRED_KEYWORDS if k not in params]
    if missing and not has_var_kw:
        raise TypeError(
            f"policy loss {name!r} must accept the keyword arguments {', '.join(_REQUIRED_KEYWORDS)} "
            f"(missing: {', '.join(missing)}); its signature is {sig}"
        )


def register_policy_loss(name: str, *, overwrite: bool = False) -> Callable[[PolicyLoss], PolicyLoss]:
    """Decorator registering ``fn`` under ``name`` (see the module docstring for the convention).

    Raises ValueError if ``name`` is taken (unless ``overwrite=True``), TypeError if ``fn`` cannot
    accept the calling convention.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"policy loss name must be a non-empty string, got {name!r}")

    def decorate(fn: PolicyLoss) -> PolicyLoss:
        _check_signature(name, fn)
        if name in _REGISTRY and _REGISTRY[name] is not fn and not overwrite:
            raise ValueError(f"policy loss {name!r} is already registered; pass overwrite=True to replace it")
        _REGISTRY[name] = fn
        return fn

    return decorate


def unregister_policy_loss(name: str) -> None:
    """Remove ``name`` from the registry (ValueError if unknown)."""
    get_policy_loss(name)
    del _REGISTRY[name]


def get_policy_loss(name: str) -> PolicyLoss:
    """The registered objective ``name``; ValueError listing the valid names otherwise."""
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown policy loss {name!r}; registered losses: {', '.join(sorted(_REGISTRY))}"
        ) from None


def list_policy_losses() -> list[str]:
    """Sorted names of all registered objectives."""
    return sorted(_REGISTRY)


def policy_loss_options(name: str) -> tuple[str, ...]:
    """The objective's own keyword options (beyond the common convention), e.g. ``('clip_low', ...)``."""
    fn = get_policy_loss(name)
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return ()
    return tuple(
        k for k, p in params.items()
        if k not in _BASE_PARAMS and p.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    )


register_policy_loss("grpo")(grpo_loss)
register_policy_loss("gspo")(gspo_loss)
register_policy_loss("m2po")(m2po_loss)
register_policy_loss("unclipped")(unclipped_loss)

__all__ = [
    "register_policy_loss",
    "unregister_policy_loss",
    "get_policy_loss",
    "list_policy_losses",
    "policy_loss_options",
]
