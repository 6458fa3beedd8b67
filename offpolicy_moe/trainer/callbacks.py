"""Observers of a training run (tests, experiments, benchmarks).

A :class:`Callback` is told about the run; it never steers it: the trainer decides its computational path
(fused old-logp pass, routing, update) from the config alone, so installing a callback leaves every weight bit for
bit as it would be without it.  A callback may raise :class:`~offpolicy_moe.trainer.trainer.TrainingStopped` from
:meth:`Callback.on_step_end` to stop the run after that step's checkpoint.

Note for ``on_batch``: a batch whose old log-probs come from the update forward itself (fused, loglinear) has
``old_logp = None``.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

from offpolicy_moe.rollout.batch import RolloutBatch

Trainer = Any     # the :class:`~offpolicy_moe.trainer.trainer.Trainer` (which imports this module)

__all__ = ["Callback", "CallbackList", "FunctionCallback"]


class Callback:
    """Base class of run observers; every method is a no-op, override the ones you need."""

    def on_batch(self, trainer: Trainer, batch: RolloutBatch) -> None:
        """A batch was released by the staleness buffer and is about to be trained on."""

    def on_step_end(self, trainer: Trainer, step: int, metrics: dict[str, float]) -> None:
        """Trained step ``step`` is done: logged, and checkpointed when due; ``metrics`` are this process's."""


class FunctionCallback(Callback):
    """A callback made of plain functions with the signatures of :class:`Callback`'s methods (either may be
    omitted)."""

    def __init__(self, *, on_batch: Optional[Callable[[Trainer, RolloutBatch], None]] = None,
                 on_step_end: Optional[Callable[[Trainer, int, dict], None]] = None):
        self._on_batch, self._on_step_end = on_batch, on_step_end

    def on_batch(self, trainer: Trainer, batch: RolloutBatch) -> None:
        if self._on_batch is not None:
            self._on_batch(trainer, batch)

    def on_step_end(self, trainer: Trainer, step: int, metrics: dict[str, float]) -> None:
        if self._on_step_end is not None:
            self._on_step_end(trainer, step, metrics)


class CallbackList(Callback):
    """Several callbacks called in order."""

    def __init__(self, callbacks: Optional[Iterable[Callback]] = None):
        self.callbacks = list(callbacks or [])
        for cb in self.callbacks:
            if not isinstance(cb, Callback):
                raise TypeError(f"callbacks must be offpolicy_moe.trainer.callbacks.Callback instances, got "
                                f"{type(cb).__name__}")

    def on_batch(self, trainer: Trainer, batch: RolloutBatch) -> None:
        for cb in self.callbacks:
            cb.on_batch(trainer, batch)

    def on_step_end(self, trainer: Trainer, step: int, metrics: dict[str, float]) -> None:
        for cb in self.callbacks:
            cb.on_step_end(trainer, step, metrics)
