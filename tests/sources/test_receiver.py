"""The process transport reads its workers' result pipes while the trainer is busy elsewhere: a worker whose
results exceed what a pipe holds finishes sending without the trainer asking for them, and the trainer then
receives them all intact; deaths are still reported after everything the worker sent, with the reason it gave
(or how it ended); and close() leaves no thread and no process behind.  The workers are stand-ins
(tests/sources/flood_worker.py) writing to the transport's real pipes the way a rollout worker does."""
from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Optional

import torch

from offpolicy_moe.sources.process_transport import ProcessTransport
from offpolicy_moe.sources.transport import WorkerLost
from offpolicy_moe.rollout.messages import GroupDone
from tests.sources import flood_worker
from tests.tiny import tiny_config

START_S = 180.0        # a fork server's first start imports torch and transformers: generous on a loaded machine
SEND_S = 30.0          # 1 MiB into a pipe that is read as it fills: generous, no speed assumed


def _wait_for(path: Path, bound: float) -> bool:
    deadline = time.monotonic() + bound
    while time.monotonic() < deadline:
        if path.exists():
            return True
        time.sleep(0.05)
    return path.exists()


def _receivers(transport: Optional[ProcessTransport] = None) -> list[threading.Thread]:
    """The live result-reading threads; with ``transport``, those started since it was made (another test's
    transport may still be ending its own)."""
    before = getattr(transport, "_threads_before", set())
    return [t for t in threading.enumerate() if t.name.startswith("offpolicy-moe-results") and t.is_alive()
            and t not in before]


def _transport(tmp_path, monkeypatch, stand_in) -> ProcessTransport:
    cfg = tiny_config(tmp_path, "buffer.mode=async", "buffer.staleness=0", "rollout.worker_timeout_s=5")
    transport = ProcessTransport(cfg, entry=stand_in)
    transport._threads_before = set(_receivers())
    return transport


def _spawned(transport: ProcessTransport, tmp_path: Path) -> None:
    """Spawn worker 0 and wait until it runs (the fork server's start is not what the tests bound)."""
    transport.spawn(0)
    assert _wait_for(tmp_path / "started-0", START_S), "the stand-in worker never started"


def _receive_all(transport: ProcessTransport, until: int, bound: float = 60.0) -> list:
    events: list = []
    deadline = time.monotonic() + bound
    while time.monotonic() < deadline and len(events) < until:
        events.extend(transport.receive(timeout=0.5))
    return events


def _assert_intact(events: list) -> None:
    groups = [e for e in events if isinstance(e, GroupDone)]
    assert [e.group for e in groups] == list(range(flood_worker.GROUPS))
    for e in groups:
        assert e.index == 0 and torch.equal(e.state["x"], flood_worker.payload(e.group))


def test_a_worker_finishes_sending_more_than_a_pipe_holds_while_the_trainer_does_not_receive(tmp_path,
                                                                                              monkeypatch):
    transport = _transport(tmp_path, monkeypatch, flood_worker.flood)
    try:
        _spawned(transport, tmp_path)
        # the trainer is busy: it does not call receive while the worker sends 1 MiB through a 64 KiB pipe
        assert _wait_for(tmp_path / "sent-0", SEND_S), "the worker was still blocked on a full result pipe"
        events = _receive_all(transport, flood_worker.GROUPS)
        _assert_intact(events)
        assert list(transport.receive(timeout=0)) == []
        assert transport.alive(0)
    finally:
        transport.close(timeout=10)
    assert _receivers(transport) == []
    assert not transport._procs


def test_close_ends_the_receiving_thread_and_the_workers(tmp_path, monkeypatch):
    transport = _transport(tmp_path, monkeypatch, flood_worker.flood)
    try:
        _spawned(transport, tmp_path)
        assert len(_receivers(transport)) == 1
        proc = transport._procs[0].proc
    finally:
        t0 = time.monotonic()
        transport.close(timeout=10)
    assert _receivers(transport) == [] and not proc.is_alive()
    assert time.monotonic() - t0 < 10 + 2 + 2 + 5 + 5          # every join is bounded
    transport.close()                                           # idempotent


def test_a_worker_error_is_the_reason_of_its_death_reported_after_all_it_sent(tmp_path, monkeypatch):
    transport = _transport(tmp_path, monkeypatch, flood_worker.flood_then_fail)
    try:
        _spawned(transport, tmp_path)
        assert _wait_for(tmp_path / "sent-0", SEND_S)
        events = _receive_all(transport, flood_worker.GROUPS + 1)
        _assert_intact(events[:-1])
        assert events[-1] == WorkerLost(0, "RuntimeError: the stand-in failed on purpose")
        transport.retire(0)
        assert list(transport.receive(timeout=0.2)) == []
    finally:
        transport.close()
    assert _receivers(transport) == []


def test_a_killed_worker_is_reported_by_its_exit_status_after_all_it_sent(tmp_path, monkeypatch):
    transport = _transport(tmp_path, monkeypatch, flood_worker.flood_then_hang)
    try:
        _spawned(transport, tmp_path)
        assert _wait_for(tmp_path / "sent-0", SEND_S)
        os.kill(transport.pids()[0], signal.SIGKILL)
        events = _receive_all(transport, flood_worker.GROUPS + 1)
        _assert_intact(events[:-1])
        assert events[-1] == WorkerLost(0, "killed by SIGKILL")
        transport.retire(0)
    finally:
        transport.close()
    assert _receivers(transport) == []


def test_receive_waits_at_most_its_timeout_when_nothing_comes(tmp_path, monkeypatch):
    transport = _transport(tmp_path, monkeypatch, flood_worker.flood)
    try:
        _spawned(transport, tmp_path)
        assert _wait_for(tmp_path / "sent-0", SEND_S)
        _assert_intact(_receive_all(transport, flood_worker.GROUPS))
        t0 = time.monotonic()
        assert list(transport.receive(timeout=0.3)) == []
        assert 0.25 <= time.monotonic() - t0 < 30
    finally:
        transport.close()
