"""What each policy loss declares to the config, without torch: its options with their defaults, their check, and
its capabilities (:class:`LossInterface`), so that a config is checked before torch is imported.

The built-in losses are declared in :data:`BUILTIN_LOSSES` with the module that registers their function
(:func:`~offpolicy_moe.losses.registry.register_builtin_loss` refuses one whose options differ); a loss
registered at run time is declared here by the registry.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

from .option_checks import (check_cispo_options, check_dppo_options, check_gmpo_options, check_grpo_options,
                            check_gspo_options, check_m2po_options, check_sapo_options, check_vespo_options)

__all__ = ["BUILTIN_LOSSES", "LossInterface", "builtin_module", "declare", "forget", "is_declared",
           "list_policy_losses", "loss_interface", "loss_options_problem", "policy_loss_options",
           "resolve_loss_options", "unknown_loss"]


@dataclass(frozen=True)
class LossInterface:
    """A loss as the config sees it.

    * ``clips``: it bounds the importance ratio (PPO-style clip, CISPO's weight clip);
    * ``sequence_level``: its ratio is per sequence, so token-sum aggregation length-weights it;
    * ``runtime``: keyword parameters the CALLER supplies (not user options), e.g. ``process_group``;
    * ``option_defaults``: the user options and their defaults;
    * ``check_options``: ``check_options(**options)`` raises a one-line ValueError naming a bad value;
    * ``has_global_pass``: it has a selection over the whole mini-batch that runs before the micro-batches, asked
      for when ``global_pass_when(options)`` holds (always when that is None).
    """

    name: str
    clips: bool = False
    sequence_level: bool = False
    runtime: tuple[str, ...] = ()
    option_defaults: Mapping[str, Any] = field(default_factory=dict)
    check_options: Optional[Callable[..., None]] = None
    has_global_pass: bool = False
    global_pass_when: Optional[Callable[[Mapping[str, Any]], bool]] = None

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
        return self.has_global_pass

    def wants_global_pass(self, options: Mapping[str, Any]) -> bool:
        """Whether the resolved ``options`` ask for the mini-batch-wide pass before the micro-batches."""
        if not self.has_global_pass:
            return False
        return True if self.global_pass_when is None else bool(self.global_pass_when(options))


def _m2po_global(options: Mapping[str, Any]) -> bool:
    return options.get("scope", "global") == "global"


_CLIPS = {"clip_low": None, "clip_high": None}
_DPPO = {"delta_low": None, "delta_high": None, "ratio_cap": None}

#: ``name: (the module of this package that implements it, its interface)``
BUILTIN_LOSSES: dict[str, tuple[str, LossInterface]] = {
    "grpo": ("objectives", LossInterface("grpo", clips=True, option_defaults={**_CLIPS, "dual_clip": None},
                                         check_options=check_grpo_options)),
    "gspo": ("objectives", LossInterface("gspo", clips=True, sequence_level=True, option_defaults=_CLIPS,
                                         check_options=check_gspo_options)),
    "unclipped": ("objectives", LossInterface("unclipped")),
    "m2po": ("m2po", LossInterface("m2po", runtime=("process_group", "m2po_keep", "m2po_cap"),
                                   option_defaults={"tau": 0.04, "variant": "mask", "scope": "global"},
                                   check_options=check_m2po_options, has_global_pass=True,
                                   global_pass_when=_m2po_global)),
    "cispo": ("cispo", LossInterface("cispo", clips=True, option_defaults=_CLIPS, check_options=check_cispo_options)),
    "dppo_tv": ("dppo", LossInterface("dppo_tv", clips=True, option_defaults=_DPPO, check_options=check_dppo_options)),
    "dppo_kl": ("dppo", LossInterface("dppo_kl", clips=True, option_defaults=_DPPO, check_options=check_dppo_options)),
    "gmpo": ("gmpo", LossInterface("gmpo", clips=True, sequence_level=True, option_defaults=_CLIPS,
                                   check_options=check_gmpo_options)),
    "sapo": ("sapo", LossInterface("sapo", option_defaults={"tau_pos": 1.0, "tau_neg": 1.05},
                                   check_options=check_sapo_options)),
    "vespo": ("vespo", LossInterface("vespo", option_defaults={"k_pos": 2.0, "lambda_pos": 3.0, "k_neg": 3.0,
                                                               "lambda_neg": 2.0, "fold_weights": True},
                                     check_options=check_vespo_options)),
}

# every loss the process knows: the built-ins as declared (or as registered, once loaded) and the ones registered
_DECLARED: dict[str, LossInterface] = {name: interface for name, (_, interface) in BUILTIN_LOSSES.items()}


def declare(interface: LossInterface) -> None:
    """Record ``interface`` under its name (the registry calls this as it registers a loss)."""
    _DECLARED[interface.name] = interface


def forget(name: str) -> None:
    """Remove ``name`` (the registry calls this as it unregisters a loss)."""
    _DECLARED.pop(name, None)


def is_declared(name: str) -> bool:
    """Whether a loss named ``name`` is known (declared built-in or registered)."""
    return isinstance(name, str) and name in _DECLARED


def builtin_module(name: str) -> Optional[str]:
    """The module of this package implementing the built-in loss ``name``, or None for another name."""
    entry = BUILTIN_LOSSES.get(name) if isinstance(name, str) else None
    return None if entry is None else entry[0]


def unknown_loss(name: object) -> ValueError:
    """The error for a name that is not a known loss: it lists the known names and a close one."""
    close = difflib.get_close_matches(str(name), list(_DECLARED), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return ValueError(f"unknown policy loss {name!r}{hint}; registered losses: {', '.join(sorted(_DECLARED))}")


def loss_interface(name: str) -> LossInterface:
    """The interface of loss ``name``; ValueError listing the known names (and a close one) otherwise."""
    if not is_declared(name):
        raise unknown_loss(name)
    return _DECLARED[name]


def list_policy_losses() -> list[str]:
    """Sorted names of all known objectives."""
    return sorted(_DECLARED)


def policy_loss_options(name: str) -> tuple[str, ...]:
    """The objective's own user options (beyond the common convention and its runtime arguments)."""
    return loss_interface(name).options


def resolve_loss_options(name: str, options: Optional[Mapping[str, Any]] = None) -> dict[str, Any]:
    """Check ``options`` against loss ``name``'s own options and values; return the explicit ones.

    An unknown key raises ``ValueError: loss 'm2po' has no option 'tua' (did you mean 'tau'?);
    its options: tau, variant, scope``; a bad value raises the loss's own one-line error.  Options
    set to None mean "the loss's default" and are dropped from the result.
    """
    interface = loss_interface(name)
    opts = dict(options or {})
    for key in opts:
        if key not in interface.option_defaults:
            close = difflib.get_close_matches(str(key), list(interface.option_defaults), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            known = ", ".join(interface.options) or "none"
            raise ValueError(f"loss {name!r} has no option {key!r}{hint}; its options: {known}")
    given = {k: v for k, v in opts.items() if v is not None}
    if interface.check_options is not None:
        try:
            interface.check_options(**given)
        except (ValueError, TypeError) as err:
            raise ValueError(f"loss {name!r}: {err}") from None
    return given


def loss_options_problem(name: str, options: Optional[Mapping[str, Any]]) -> Optional[str]:
    """The one-line problem with ``options`` for loss ``name`` (see :func:`resolve_loss_options`), or None if fine;
    the config validator reports it under ``algo.loss.options``."""
    try:
        resolve_loss_options(name, options)
    except (ValueError, TypeError) as err:
        return str(err)
    return None
