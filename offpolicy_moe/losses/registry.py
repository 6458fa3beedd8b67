"""Registry of policy objectives: each entry is a loss that describes itself.

Calling convention (every registered function must accept it)::

    loss, metrics = fn(logp, old_logp, advantages, mask, *,
                       agg=None, weights=None, num_tokens=None, num_seqs=None, norm_length=None,
                       **options, **runtime)

``logp`` [B, T] carries the gradient, ``old_logp`` [B, T] is a constant, ``advantages`` is [B] or [B, T],
``mask`` [B, T] bool/0-1, ``weights`` [B, T] detached correction weights or None; ``agg`` a mode of
:func:`aggregate` (None: the objective's default) with the global counts of :mod:`offpolicy_moe.losses.aggregation`.
``options`` are the keyword-only parameters beyond these, minus the ``runtime`` ones the caller supplies (a process
group, a precomputed selection).  The registration adds ``actor/m2`` and ``actor/ess``
(:mod:`offpolicy_moe.losses.diagnostics`) to the detached metrics.

Built-in losses are declared in :mod:`~offpolicy_moe.losses.catalogue` (without torch) and their module is imported
the first time their entry is asked for (:func:`get_loss_spec`).  The trainer, the config validator and the verl
adapter only ask the registry and the catalogue; none names a loss.
"""
from __future__ import annotations

import functools
import importlib
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from .catalogue import (BUILTIN_LOSSES, LossInterface, builtin_module, declare, forget, is_declared,
                        list_policy_losses, loss_options_problem, policy_loss_options, resolve_loss_options,
                        unknown_loss)
from .diagnostics import ratio_diagnostics

PolicyLoss = Callable[..., tuple]
GlobalPass = Callable[..., list]
"""``global_pass(log_ratios, advantages, masks, options, process_group) -> list[dict]``: one dict of
extra keyword arguments per micro-batch (lists of [B_i, T] tensors in, one selection over all)."""

_REQUIRED_KEYWORDS = ("agg", "weights", "num_tokens", "num_seqs", "norm_length")
_BASE_PARAMS = ("logp", "old_logp", "advantages", "mask") + _REQUIRED_KEYWORDS
_REGISTRY: dict[str, "LossSpec"] = {}


@dataclass(frozen=True)
class LossSpec(LossInterface):
    """A registered objective: its interface (:class:`~offpolicy_moe.losses.catalogue.LossInterface`) and what
    runs it.

    * ``fn``: the objective, wrapped by :func:`with_ratio_diagnostics`;
    * ``global_pass``: the selection over the whole mini-batch that runs before the micro-batches (``None`` if the
      loss has none);
    * ``reference``: the plain-autograd body of the same loss (:mod:`offpolicy_moe.losses.reference`), the
      paper's formula line by line; it returns the loss only and must agree with ``fn`` in value and gradient.
    """

    fn: Optional[PolicyLoss] = None
    global_pass: Optional[GlobalPass] = None
    reference: Optional[Callable[..., torch.Tensor]] = None

    def run_global_pass(
        self,
        log_ratios: Sequence[torch.Tensor],
        advantages: Sequence[torch.Tensor],
        masks: Sequence[torch.Tensor],
        options: Mapping[str, Any],
        process_group: object = None,
    ) -> list[dict]:
        """Per-micro-batch extra keyword arguments from one selection over all micro-batches (and ranks)."""
        if self.global_pass is None:
            return [{} for _ in log_ratios]
        return self.global_pass(list(log_ratios), list(advantages), list(masks), dict(options), process_group)


def _option_defaults(name: str, fn: PolicyLoss, runtime: Sequence[str]) -> dict[str, Any]:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return {}
    return {
        k: (None if p.default is inspect.Parameter.empty else p.default)
        for k, p in params.items()
        if k not in _BASE_PARAMS and k not in runtime
        and p.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    }


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


def with_ratio_diagnostics(fn: PolicyLoss) -> PolicyLoss:
    """``fn`` wrapped so that its metrics gain :func:`ratio_diagnostics` of its ``logp``, ``old_logp`` and ``mask``.

    ``functools.wraps`` keeps the signature the options are read from; a key ``fn`` returns itself is kept, and
    ``fn``'s own input checks run first.  A function that is already wrapped is returned as it is.
    """
    if getattr(fn, "__ratio_diagnostics__", False):
        return fn

    @functools.wraps(fn)
    def loss_with_diagnostics(*args: Any, **kwargs: Any) -> tuple:
        out = fn(*args, **kwargs)
        names = ("logp", "old_logp", "advantages", "mask")
        got = dict(zip(names, args))
        got.update({k: kwargs[k] for k in names if k in kwargs})
        if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict)):
            return out
        tensors = [got.get(k) for k in ("logp", "old_logp", "mask")]
        if not all(isinstance(t, torch.Tensor) for t in tensors):
            return out
        loss, metrics = out
        return loss, {**ratio_diagnostics(*tensors), **metrics}

    loss_with_diagnostics.__ratio_diagnostics__ = True  # type: ignore[attr-defined]
    return loss_with_diagnostics


def _unwrapped(fn: PolicyLoss) -> PolicyLoss:
    return fn.__wrapped__ if getattr(fn, "__ratio_diagnostics__", False) else fn


def register_policy_loss(
    name: str,
    *,
    overwrite: bool = False,
    clips: bool = False,
    sequence_level: bool = False,
    runtime: Sequence[str] = (),
    global_pass: Optional[GlobalPass] = None,
    global_pass_when: Optional[Callable[[Mapping[str, Any]], bool]] = None,
    check_options: Optional[Callable[..., None]] = None,
    reference: Optional[Callable[..., torch.Tensor]] = None,
) -> Callable[[PolicyLoss], PolicyLoss]:
    """Decorator registering ``fn`` under ``name`` with its capabilities (see :class:`LossSpec`).

    Raises ValueError if ``name`` is taken (unless ``overwrite=True``; a built-in not loaded yet counts as taken),
    TypeError if ``fn`` cannot accept the calling convention.  Returns (and registers) ``fn`` wrapped by
    :func:`with_ratio_diagnostics`, so every registered loss reports ``actor/m2`` and ``actor/ess``; use the
    returned function as the loss.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"policy loss name must be a non-empty string, got {name!r}")

    def decorate(fn: PolicyLoss) -> PolicyLoss:
        if name not in _REGISTRY and builtin_module(name) and is_declared(name):
            _load_builtin(name)         # the built-in first, so that `overwrite` decides between the two
        return _register(name, fn, overwrite=overwrite, clips=clips, sequence_level=sequence_level,
                         runtime=tuple(runtime), global_pass=global_pass, global_pass_when=global_pass_when,
                         check_options=check_options, reference=reference)

    return decorate


def register_builtin_loss(
    name: str, *, global_pass: Optional[GlobalPass] = None, reference: Optional[Callable[..., torch.Tensor]] = None,
) -> Callable[[PolicyLoss], PolicyLoss]:
    """Decorator registering the function of the built-in loss ``name`` with the interface
    :data:`~offpolicy_moe.losses.catalogue.BUILTIN_LOSSES` declares for it.

    Raises TypeError when the function's options (names, order, defaults) or its global pass differ from the
    declaration, so that the config validator, which reads the declaration, checks what the function takes."""
    declared = BUILTIN_LOSSES[name][1]

    def decorate(fn: PolicyLoss) -> PolicyLoss:
        options = _option_defaults(name, fn, declared.runtime)
        if list(options.items()) != list(declared.option_defaults.items()):
            raise TypeError(f"built-in loss {name!r} takes the options {options}, but losses/catalogue.py declares "
                            f"{dict(declared.option_defaults)}")
        if (global_pass is not None) != declared.has_global_pass:
            raise TypeError(f"built-in loss {name!r}: its global pass and losses/catalogue.py's has_global_pass "
                            "disagree")
        return _register(name, fn, overwrite=False, clips=declared.clips, sequence_level=declared.sequence_level,
                         runtime=declared.runtime, global_pass=global_pass,
                         global_pass_when=declared.global_pass_when, check_options=declared.check_options,
                         reference=reference)

    return decorate


def _register(name: str, fn: PolicyLoss, *, overwrite: bool, runtime: tuple[str, ...],
              global_pass: Optional[GlobalPass], **declared: Any) -> PolicyLoss:
    _check_signature(name, fn)
    wrapped = with_ratio_diagnostics(fn)
    old = _REGISTRY.get(name)
    if old is not None and _unwrapped(old.fn) is _unwrapped(wrapped):
        wrapped = old.fn                # the same loss registered again: keep its wrapper
    elif old is not None and not overwrite:
        raise ValueError(f"policy loss {name!r} is already registered; pass overwrite=True to replace it")
    spec = LossSpec(name=name, fn=wrapped, runtime=runtime, global_pass=global_pass,
                    has_global_pass=global_pass is not None, option_defaults=_option_defaults(name, fn, runtime),
                    **declared)
    _REGISTRY[name] = spec
    declare(spec)
    return wrapped


def _load_builtin(name: str) -> None:
    """Import the module of the built-in loss ``name``: it registers the loss as it is imported."""
    importlib.import_module(f"{__package__}.{builtin_module(name)}")


def unregister_policy_loss(name: str) -> None:
    """Remove ``name`` from the registry (ValueError if unknown)."""
    get_loss_spec(name)
    del _REGISTRY[name]
    forget(name)


def get_loss_spec(name: str) -> LossSpec:
    """The registry entry of ``name`` (a built-in's module is imported the first time); ValueError listing the
    known names (and a close one) otherwise."""
    if is_declared(name) and name not in _REGISTRY and builtin_module(name):
        _load_builtin(name)
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise unknown_loss(name) from None


def get_policy_loss(name: str) -> PolicyLoss:
    """The registered objective ``name``; ValueError listing the valid names otherwise."""
    return get_loss_spec(name).fn


__all__ = [
    "LossSpec",
    "register_builtin_loss",
    "loss_options_problem",
    "register_policy_loss",
    "unregister_policy_loss",
    "with_ratio_diagnostics",
    "get_loss_spec",
    "get_policy_loss",
    "list_policy_losses",
    "policy_loss_options",
    "resolve_loss_options",
]
