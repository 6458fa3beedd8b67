"""The seam between the training loop and where its batches come from.

:meth:`~offpolicy_moe.trainer.trainer.Trainer.loop` is the only training loop.  At step ``t`` it asks its
:class:`BatchSource` for the batch to train on, trains, and publishes the new weights as version ``t + 1``::

    prepared, metrics = source.next(t)    # a PreparedBatch: the batch with its old log-probs, or an error
    ...update...
    source.publish(weights, t + 1)

A source generates (in this process, through a delay line, or in workers running ahead), hands each batch to the
:class:`Preparation` it was built with (old log-probs under the weights that generated it), and returns what that
gives: a :class:`PreparedBatch`.  A non-finite batch comes back as a value (its ``error``); the loop applies
``trainer.on_nan`` to it and asks again.  A source never calls into the trainer.  The staleness bound and what a
checkpoint must hold to resume without losing or repeating a batch (:meth:`BatchSource.state_dict`) are the
source's business.
"""
from __future__ import annotations

import abc
from typing import Any, Callable, ClassVar, Mapping, Optional, Protocol

import torch

from offpolicy_moe.config.validate import Findings

from offpolicy_moe.logprobs.stage import PreparedBatch
from offpolicy_moe.rollout.batch import RolloutBatch

__all__ = ["BatchSource", "SourceStopped", "Preparation", "refuse_vllm_in_flight"]


class Preparation(Protocol):
    """What a source hands its batches to (:class:`~offpolicy_moe.logprobs.stage.PreparationStage`)."""

    def prepare(self, batch: RolloutBatch, *, current: int) -> PreparedBatch:
        """``batch`` with its old log-probs, under the weights of the versions that sampled it (``current``: the
        version the trainer's live model holds)."""

    def agree(self, prepared: PreparedBatch) -> PreparedBatch:
        """``prepared`` as every trainer process sees it (one process's error is everyone's); a collective call."""

    def keep(self, version: int, weights: Mapping[str, torch.Tensor]) -> None:
        """Remember ``weights`` as ``version`` for batches it samples after the trainer moved on."""

    def weights(self, version: int) -> Mapping[str, torch.Tensor]:
        """The weights kept as ``version``."""


class SourceStopped(RuntimeError):
    """The source cannot go on and its configuration says stop (e.g. a rollout worker died under
    ``rollout.on_worker_death=stop``); the loop checkpoints and ends the run with status ``stopped``."""


def refuse_vllm_in_flight(cfg: Any, found: Findings) -> None:
    """``rollout.update_in_flight`` with the vLLM engine outside a stream: vLLM takes new weights between whole
    generations only, so the setting would be silently ignored."""
    if cfg.rollout.engine == "vllm" and cfg.rollout.update_in_flight:
        found.error("rollout.update_in_flight=true with rollout.engine=vllm: vLLM takes new weights between "
                    "generations only, except in a stream (buffer.mode=stream, between engine steps); turn "
                    "update_in_flight off")


class BatchSource(abc.ABC):
    """Where the training loop's batches come from (see module docstring).

    A source class owns its ``buffer.mode`` (:mod:`~offpolicy_moe.sources.modes` maps the name to the class): the
    class attributes and class methods below say what the rest of the run needs to know of it, so that no other
    module tests the mode's name."""

    #: the trainer's process builds the rollout engine and hands it to :meth:`build` (else each worker builds its own)
    builds_engine: ClassVar[bool] = False
    #: what each local worker process runs, ``entry(spec, board, orders, results)`` (None: no worker processes)
    worker_entry: ClassVar[Optional[Callable[..., None]]] = None
    #: keys only this kind of source reads, as ``(dotted key, default)``: set away from the default under another
    #: source, :func:`~offpolicy_moe.sources.modes.check_mode` warns that they have no effect
    reads: ClassVar[tuple[tuple[str, Any], ...]] = ()

    @classmethod
    @abc.abstractmethod
    def build(cls, cfg: Any, *, engine: Any, task: Any, model: torch.nn.Module, stage: Preparation, rank: int,
              world: int, pad_id: int) -> "BatchSource":
        """The source of ``cfg`` from everything the trainer built (each class takes what it uses)."""

    @classmethod
    def keeps_versions(cls, cfg: Any) -> int:
        """How many published versions' weights the preparation stage keeps for the batches this source hands it
        (sampled under versions the trainer has moved past)."""
        return 0

    @classmethod
    def on_policy(cls, cfg: Any) -> bool:
        """Whether every batch is trained by the weights that sampled it (so the old-log-prob pass may be fused
        with the update)."""
        return False

    @classmethod
    def problems(cls, cfg: Any) -> list[str]:
        """The configurations this source cannot run, one line each naming the keys (none by default)."""
        return []

    @classmethod
    def check_rules(cls, cfg: Any, found: Findings) -> None:
        """The configurations this source refuses (``found.error``: its :meth:`problems`, by default) or would
        silently not honour (``found.warn``); one line each, naming the keys."""
        for msg in cls.problems(cfg):
            found.error(msg)

    @classmethod
    def check_engine(cls, cfg: Any, model_config: Any) -> None:
        """What this source asks of the rollout engine beyond the engine's own checks, before any engine starts (a
        one-line ``ValueError``)."""

    #: generation iterations completed (a checkpointed counter; the fixed delay line runs ``k`` ahead of the step)
    iteration: int = 0

    @abc.abstractmethod
    def next(self, step: int) -> tuple[PreparedBatch, dict[str, float]]:
        """The prepared batch trained step ``step`` consumes (or a non-finite batch's error: the loop applies
        ``trainer.on_nan`` and asks again), and the source's metrics of getting it (``perf/*``, ``async/*``)."""

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
