"""The seam between the asynchronous source and its rollout workers: what a worker transport does, and what it reports.

:class:`~offpolicy_moe.sources.asynchronous.AsyncBatchSource` decides everything that is trained (which iteration
goes out when, which batch is kept, the old-log-prob pass, the checkpoint, what a worker's death leads to); a
:class:`WorkerTransport` only moves things between the trainer and its workers, wherever they run:

* :meth:`~WorkerTransport.start` — set up the weight channel with the first published version;
* :meth:`~WorkerTransport.spawn` / :meth:`~WorkerTransport.retire` — start a worker in a slot, let a dead one go;
* :meth:`~WorkerTransport.send` — hand a worker an :class:`~offpolicy_moe.rollout.worker.Order`;
* :meth:`~WorkerTransport.publish` — make a new version of the weights available to the workers;
* :meth:`~WorkerTransport.receive` — what came back: :class:`~offpolicy_moe.rollout.worker.BatchDone`,
  :class:`~offpolicy_moe.rollout.worker.BatchNonFinite` or :class:`WorkerLost`, produced one at a time so that the
  source's answer to one (a restart, say) is seen by the next;
* :meth:`~WorkerTransport.alive`, :meth:`~WorkerTransport.describe`, :meth:`~WorkerTransport.pids` — for messages;
* :meth:`~WorkerTransport.close` — stop every worker.

:class:`PublishesToWorkers` is the publishing both worker-fed sources share (the asynchronous and the streaming one).

Two transports exist: worker processes on this machine
(:class:`~offpolicy_moe.sources.process_transport.ProcessTransport`) and Ray actors
(:class:`~offpolicy_moe.sources.ray_transport.RayTransport`, ``rollout.backend=ray``).
"""
from __future__ import annotations

from dataclasses import dataclass
import sys
from typing import Any, Callable, Iterator, Mapping, Optional, Protocol, Union

import torch

from offpolicy_moe.rollout.messages import GroupDone, GroupsNonFinite
from offpolicy_moe.rollout.messages import BatchDone, BatchNonFinite, Order
from offpolicy_moe.sources.base import SourceStopped

__all__ = ["WorkerTransport", "WorkerLost", "Event", "WorkerDied", "PipelineTimeout", "MAX_RESTARTS", "handle_events",
           "restart_or_stop", "PublishesToWorkers"]

MAX_RESTARTS = 3          # per worker slot; then the run stops with a checkpoint


class WorkerDied(SourceStopped):
    """A rollout worker died (or reported an error) and the configuration says stop."""


class PipelineTimeout(TimeoutError):
    """The trainer waited longer than ``rollout.worker_timeout_s`` for a batch (or for a worker to start)."""


@dataclass(frozen=True)
class WorkerLost:
    """The worker of slot ``index`` is gone: ``reason`` says why, in a few words; ``node_lost`` when the machine
    it ran on left the cluster (Ray only)."""

    index: int
    reason: str
    node_lost: bool = False


Event = Union[BatchDone, BatchNonFinite, GroupDone, GroupsNonFinite, WorkerLost]


class WorkerTransport(Protocol):
    """Moves orders, weights and results between the trainer and its rollout workers (see module docstring).
    Worker slots are numbered ``0 .. rollout.workers - 1``; a restarted worker takes its slot's number again."""

    noun: str
    """What a worker is called in messages: ``"worker"`` or ``"actor"``."""

    def start(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        """Set up the weight channel holding ``weights`` as ``version`` (before the first :meth:`spawn`)."""

    def spawn(self, index: int, restarts: int = 0) -> None:
        """Start a worker in slot ``index`` (its ``restarts``-th replacement); raise :class:`PipelineTimeout` or
        :class:`WorkerDied` when it cannot start."""

    def send(self, index: int, order: Order) -> None:
        """Hand ``order`` to the worker of slot ``index`` (a dead worker's order is lost: its death is reported
        by :meth:`receive`)."""

    def publish(self, weights: Mapping[str, torch.Tensor], version: int) -> float:
        """Make ``weights`` available to the workers as ``version``; returns the seconds spent."""

    def receive(self, timeout: float) -> Iterator[Event]:
        """What the workers sent, and the deaths seen, within ``timeout`` seconds (nothing when nothing came)."""

    def retire(self, index: int) -> None:
        """Let go of the dead worker of slot ``index`` (after its :class:`WorkerLost`)."""

    def alive(self, index: int) -> bool:
        """Whether the worker of slot ``index`` is still running as far as the transport knows."""

    def describe(self, index: int, detail: str = "") -> str:
        """The worker of slot ``index`` named for a message, e.g. ``rollout worker 0 (pid 123)``; ``detail`` is
        added inside the parentheses."""

    def pids(self) -> list[int]:
        """Process ids of the live workers, in slot order."""

    def close(self, timeout: float = 5.0) -> None:
        """Stop every worker (waiting up to ``timeout`` seconds where that applies); idempotent."""


def handle_events(transport: WorkerTransport, timeout: float, handlers: Mapping[type, Callable[[Any], None]],
                  who: str) -> bool:
    """Hand each event the transport receives within ``timeout`` seconds to the handler of its type, in order;
    True if any came.  :class:`TypeError` naming ``who`` for an event no handler takes."""
    got = False
    for event in transport.receive(timeout):
        got = True
        handler = handlers.get(type(event))
        if handler is None:
            raise TypeError(f"{who}: unexpected message {type(event).__name__} from a transport")
        handler(event)
    return got


def restart_or_stop(transport: WorkerTransport, index: int, restarts: int, msg: str, on_death: str) -> int:
    """The worker of slot ``index`` died (``msg`` says how; it was restarted ``restarts`` times): start it again
    and return its new restart count, or raise :class:`WorkerDied` under ``rollout.on_worker_death=stop`` or after
    :data:`MAX_RESTARTS` restarts."""
    if on_death == "stop" or restarts >= MAX_RESTARTS:
        why = "rollout.on_worker_death=stop" if on_death == "stop" else f"{MAX_RESTARTS} restarts"
        raise WorkerDied(f"{msg}; stopping ({why})")
    print(f"offpolicy-moe: {msg}; restarting it (rollout.on_worker_death=restart)", file=sys.stderr)
    transport.spawn(index, restarts + 1)
    return restarts + 1


class PublishesToWorkers:
    """``publish`` of a source whose workers read the weights through a :class:`WorkerTransport` (the asynchronous
    and the streaming source).  The source holds ``version``, ``published``, ``publish_every``, ``stage``,
    ``transport``, ``timing``, ``early_start`` and ``_started``, and says what follows a publish
    (:meth:`_after_publish`) and how its workers start early (:meth:`_start_early`)."""

    @classmethod
    def keeps_versions(cls, cfg: Any) -> int:
        """``k + 1``: the workers sample ahead, so a token may come from any of the last ``k + 1`` published
        versions, and the preparation stage keeps their weights (:meth:`BatchSource.keeps_versions`)."""
        return int(cfg.buffer.staleness) + 1

    def publish(self, weights: Mapping[str, torch.Tensor], version: int,
                predictors: Optional[Mapping[str, torch.Tensor]] = None, *, force: bool = False) -> None:
        """``weights`` are the trainer's version ``version``; when it is a multiple of ``rollout.publish_every``
        (or ``force``) it goes to the stage's ring of published versions (the old-log-prob pass of what it
        generates) and to the workers (through the transport, once they run), and then :meth:`_after_publish`
        hands out new work; before the workers run, ``rollout.early_start`` starts them now."""
        self.version = int(version)
        if not (force or version % self.publish_every == 0):
            return
        self.stage.keep(version, weights)
        self.published = int(version)
        if self._started:
            self.timing["weight_sync_s"] += self.transport.publish(weights, version)
            self._after_publish(int(version))
        elif self.early_start:
            self._start_early()

    def _after_publish(self, version: int) -> None:
        raise NotImplementedError

    def _start_early(self) -> None:
        raise NotImplementedError
