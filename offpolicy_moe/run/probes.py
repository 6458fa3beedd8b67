"""The test seam of a training step: named points where an installed probe may change a value.

The stages of a step call the functions below at their values; with no probe installed (every real run) each is
one test of ``None``.  A test installs a probe (:func:`install`; :mod:`offpolicy_moe.run.fault_injection` is one);
a probe that must reach the rollout worker processes gives a picklable :func:`handoff` that each worker passes to
:func:`receive`.  No production module imports a probe: they import this seam only.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Optional, Protocol

import torch

__all__ = ["Probe", "install", "uninstall", "installed", "poisoned", "value", "poison_", "handoff", "receive"]


class Probe(Protocol):
    """What a probe answers at each point (``stage``, the 1-based ``step``)."""

    def poisoned(self, stage: str, step: int, model: Optional[torch.nn.Module]) -> ContextManager[bool]:
        """A block during which ``model`` runs stage ``stage``."""

    def value(self, stage: str, step: int, x: torch.Tensor) -> torch.Tensor:
        """The value ``x`` of stage ``stage``, possibly replaced."""

    def poison_(self, stage: str, step: int, tensor: Optional[torch.Tensor]) -> bool:
        """``tensor`` of stage ``stage``, possibly changed in place; whether it was."""

    def handoff(self) -> Optional[tuple[Callable, tuple]]:
        """``(function, args)`` that installs the same probe in a worker process (None: nothing to hand on)."""


_PROBE: Optional[Probe] = None


def install(probe: Probe) -> None:
    """Install ``probe`` in this process (replacing any other)."""
    global _PROBE
    _PROBE = probe


def uninstall() -> None:
    """Remove the installed probe."""
    global _PROBE
    _PROBE = None


def installed() -> Optional[Probe]:
    """The installed probe (None in a real run)."""
    return _PROBE


def poisoned(stage: str, step: int, model: Optional[torch.nn.Module]) -> ContextManager[bool]:
    """The probe's block around stage ``stage`` running ``model``; yields whether it changed anything."""
    if _PROBE is None:
        return contextlib.nullcontext(False)
    return _PROBE.poisoned(stage, step, model)


def value(stage: str, step: int, x: torch.Tensor) -> torch.Tensor:
    """``x``, or what the probe makes of it."""
    return x if _PROBE is None else _PROBE.value(stage, step, x)


def poison_(stage: str, step: int, tensor: Optional[torch.Tensor]) -> bool:
    """Let the probe change ``tensor`` in place; whether it did."""
    return False if _PROBE is None else _PROBE.poison_(stage, step, tensor)


def handoff() -> Optional[tuple[Callable, tuple]]:
    """What a worker process must :func:`receive` to carry the installed probe (None without one)."""
    return None if _PROBE is None else _PROBE.handoff()


def receive(handed: Optional[tuple[Callable, tuple]]) -> Any:
    """In a worker process: install what :func:`handoff` gave (nothing for None)."""
    if handed is None:
        return None
    fn, args = handed
    return fn(*args)
