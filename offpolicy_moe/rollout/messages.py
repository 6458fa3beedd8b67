"""The messages between the trainer and its rollout workers, and how they travel.

Orders go down (:class:`Order` for a whole iteration, :class:`GroupOrder` for one group of a stream,
:class:`Shutdown`); results come up (:class:`WorkerReady`, :class:`BatchDone` / :class:`BatchNonFinite` from a
worker, :class:`GroupDone` / :class:`GroupsNonFinite` from a streaming worker, :class:`WorkerFailed` from either
before it exits).  :class:`WorkerSpec` is what a worker is started with.  Results cross a pipe as ``torch.save``
bytes (:func:`pack` / :func:`unpack`; a worker killed mid-send corrupts nothing shared), and :func:`send_timed`
measures the packing and the time blocked on a full pipe.
"""
from __future__ import annotations

import io
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch

__all__ = ["Order", "GroupOrder", "Shutdown", "WorkerSpec", "WorkerReady", "BatchDone", "BatchNonFinite",
           "GroupDone", "GroupsNonFinite", "WorkerFailed", "pack", "send_timed", "unpack"]


@dataclass(frozen=True)
class Order:
    """Generate iteration ``iteration`` with sampling seed ``seed`` using policy version ``>= min_version``
    (``attempt`` counts re-issues of a dropped or lost iteration)."""

    iteration: int
    seed: int
    min_version: int
    attempt: int = 0


@dataclass(frozen=True)
class Shutdown:
    """The trainer's last message to a worker: finish and exit."""


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs besides its pipes and the weight board."""

    cfg: Any                    # the run's TrainConfig
    index: int                  # worker number on this trainer process
    rank: int                   # the trainer process whose share of the prompts it generates
    world: int
    parent_pid: int             # the trainer process (the worker's OS parent is the fork server)
    threads: int = 1
    weight_timeout_s: float = 600.0
    update_in_flight: bool = False
    probe: Any = None           # a test probe's hand-off (run/probes.py); None in every real run
    # environment set before anything else (its GPU: CUDA_VISIBLE_DEVICES, rollout/devices.py); None: inherited
    env: Optional[dict] = None


@dataclass(frozen=True)
class WorkerReady:
    """A worker built its engine and waits for orders."""

    index: int
    pid: int


@dataclass(frozen=True)
class BatchDone:
    """The batch of ``iteration`` (order ``attempt``), as :meth:`RolloutBatch.state_dict`, with the worker's
    ``timings``: ``wait_s`` (for the order and its weights), ``sync_s`` (loading them), ``generate_s``, ``cpu_s``,
    and, of the message sent before this one, ``pack_s`` and ``send_s`` (blocked on a full pipe): a local worker's
    seconds between two orders are the sum of these parts."""

    index: int
    iteration: int
    attempt: int
    state: dict
    timings: dict


@dataclass(frozen=True)
class BatchNonFinite:
    """Sampling of ``iteration`` (order ``attempt``) met non-finite values at ``stage`` (``what``); the worker goes
    on."""

    index: int
    iteration: int
    attempt: int
    stage: str
    what: str


@dataclass(frozen=True)
class WorkerFailed:
    """The worker failed at ``iteration`` (-1 before its first order) with ``traceback_text``; it exits."""

    index: int
    iteration: int
    traceback_text: str


def pack(obj: Any) -> bytes:
    """``torch.save`` bytes of ``obj`` (what goes through a worker's pipe)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def send_timed(results: Any, msg: Any) -> dict[str, float]:
    """Pack ``msg`` and send it on the pipe ``results``; returns ``{"pack_s", "send_s"}``, the seconds spent
    packing it and blocked writing it (a full pipe: the reader is behind)."""
    t0 = time.perf_counter()
    data = pack(msg)
    t1 = time.perf_counter()
    results.send_bytes(data)
    return {"pack_s": t1 - t0, "send_s": time.perf_counter() - t1}


def unpack(data: bytes) -> Any:
    """Inverse of :func:`pack`."""
    return torch.load(io.BytesIO(data), weights_only=False)


@dataclass(frozen=True)
class GroupOrder:
    """Generate group ``group`` (attempt ``attempt``; re-issues count up) with sampling seed ``seed``."""

    group: int
    seed: int
    attempt: int = 0


@dataclass(frozen=True)
class GroupDone:
    """Group ``group``'s ``G`` samples as :meth:`RolloutBatch.state_dict`, with the worker's ``timings`` since its
    previous message (``generate_s``, ``wait_s``, ``cpu_s``, ``tokens``: response tokens finished meanwhile)."""

    index: int
    group: int
    attempt: int
    state: dict
    timings: dict


@dataclass(frozen=True)
class GroupsNonFinite:
    """Sampling met NaN/Inf at ``stage`` (``what``); ``groups`` (with their ``attempts``) were in the slots and are
    lost; the worker goes on."""

    index: int
    groups: tuple[int, ...]
    attempts: tuple[int, ...]
    stage: str
    what: str
