"""Registry of policy objectives: each entry is a loss that describes itself.

Calling convention (every registered function must accept it)::

    loss, metrics = fn(logp, old_logp, advantages, mask, *,
                       agg=None, weights=None, num_tokens=None, num_seqs=None, norm_length=None,
                       **options, **runtime)

* ``logp`` [B, T] (with gradient), ``old_logp`` [B, T] (constant), ``advantages`` [B] or [B, T],
  ``mask`` [B, T] bool/0-1, ``weights`` [B, T] detached correction weights or None;
* ``agg`` an aggregation mode of :func:`aggregate` or None (the objective's default);
  ``num_tokens`` / ``num_seqs`` global counts (see :mod:`offpolicy_moe.losses.aggregation`),
  ``norm_length`` the ``seq-mean-token-sum-norm`` constant;
* ``**options`` the user's options of this loss (``clip_low``, ``tau``, ...): the keyword-only
  parameters of its signature, minus the ``runtime`` ones the caller supplies (a process group, a
  precomputed selection);
* returns a scalar loss tensor and a ``dict[str, Tensor | float]`` of detached metrics, to which the
  registration adds the importance-ratio diagnostics ``actor/m2`` and ``actor/ess`` of
  :mod:`offpolicy_moe.losses.diagnostics` (the same statistics for every loss; a loss's own value wins).

A loss registers itself in its own module with :func:`register_policy_loss`, declaring its
capabilities in a :class:`LossSpec`: whether it clips the ratio, whether it is sequence-level,
whether it takes a ``process_group``, and whether it needs a pass over the whole optimizer
mini-batch before the micro-batches (``global_pass``).  The trainer, the config validator and the
verl adapter only ask :func:`get_loss_spec` and :func:`resolve_loss_options`; none names a loss.
The registry is a module-level mapping filled at import time by those registrations.
"""
from __future__ import annotations

import difflib
import functools
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from .diagnostics import ratio_diagnostics

PolicyLoss = Callable[..., tuple]
GlobalPass = Callable[..., list]
"""``global_pass(log_ratios, advantages, masks, options, process_group) -> list[dict]``: one dict of
extra keyword arguments per micro-batch (lists of [B_i, T] tensors in, one selection over all)."""

_REQUIRED_KEYWORDS = ("agg", "weights", "num_tokens", "num_seqs", "norm_length")
_BASE_PARAMS = ("logp", "old_logp", "advantages", "mask") + _REQUIRED_KEYWORDS
_REGISTRY: dict[str, "LossSpec"] = {}


@dataclass(frozen=True)
class LossSpec:
    """A registered objective and what it declares about itself.

    * ``clips``: it bounds the importance ratio (PPO-style clip, CISPO's weight clip);
    * ``sequence_level``: its ratio is per sequence, so token-sum aggregation length-weights it;
    * ``runtime``: keyword parameters the CALLER supplies (not user options), e.g. ``process_group``;
    * ``global_pass``: a selection over the whole mini-batch that must run before the micro-batches
      (``None`` if the loss has none); ``global_pass_when(options)`` says whether these options ask
      for it (default: always);
    * ``check_options``: ``check_options(**options)`` raises a one-line ValueError naming a bad value;
    * ``reference``: the plain-autograd body of the same loss (:mod:`offpolicy_moe.losses.reference`), the
      paper's formula line by line; it returns the loss only and must agree with ``fn`` in value and gradient.
    """

    name: str
    fn: PolicyLoss
    clips: bool = False
    sequence_level: bool = False
    runtime: tuple[str, ...] = ()
    global_pass: Optional[GlobalPass] = None
    global_pass_when: Optional[Callable[[Mapping[str, Any]], bool]] = None
    check_options: Optional[Callable[..., None]] = None
    option_defaults: Mapping[str, Any] = field(default_factory=dict)
    reference: Optional[Callable[..., torch.Tensor]] = None

    @property
    def options(self) -> tuple[str, ...]:
        """Names of the user options (keyword parameters beyond the convention and the runtime ones)."""
        return tuple(self.option_defaults)

    @property
    def distributed(self) -> bool:
        """Whether the loss takes a ``process_group`` (to select or reduce across data-parallel ranks)."""
        return "process_group" in self.runtime

    @property
    def needs_global_pass(self) -> bool:
        """Whether the loss has a mini-batch-wide pass at all (for any options)."""
        return self.global_pass is not None

    def wants_global_pass(self, options: Mapping[str, Any]) -> bool:
        """Whether the resolved ``options`` ask for the mini-batch-wide pass before the micro-batches."""
        if self.global_pass is None:
            return False
        return True if self.global_pass_when is None else bool(self.global_pass_when(options))

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

    The wrapper keeps ``fn``'s name, docstring and signature (``functools.wraps``: options are still read from
    it); a key ``fn`` returns itself is kept.  The statistics are computed after ``fn`` returns, so its own input
    checks come first.  A function that is already wrapped is returned as it is.
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

    Raises ValueError if ``name`` is taken (unless ``overwrite=True``), TypeError if ``fn`` cannot
    accept the calling convention.  Returns (and registers) ``fn`` wrapped by :func:`with_ratio_diagnostics`, so
    every registered loss reports ``actor/m2`` and ``actor/ess``; use the returned function as the loss.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"policy loss name must be a non-empty string, got {name!r}")

    def decorate(fn: PolicyLoss) -> PolicyLoss:
        _check_signature(name, fn)
        wrapped = with_ratio_diagnostics(fn)
        old = _REGISTRY.get(name)
        if old is not None and _unwrapped(old.fn) is _unwrapped(wrapped):
            wrapped = old.fn                # the same loss registered again: keep its wrapper
        elif old is not None and not overwrite:
            raise ValueError(f"policy loss {name!r} is already registered; pass overwrite=True to replace it")
        _REGISTRY[name] = LossSpec(
            name=name, fn=wrapped, clips=clips, sequence_level=sequence_level, runtime=tuple(runtime),
            global_pass=global_pass, global_pass_when=global_pass_when, check_options=check_options,
            option_defaults=_option_defaults(name, fn, tuple(runtime)), reference=reference,
        )
        return wrapped

    return decorate


def unregister_policy_loss(name: str) -> None:
    """Remove ``name`` from the registry (ValueError if unknown)."""
    get_loss_spec(name)
    del _REGISTRY[name]


def get_loss_spec(name: str) -> LossSpec:
    """The registry entry of ``name``; ValueError listing the registered names (and a close one) otherwise."""
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        close = difflib.get_close_matches(str(name), list(_REGISTRY), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(
            f"unknown policy loss {name!r}{hint}; registered losses: {', '.join(sorted(_REGISTRY))}"
        ) from None


def get_policy_loss(name: str) -> PolicyLoss:
    """The registered objective ``name``; ValueError listing the valid names otherwise."""
    return get_loss_spec(name).fn


def list_policy_losses() -> list[str]:
    """Sorted names of all registered objectives."""
    return sorted(_REGISTRY)


def policy_loss_options(name: str) -> tuple[str, ...]:
    """The objective's own user options (beyond the common convention and its runtime arguments)."""
    return get_loss_spec(name).options


def resolve_loss_options(name: str, options: Optional[Mapping[str, Any]] = None) -> dict[str, Any]:
    """Check ``options`` against loss ``name``'s own options and values; return the explicit ones.

    An unknown key raises ``ValueError: loss 'm2po' has no option 'tua' (did you mean 'tau'?);
    its options: tau, variant, scope``; a bad value raises the loss's own one-line error.  Options
    set to None mean "the loss's default" and are dropped from the result.
    """
    spec = get_loss_spec(name)
    opts = dict(options or {})
    for key in opts:
        if key not in spec.option_defaults:
            close = difflib.get_close_matches(str(key), list(spec.option_defaults), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            known = ", ".join(spec.options) or "none"
            raise ValueError(f"loss {name!r} has no option {key!r}{hint}; its options: {known}")
    given = {k: v for k, v in opts.items() if v is not None}
    if spec.check_options is not None:
        try:
            spec.check_options(**given)
        except (ValueError, TypeError) as err:
            raise ValueError(f"loss {name!r}: {err}") from None
    return given


def loss_options_problem(name: str, options: Optional[Mapping[str, Any]]) -> Optional[str]:
    """The one-line problem with ``options`` for loss ``name`` (see :func:`resolve_loss_options`), or None if fine.

    The config validator's entry point: it reports the message under ``algo.loss.options``.
    """
    try:
        resolve_loss_options(name, options)
    except (ValueError, TypeError) as err:
        return str(err)
    return None


__all__ = [
    "LossSpec",
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
