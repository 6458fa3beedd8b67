"""One trained step as a transaction, owned and driven by the training loop (:meth:`Trainer.loop`).

The loop opens the transaction at the iteration boundary (:meth:`StepTransaction.begin`), runs the step, and ends
it with :meth:`~StepTransaction.commit` or :meth:`~StepTransaction.rollback`.  Three scopes can be rolled back:

* **one optimizer update** (:meth:`~StepTransaction.begin_optimizer_update` /
  :meth:`~StepTransaction.rollback_optimizer_update`): the parameters, optimizer state, group learning rates and
  scheduler of before that update (``trainer.on_nan=skip`` drops just that update);
* **the update** (:meth:`~StepTransaction.begin_update` / :meth:`~StepTransaction.rollback_update`): the weights,
  optimizer and scheduler of the start of the policy update (a non-finite evaluation of the new weights);
* **the step** (:meth:`~StepTransaction.rollback`): the start of the update's weights when they were kept for
  ``on_nan=stop``, and the iteration boundary: RNG states and every named part (the batch source's counters and
  queue, the non-finite counts, the loop's own counters).  This is the last finite state a diverged run checkpoints.

The copies of weights and optimizer state are :class:`~offpolicy_moe.trainer.step_guard.StepGuard`\\ s (buffers
allocated once, refreshed in place); they are taken only where a rollback may need them, so a step costs what it
did before there was a transaction: one copy per optimizer update under ``skip``, one per step under ``stop``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Protocol

import torch

from offpolicy_moe.run.checkpoint import rng_state, set_rng_state
from offpolicy_moe.trainer.step_guard import StepGuard

__all__ = ["Stateful", "StepTransaction", "Boundary"]


class Stateful(Protocol):
    """A part whose state a checkpoint or a rollback puts back: ``state_dict()`` and ``load_state_dict(state)``."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


@dataclass
class Boundary:
    """The iteration boundary: this process's RNG states and each named part's ``state_dict()``."""

    rng: dict
    parts: dict = field(default_factory=dict)


class StepTransaction:
    """Snapshot, run, commit or roll back one trained step (module docstring).

    ``optimizer`` / ``scheduler``: what the update trains (their parameters are the policy's and the PR2
    predictors'); ``parts``: the named parts a step changes besides them (put back, in this order, by
    :meth:`rollback`); ``on_nan``: ``trainer.on_nan`` (``stop`` keeps the start of each update for the rollback of
    the step; ``skip`` keeps the state of before each optimizer update)."""

    def __init__(self, optimizer: torch.optim.Optimizer, scheduler: Any, parts: Mapping[str, Stateful], *,
                 on_nan: str = "skip"):
        self.optimizer, self.parts = optimizer, dict(parts)
        self.stop = on_nan == "stop"
        self._unit = StepGuard(optimizer, scheduler)     # before one optimizer update
        self._start = StepGuard(optimizer, scheduler)    # the start of the policy update
        self._boundary: Optional[Boundary] = None
        self._unit_taken = False        # the optimizer update under way has its snapshot
        self._start_taken = False       # this step's update kept its start
        self._keep_start = False
        self.applied = 0                # optimizer updates committed in this step's update

    # ------------------------------------------------------------------ the step
    def begin(self) -> None:
        """Open the step at the iteration boundary: the RNG states and the parts' states are kept."""
        self._boundary = Boundary(rng_state(), {n: p.state_dict() for n, p in self.parts.items()})
        self._start_taken = self._unit_taken = False
        self.applied = 0

    def commit(self) -> None:
        """The step is done: nothing is kept for it any longer."""
        self._boundary = None

    def rollback(self) -> None:
        """Put back the start of the step: the weights, optimizer and scheduler of the start of the update when they
        were kept for ``on_nan=stop``, then the iteration boundary (RNG states and parts)."""
        if self.stop and self._start_taken:
            self._start.restore()
        self.optimizer.zero_grad(set_to_none=True)
        if self._boundary is None:
            raise RuntimeError("StepTransaction.rollback() outside a step (begin() was not called)")
        for name, part in self.parts.items():
            part.load_state_dict(self._boundary.parts[name])
        set_rng_state(self._boundary.rng)

    # ------------------------------------------------------------------ the update
    def begin_update(self, *, keep_start: bool, updates_per_step: int) -> None:
        """The policy update starts; ``keep_start``: keep its start for :meth:`rollback_update` (the new weights
        are evaluated next).  The start is copied under ``on_nan=stop`` and for an update of several optimizer
        updates; a single update under ``skip`` reuses the copy taken before it (the same state)."""
        self.applied = 0
        self._unit_taken = False
        self._keep_start = keep_start
        self._start_taken = False
        if self.stop or (keep_start and updates_per_step != 1):
            self._start.snapshot()
            self._start_taken = True

    def rollback_update(self) -> bool:
        """Put back the weights, optimizer and scheduler of the start of the update (kept by :meth:`begin_update`);
        False when the update applied no optimizer update (nothing to put back)."""
        if self.applied == 0:
            return False
        guard = self._start if self._start_taken else (self._unit if self._keep_start and self._unit_taken else None)
        if guard is None:
            raise RuntimeError("StepTransaction.rollback_update() without the start of the update kept")
        guard.restore()
        self.optimizer.zero_grad(set_to_none=True)
        return True

    # ------------------------------------------------------------------ one optimizer update
    def begin_optimizer_update(self) -> None:
        """An optimizer update starts: under ``on_nan=skip`` its parameters, optimizer state, learning rates and
        scheduler are copied (an update that leaves non-finite parameters is then undone exactly)."""
        self._unit_taken = False
        if not self.stop:
            self._unit.snapshot()
            self._unit_taken = True

    def commit_optimizer_update(self) -> None:
        """The optimizer update was applied and is finite."""
        self.applied += 1

    def rollback_optimizer_update(self) -> None:
        """Undo the optimizer update under way (its copy, when one was taken; nothing changed the parameters
        otherwise before the optimizer step), and drop its gradients."""
        if self._unit_taken:
            self._unit.restore()
        self.optimizer.zero_grad(set_to_none=True)
