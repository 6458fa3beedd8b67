"""Rollout workers as processes on this machine: the asynchronous source's default transport (``rollout.backend=local``).

Each worker is a ``forkserver`` process (:mod:`.fork_server`) running the entry its source gives
(:attr:`~offpolicy_moe.sources.base.BatchSource.worker_entry`: :func:`~offpolicy_moe.rollout.worker.worker_main` or
:func:`~offpolicy_moe.rollout.stream_worker.stream_main`), with its own pipe for orders and one for results (``torch.save``
bytes, so a worker killed mid-send corrupts nothing shared).
Weights go through one :class:`~offpolicy_moe.rollout.weights.WeightBoard` in shared memory.

The result pipes are read by a thread of the trainer process (:class:`_Results`) as soon as bytes arrive, so a
worker never stands still on a full pipe while the trainer updates (a step's results are larger than a pipe
holds); the thread only moves bytes onto a queue, and :meth:`ProcessTransport.receive` decodes them in the
trainer's thread (``torch.load`` in a second thread would compete with the trainer's own threads).  A worker's
death is seen through its process sentinel, watched by the same thread beside the result pipes: what the worker
sent before it died is read first, so the error it reported before exiting
(:class:`~offpolicy_moe.rollout.worker.WorkerFailed`), else its exit status, is the reason given.
"""
from __future__ import annotations

import os
import queue
import signal
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import wait as wait_any
from typing import Any, Callable, Iterator, Mapping, Optional

import torch

from offpolicy_moe.rollout.devices import worker_environment
from offpolicy_moe.rollout.messages import GroupDone, GroupsNonFinite
from offpolicy_moe.rollout.weights import WeightBoard
from offpolicy_moe.rollout.messages import BatchDone, BatchNonFinite, Order, Shutdown, WorkerFailed, WorkerSpec, unpack
from offpolicy_moe.rollout.worker import pid_alive
from offpolicy_moe.run import probes
from offpolicy_moe.sources import fork_server
from offpolicy_moe.sources.transport import Event, WorkerLost

__all__ = ["ProcessTransport", "exit_reason"]


@dataclass(eq=False)
class _Proc:
    index: int
    proc: Any
    orders: Any                   # trainer -> worker connection
    results: Any                  # worker -> trainer connection (read by the :class:`_Results` thread alone)
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


@dataclass(eq=False)
class _Watch:
    """What the :class:`_Results` thread knows of one worker: whether its result pipe and its sentinel are still
    watched, whether the thread is reading the pipe now, and whether the pipe was let go meanwhile."""

    p: _Proc
    pipe_open: bool = True
    sentinel_open: bool = True
    reading: bool = False
    forgotten: bool = False

    def set_reading(self, on: bool) -> None:
        """The thread reads the pipe now (``on``), or no longer."""
        self.reading = on

    def forget(self) -> None:
        """The trainer let the worker go: its pipe is closed by whoever touches it last."""
        self.forgotten = True

    def pipe_ended(self) -> None:
        """The pipe gave end-of-file: the process is gone, and its sentinel reports it."""
        self.pipe_open = False

    def ended(self) -> None:
        """The death was queued: nothing of this worker is watched any more."""
        self.pipe_open = self.sentinel_open = False


class _Results:
    """The trainer's receiving end of every worker's result pipe: a thread (named ``name``) reads each pipe as soon
    as bytes arrive and each process sentinel as soon as it fires, and puts ``(worker, bytes)`` (``bytes`` None
    for the worker's death, after everything it sent) on a queue that :meth:`take` serves.  The thread runs while
    something is watched, and ends at :meth:`stop`; it owns the reading of the result pipes, :meth:`forget` their
    closing."""

    def __init__(self, name: str):
        self.name = name
        self._lock = threading.Lock()
        self._watched: dict[int, _Watch] = {}           # id(_Proc) -> its watch
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None
        self._halt = threading.Event()
        self._wake: Optional[tuple[int, int]] = None    # a pipe that makes the thread look again at what it watches

    def watch(self, p: _Proc) -> None:
        """Read ``p``'s results and watch its sentinel from now on (starting the thread when it does not run)."""
        with self._lock:
            if self._wake is None:
                self._wake = os.pipe()
                for fd in self._wake:
                    os.set_blocking(fd, False)
            self._watched[id(p)] = _Watch(p, sentinel_open=p.proc.sentinel is not None)
            if self._thread is None:
                self._halt = threading.Event()
                self._thread = threading.Thread(target=self._run, args=(self._halt,), name=self.name, daemon=True)
                self._thread.start()
        self._poke()

    def forget(self, p: _Proc) -> None:
        """Stop watching ``p`` and close its result pipe (once the thread no longer reads it)."""
        with self._lock:
            w = self._watched.pop(id(p), None)
            if w is None:
                p.results.close()
                return
            w.forget()
            if not w.reading:
                p.results.close()
        self._poke()

    def take(self, timeout: float) -> list[tuple[_Proc, Optional[bytes]]]:
        """What came within ``timeout`` seconds: the first arrival, and all that is queued behind it."""
        try:
            items = [self._queue.get(timeout=timeout) if timeout > 0 else self._queue.get_nowait()]
        except queue.Empty:
            return []
        for _ in range(self._queue.qsize()):
            try:
                items.append(self._queue.get_nowait())
            except queue.Empty:
                break
        return items

    def stop(self, timeout: float = 5.0) -> None:
        """End the thread (waiting up to ``timeout`` seconds), close every result pipe still watched and forget
        what was queued; the thread starts again at the next :meth:`watch`."""
        with self._lock:
            thread, self._thread = self._thread, None
            self._halt.set()
        self._poke()
        if thread is not None:
            thread.join(timeout=timeout)
        for p in [w.p for w in self._watched.values()]:
            self.forget(p)
        with self._lock:
            wake, self._wake = self._wake, None
        if wake is not None:
            for fd in wake:
                os.close(fd)
        self._queue = queue.SimpleQueue()

    def _poke(self) -> None:
        with self._lock:
            if self._wake is None:
                return
            try:
                os.write(self._wake[1], b"\0")
            except BlockingIOError:
                pass                                    # a wake-up is pending already

    # ------------------------------------------------------------------ the thread
    def _run(self, halt: threading.Event) -> None:
        try:
            while not halt.is_set():
                looked = self._objects(halt)
                if looked is None:
                    return
                wake, by_pipe, by_sentinel = looked
                try:
                    ready = wait_any([wake, *by_pipe, *by_sentinel], timeout=1.0)
                except (OSError, ValueError):           # a pipe was closed meanwhile: look again
                    time.sleep(0.01)
                    continue
                self._handle(ready, wake, by_pipe, by_sentinel)
        finally:
            with self._lock:
                if self._thread is threading.current_thread():
                    self._thread = None

    def _objects(self, halt: threading.Event) -> Optional[tuple[int, dict, dict]]:
        """The wake pipe, the open result pipes and the sentinels to watch; None (the thread ends) when halted or
        when nothing is left to watch."""
        with self._lock:
            watched = list(self._watched.values())
            if halt.is_set() or self._wake is None or not any(w.pipe_open or w.sentinel_open for w in watched):
                if self._thread is threading.current_thread():
                    self._thread = None
                return None
            by_pipe = {w.p.results: w for w in watched if w.pipe_open and not w.p.results.closed}
            by_sentinel = {w.p.proc.sentinel: w for w in watched if w.sentinel_open}
            return self._wake[0], by_pipe, by_sentinel

    def _handle(self, ready: list, wake: int, by_pipe: dict, by_sentinel: dict) -> None:
        if wake in ready:
            try:
                while os.read(wake, 4096):
                    pass
            except (BlockingIOError, OSError):
                pass
        for obj in ready:
            if obj in by_pipe:
                self._read(by_pipe[obj], if_ready=False)
        for obj in ready:
            if obj in by_sentinel:
                self._lost(by_sentinel[obj])

    def _read(self, w: _Watch, *, if_ready: bool) -> bool:
        """Read one message of ``w``'s pipe onto the queue (only when one waits, ``if_ready``); False when
        nothing was read (the pipe is empty, ended, or let go)."""
        with self._lock:
            if w.forgotten or not w.pipe_open:
                return False
            w.set_reading(True)
        data: Optional[bytes] = None
        try:
            if not if_ready or w.p.results.poll(0):
                data = w.p.results.recv_bytes()
        except (EOFError, OSError):
            w.pipe_ended()
        finally:
            with self._lock:
                w.set_reading(False)
                if w.forgotten:
                    w.p.results.close()
                    data = None
        if data is not None:
            self._queue.put((w.p, data))
        return data is not None

    def _lost(self, w: _Watch) -> None:
        """``w``'s process ended (or its fork server did): what it sent is queued first, then its death."""
        if w.forgotten:
            return
        while self._read(w, if_ready=True):
            pass
        w.ended()
        self._queue.put((w.p, None))


class ProcessTransport:
    """Worker processes of trainer process ``rank`` (of ``world``) on this machine, each running
    ``entry(spec, board, orders, results)`` (see module docstring)."""

    noun = "worker"

    def __init__(self, cfg: Any, *, entry: Callable[..., None], rank: int = 0, world: int = 1):
        self.cfg, self.entry, self.rank, self.world = cfg, entry, int(rank), int(world)
        self.timeout = float(cfg.rollout.worker_timeout_s)
        self._ctx = fork_server.context()
        self._board: Optional[WeightBoard] = None
        self._procs: dict[int, _Proc] = {}
        self._results = _Results(f"offpolicy-moe-results-{self.rank}")

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
        proc = self._ctx.Process(target=self.entry, args=(spec, self._board, o_recv, r_send),
                                 name=f"offpolicy-moe-rollout-{self.rank}-{index}", daemon=True)
        proc.start()
        o_recv.close()
        r_send.close()
        self._procs[index] = _Proc(index=index, proc=proc, orders=o_send, results=r_recv)
        self._results.watch(self._procs[index])

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
        """What the workers sent, in the order it came, and their deaths (each after everything its worker sent;
        an error report is kept as the reason of the death that follows it): the first within ``timeout``
        seconds, and everything received by then.  The bytes were read off the pipes as they came
        (:class:`_Results`); they are decoded here."""
        for p, data in self._results.take(timeout):
            if self._procs.get(p.index) is not p:
                continue                            # a worker let go (retired, or closed) meanwhile
            if data is None:
                p.proc.join(timeout=5)
                yield WorkerLost(p.index, self._death_reason(p))
                continue
            msg = unpack(data)
            if isinstance(msg, WorkerFailed):
                p.failed(msg.traceback_text)
            elif isinstance(msg, (BatchDone, BatchNonFinite, GroupDone, GroupsNonFinite)):
                yield msg

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
        self._results.forget(p)

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
        """Tell the workers to stop, wait up to ``timeout`` seconds, then terminate (and kill) those still running;
        the result pipes are read until the workers are gone, then the thread reading them ends."""
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
        self._results.stop(timeout=5.0)
        self._procs = {}
