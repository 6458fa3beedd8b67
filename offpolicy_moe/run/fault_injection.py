"""Test-only fault injection: NaN at a chosen stage of a chosen step, through the real code of that stage.

Used by tests/faults and experiments/nonfinite_faults.py to prove ``trainer.on_nan`` at every stage.  A run injects
nothing unless a test or that script called :func:`arm` in the same process, which installs this module as the
probe of the step's test seam (:mod:`offpolicy_moe.run.probes`).  ``generation``, ``old_logp``, ``metrics``,
``reference``, ``evaluation``: a weight of the model that stage runs is NaN for that stage (:func:`poisoned`);
``loss``: the update's log-probs (:func:`value`); ``gradients`` / ``optimizer``: one gradient after the backward,
one parameter after ``optimizer.step()`` (:func:`poison_`).  ``step`` is the 1-based trained step; for the batch
sources' stages it is the generation iteration + 1.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from offpolicy_moe.run import probes
from offpolicy_moe.run.nonfinite import STAGES

__all__ = ["Fault", "arm", "disarm", "armed", "install", "fires", "poisoned", "value", "poison_", "PROBE"]


@dataclass(frozen=True)
class Fault:
    """Inject NaN at stage ``stage`` of step ``step``, ``times`` times (each passage through the stage at that
    step consumes one)."""

    stage: str
    step: int
    times: int = 1


_ARMED: list[list] = []          # [fault, remaining]


def arm(stage: str, step: int, times: int = 1) -> Fault:
    """Arm one fault (several may be armed); returns it."""
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}; expected one of {', '.join(STAGES)}")
    if int(step) < 1 or int(times) < 1:
        raise ValueError(f"a fault needs step >= 1 and times >= 1, got step={step}, times={times}")
    fault = Fault(stage, int(step), int(times))
    _ARMED.append([fault, fault.times])
    probes.install(PROBE)
    return fault


def disarm() -> None:
    """Remove every armed fault (and this probe from the seam)."""
    _ARMED.clear()
    if probes.installed() is PROBE:
        probes.uninstall()


def armed() -> tuple[Fault, ...]:
    """The faults still armed, with their remaining counts as ``times`` (what a worker process must install)."""
    return tuple(Fault(f.stage, f.step, n) for f, n in _ARMED if n > 0)


def install(faults: tuple[Fault, ...]) -> None:
    """Arm exactly ``faults`` (in a worker process)."""
    disarm()
    for f in faults:
        arm(f.stage, f.step, f.times)


def fires(stage: str, step: int) -> bool:
    """True (once per armed count) when a fault is armed for ``stage`` at ``step``."""
    if not _ARMED:
        return False
    for entry in _ARMED:
        fault, left = entry
        if left > 0 and fault.stage == stage and fault.step == int(step):
            entry[1] = left - 1
            return True
    return False


def _first_float(module: Optional[torch.nn.Module]) -> Optional[torch.Tensor]:
    if module is None:
        return None
    return next((p for p in module.parameters() if p.is_floating_point()), None)


@contextlib.contextmanager
def poisoned(stage: str, step: int, model: Optional[torch.nn.Module]) -> Iterator[bool]:
    """Inside the block, the first floating-point parameter of ``model`` is NaN when a fault fires for ``stage`` at
    ``step``; it is restored on the way out.  Yields whether it fired."""
    param = _first_float(model) if _ARMED else None
    if param is None or not fires(stage, step):
        yield False
        return
    saved = param.detach().clone()
    with torch.no_grad():
        param.fill_(float("nan"))
    try:
        yield True
    finally:
        with torch.no_grad():
            param.copy_(saved)


def value(stage: str, step: int, x: torch.Tensor) -> torch.Tensor:
    """``x``, or ``x * NaN`` (a new tensor: autograd is untouched) when a fault fires for ``stage`` at ``step``."""
    if _ARMED and fires(stage, step):
        return x * float("nan")
    return x


def poison_(stage: str, step: int, tensor: Optional[torch.Tensor]) -> bool:
    """Fill ``tensor`` with NaN in place when a fault fires for ``stage`` at ``step``; returns whether it did."""
    if tensor is None or not _ARMED or not fires(stage, step):
        return False
    with torch.no_grad():
        tensor.fill_(float("nan"))
    return True


class _FaultProbe:
    """This module as a :class:`~offpolicy_moe.run.probes.Probe`."""

    poisoned = staticmethod(poisoned)
    value = staticmethod(value)
    poison_ = staticmethod(poison_)

    @staticmethod
    def handoff() -> tuple:
        """The armed faults with their remaining counts, for :func:`install` in a worker process."""
        return install, (armed(),)


#: the probe :func:`arm` installs
PROBE = _FaultProbe()
