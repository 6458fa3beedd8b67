"""A worker's seconds are all accounted: packing and blocked sends are measured, and the stream's clock partitions
its wall time (no part counted twice, no period left open)."""
from __future__ import annotations

import threading
import time

import pytest

from offpolicy_moe.rollout.messages import BatchDone, send_timed, unpack
from offpolicy_moe.rollout import stream_worker

HELD_S = 0.2


class _HeldPipe:
    """A result pipe whose reader is busy: ``send_bytes`` returns only once ``release`` is set, and records how
    long it held the writer (``held_s``)."""

    def __init__(self):
        self.release = threading.Event()
        self.sent: list[bytes] = []
        self.held_s = 0.0

    def send_bytes(self, data: bytes) -> None:
        t0 = time.perf_counter()
        assert self.release.wait(60), "the test never released the pipe"
        self.sent.append(data)
        self.held_s = time.perf_counter() - t0


def test_a_blocked_send_is_counted_as_send_time():
    pipe = _HeldPipe()
    timer = threading.Timer(HELD_S, pipe.release.set)
    t0 = time.perf_counter()
    timer.start()
    spent = send_timed(pipe, BatchDone(0, 3, 0, {"x": 1}, {"wait_s": 0.0}))
    total = time.perf_counter() - t0
    assert set(spent) == {"pack_s", "send_s"}
    assert pipe.held_s > 0.0
    assert spent["send_s"] >= pipe.held_s                  # every second the pipe held the writer counts as sent
    assert spent["pack_s"] + spent["send_s"] <= total
    assert unpack(pipe.sent[0]) == BatchDone(0, 3, 0, {"x": 1}, {"wait_s": 0.0})


def test_the_stream_clock_partitions_its_wall_time(monkeypatch):
    now = {"t": 100.0}
    monkeypatch.setattr(stream_worker.time, "perf_counter", lambda: now["t"])
    clock = stream_worker._Clock()
    now["t"] += 1.0
    clock.generate_s += 0.5
    clock.wait_s += 0.25
    clock.pack_s += 0.125
    clock.send_s += 0.0625
    first = clock.report()
    assert first["wall_s"] == pytest.approx(1.0)
    assert first["generate_s"] + first["wait_s"] + first["pack_s"] + first["send_s"] <= first["wall_s"]
    now["t"] += 2.0
    second = clock.report()                     # a new period: nothing carried over, the wall restarts
    assert second["wall_s"] == pytest.approx(2.0)
    assert second["generate_s"] == second["wait_s"] == second["pack_s"] == second["send_s"] == 0.0
