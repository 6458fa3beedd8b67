"""The seam between the training loop and where its batches come from.

:meth:`~offpolicy_moe.trainer.trainer.Trainer.loop` is the only training loop.  At step ``t`` it asks its
:class:`BatchSource` for the batch to train on, trains, and publishes the new weights as version ``t + 1``::

    batch, metrics = source.next(t)       # prepared: old log-probs taken under the weights that generated it
    ...update...
    source.publish(weights, t + 1)

Whether that batch was generated just now by the trainer's own engine (:class:`~.sync.SyncBatchSource`), ``k``
steps ago through a delay line, or by worker processes running ahead (:class:`~.asynchronous.AsyncBatchSource`)
is the source's business; so are the staleness bound and what a checkpoint must hold to resume without losing or
repeating a batch (:meth:`BatchSource.state_dict`).  The loop writes the ``offpolicy/*`` metrics once, from the
batch's per-token versions.
"""
from __future__ import annotations

import abc
from typing import Mapping, Optional

import torch

from offpolicy_moe.rollout.batch import RolloutBatch

__all__ = ["BatchSource", "SourceStopped"]


class SourceStopped(RuntimeError):
    """The source cannot go on and its configuration says stop (e.g. a rollout worker died under
    ``rollout.on_worker_death=stop``); the loop checkpoints and ends the run with status ``stopped``."""


class BatchSource(abc.ABC):
    """Where the training loop's batches come from (see module docstring)."""

    #: generation iterations completed (a checkpointed counter; the fixed delay line runs ``k`` ahead of the step)
    iteration: int = 0

    @abc.abstractmethod
    def next(self, step: int) -> tuple[RolloutBatch, dict[str, float]]:
        """The prepared batch trained step ``step`` consumes, and the source's metrics of getting it (time spent
        generating, preparing, waiting; ``perf/*``, ``async/*``)."""

    #: the newest version generation has (``rollout.publish_every`` > 1: the last multiple of it)
    published: int = 0

    @abc.abstractmethod
    def publish(self, weights: Mapping[str, torch.Tensor], version: int,
                predictors: Optional[Mapping[str, torch.Tensor]] = None, *, force: bool = False) -> None:
        """``weights`` (and PR2 ``predictors``) are the trainer's policy version ``version``; generation takes them
        when ``version`` is a multiple of ``rollout.publish_every`` (or ``force``).  Publishing the version that
        follows a trained step also completes that step's generation iteration."""

    @abc.abstractmethod
    def state_dict(self) -> dict:
        """Everything the source holds between steps (its counters, batches received and not trained on, with their
        versions and routes), as tensors and plain values."""

    @abc.abstractmethod
    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`; a state of another kind of source or another staleness is refused in one
        line."""

    @property
    @abc.abstractmethod
    def dropped(self) -> int:
        """Batches dropped for exceeding the staleness bound so far."""

    @abc.abstractmethod
    def __len__(self) -> int:
        """Batches held: received (and prepared) but not yet trained on."""

    def close(self) -> None:
        """Stop whatever the source started (worker processes); idempotent."""
