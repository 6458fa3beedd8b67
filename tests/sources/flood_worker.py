"""Stand-ins for a rollout worker process of :class:`~offpolicy_moe.sources.process_transport.ProcessTransport`
(the tests of tests/sources/test_receiver.py start them in its place): each writes its results to the real result
pipe the way a worker does (``send_bytes`` of :func:`~offpolicy_moe.rollout.worker.pack`), more bytes than a pipe
holds, and leaves files in the run directory saying how far it got."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from offpolicy_moe.rollout.messages import WorkerFailed, WorkerReady, pack
from offpolicy_moe.rollout.messages import GroupDone

GROUPS = 16
ROWS, COLS = 128, 128          # 64 KiB of float32 a group: 1 MiB in all, a pipe holds 64 KiB


def payload(group: int) -> torch.Tensor:
    """The tensor group ``group`` carries."""
    return torch.arange(ROWS * COLS, dtype=torch.float32).view(ROWS, COLS) + group


def _mark(spec: Any, what: str) -> None:
    Path(spec.cfg.run_dir, f"{what}-{spec.index}").write_text(str(time.time()))


def _flood(spec: Any, results: Any) -> None:
    _mark(spec, "started")
    results.send_bytes(pack(WorkerReady(spec.index, 0)))
    for g in range(GROUPS):
        results.send_bytes(pack(GroupDone(spec.index, g, 0, {"x": payload(g)}, {"tokens": 1.0})))
    _mark(spec, "sent")


def flood(spec: Any, board: Any, orders: Any, results: Any) -> None:
    """Send :data:`GROUPS` groups, mark ``sent-<index>``, then wait (at most 120 s) for the trainer's order to
    stop."""
    _flood(spec, results)
    if orders.poll(120):
        orders.recv()


def flood_then_fail(spec: Any, board: Any, orders: Any, results: Any) -> None:
    """Send :data:`GROUPS` groups, then an error report, and exit with code 1."""
    _flood(spec, results)
    results.send_bytes(pack(WorkerFailed(spec.index, GROUPS, "Traceback (most recent call last):\n"
                                                             "RuntimeError: the stand-in failed on purpose\n")))
    raise SystemExit(1)


def flood_then_hang(spec: Any, board: Any, orders: Any, results: Any) -> None:
    """Send :data:`GROUPS` groups, then sleep (at most 120 s) until killed."""
    _flood(spec, results)
    time.sleep(120)
