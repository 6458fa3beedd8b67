"""Rollout workers as processes on this machine: the asynchronous source's default transport (``rollout.backend=local``).

Each worker is a ``forkserver`` process (:mod:`.fork_server`) running
:func:`~offpolicy_moe.rollout.worker.worker_main`, with its own pipe for orders and one for results (``torch.save``
bytes, so a worker killed mid-send corrupts nothing shared).
Weights go through one :class:`~offpolicy_moe.rollout.weights.WeightBoard` in shared memory.  A worker's death is
seen through its process sentinel, waited on beside the result pipes; the error it reported before exiting
(:class:`~offpolicy_moe.rollout.worker.WorkerFailed`), else its exit status, is the reason given.
"""
from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from multiprocessing.connection import wait as wait_any
from typing import Any, Iterator, Mapping, Optional

import torch

from offpolicy_moe.rollout.devices import worker_environment
from offpolicy_moe.streaming.stream_worker import GroupDone, GroupsNonFinite, stream_main
from offpolicy_moe.rollout.weights import WeightBoard
from offpolicy_moe.rollout.worker import (BatchDone, BatchNonFinite, Order, Shutdown, WorkerFailed, WorkerSpec,
                                          pid_alive, unpack, worker_main)
from offpolicy_moe.run import probes
from offpolicy_moe.sources import fork_server
from offpolicy_moe.sources.transport import Event, WorkerLost

__all__ = ["ProcessTransport", "exit_reason"]


@dataclass
class _Proc:
    proc: Any
    orders: Any                   # trainer -> worker connection
    results: Any                  # worker -> trainer connection
    error: str = ""               # the last line of the traceback the worker reported before exiting

    def failed(self, traceback_text: str) -> None:
        """The worker reported ``traceback_text`` before exiting."""
        text = traceback_text.strip()
        self.error = text.splitlines()[-1] if text else "unknown error"


def exit_reason(code: Optional[int]) -> str:
    """A process's exit status in words: ``exited with code 1``, ``killed by SIGKILL``, ``stopped answering``."""
    if code is None:
        return "stopped answering"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


class ProcessTransport:
    """Worker processes of trainer process ``rank`` (of ``world``) on this machine (see module docstring)."""

    noun = "worker"

    def __init__(self, cfg: Any, *, rank: int = 0, world: int = 1):
        self.cfg, self.rank, self.world = cfg, int(rank), int(world)
        self.timeout = float(cfg.rollout.worker_timeout_s)
        self._ctx = fork_server.context()
        self._board: Optional[WeightBoard] = None
        self._procs: dict[int, _Proc] = {}

    def start(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        """The shared weight board, holding ``weights`` as ``version``."""
        self._board = WeightBoard(weights, self._ctx)
        self._board.publish(weights, version)

    def spawn(self, index: int, restarts: int = 0) -> None:
        """Start worker process ``index`` (``restarts`` does not change how), on its own GPU when its engine is
        vLLM and this machine has GPUs (:func:`~offpolicy_moe.rollout.devices.worker_environment`)."""
        o_recv, o_send = self._ctx.Pipe(duplex=False)
        r_recv, r_send = self._ctx.Pipe(duplex=False)
        ro = self.cfg.rollout
        spec = WorkerSpec(cfg=self.cfg, index=index, rank=self.rank, world=self.world, parent_pid=os.getpid(),
                          threads=int(ro.worker_threads), weight_timeout_s=self.timeout,
                          update_in_flight=bool(ro.update_in_flight), probe=probes.handoff(),
                          env=worker_environment(self.cfg, rank=self.rank, index=index))
        main = stream_main if self.cfg.buffer.mode == "stream" else worker_main
        proc = self._ctx.Process(target=main, args=(spec, self._board, o_recv, r_send),
                                 name=f"offpolicy-moe-rollout-{self.rank}-{index}", daemon=True)
        proc.start()
        o_recv.close()
        r_send.close()
        self._procs[index] = _Proc(proc=proc, orders=o_send, results=r_recv)

    def send(self, index: int, order: Order) -> None:
        """Write ``order`` to worker ``index``'s pipe; a dead worker's pipe is left to its sentinel."""
        try:
            self._procs[index].orders.send(order)
        except (BrokenPipeError, OSError):
            pass

    def publish(self, weights: Mapping[str, torch.Tensor], version: int) -> float:
        """Write ``weights`` into the board as ``version``; returns the seconds spent."""
        return self._board.publish(weights, version)

    def receive(self, timeout: float) -> Iterator[Event]:
        """Messages from the result pipes that are ready within ``timeout`` seconds, then the deaths (an error
        report is kept as the reason of the death that follows it)."""
        by_conn = {p.results: (i, p) for i, p in self._procs.items()}
        by_sentinel = {p.proc.sentinel: (i, p) for i, p in self._procs.items()}
        got = wait_any(list(by_conn) + list(by_sentinel), timeout=timeout)
        for obj in got:
            if obj not in by_conn:
                continue
            index, p = by_conn[obj]
            try:
                msg = unpack(obj.recv_bytes())
            except (EOFError, OSError):
                continue                    # the process is gone: its sentinel reports it
            if isinstance(msg, WorkerFailed):
                p.failed(msg.traceback_text)
            elif isinstance(msg, (BatchDone, BatchNonFinite, GroupDone, GroupsNonFinite)):
                yield msg
        for obj in got:
            if obj in by_sentinel and self._procs.get(by_sentinel[obj][0]) is by_sentinel[obj][1]:
                index, p = by_sentinel[obj]
                p.proc.join(timeout=5)
                yield WorkerLost(index, self._death_reason(p))

    @staticmethod
    def _death_reason(p: _Proc) -> str:
        reason = p.error or exit_reason(p.proc.exitcode)
        if pid_alive(p.proc.pid):       # its fork server died, so its exit cannot be reported: end it
            reason = "its fork server died (the worker was ended)"
            try:
                os.kill(p.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return reason

    def retire(self, index: int) -> None:
        """Close the dead worker's pipes and forget it."""
        p = self._procs.pop(index)
        p.orders.close()
        p.results.close()

    def alive(self, index: int) -> bool:
        """Whether worker process ``index`` runs."""
        return index in self._procs and self._procs[index].proc.is_alive()

    def describe(self, index: int, detail: str = "") -> str:
        """``rollout worker <index> (pid <pid>[, detail])``."""
        extra = f", {detail}" if detail else ""
        return f"rollout worker {index} (pid {self._procs[index].proc.pid}{extra})"

    def pids(self) -> list[int]:
        """Process ids of the live workers (slot order)."""
        return [self._procs[i].proc.pid for i in sorted(self._procs)]

    def close(self, timeout: float = 5.0) -> None:
        """Tell the workers to stop, wait up to ``timeout`` seconds, then terminate (and kill) those still running."""
        for p in self._procs.values():
            try:
                p.orders.send(Shutdown())
            except (BrokenPipeError, OSError):
                pass
        deadline = time.perf_counter() + timeout
        for p in self._procs.values():
            p.proc.join(timeout=max(deadline - time.perf_counter(), 0.0))
            if p.proc.is_alive():
                p.proc.terminate()
                p.proc.join(timeout=2)
            if p.proc.is_alive():           # stopped or stuck: SIGTERM is not enough
                p.proc.kill()
                p.proc.join(timeout=2)
            p.orders.close()
            p.results.close()
        self._procs = {}
