"""The trainer's side of the asynchronous pipeline: rollout worker processes, work orders, batches by iteration.

:class:`AsyncBatchSource` stands where the synchronous loop has its staleness buffer (same ``state_dict`` /
``load_state_dict`` / ``dropped`` / ``len`` surface, so the checkpoint code is unchanged).  It

* starts ``rollout.workers`` worker processes (``forkserver``), each with its own pipe for orders and one for results,
  and a shared :class:`~offpolicy_moe.rollout.weights.WeightBoard`;
* hands out iterations in order as the bound allows (:func:`~offpolicy_moe.sources.schedule.issue_limit`),
  each to the worker with the fewest orders in flight, with the iteration's deterministic seed;
* receives batches, drops those that would exceed the bound (``buffer.on_stale=drop``; counted, re-issued), lets
  the caller prepare each kept batch at once (old log-probs under the generating weights), and releases iteration
  ``t`` to trainer step ``t``;
* watches the workers: a death (or an error report) names the worker, its pid and the cause, then either restarts
  it and re-issues its orders (``rollout.on_worker_death=restart``) or raises :class:`WorkerDied` (``stop``); a
  wait longer than ``rollout.worker_timeout_s`` raises :class:`PipelineTimeout` naming what it waited for;
* routes non-finite values to the trainer's policy (``on_nonfinite``): a worker whose sampling met NaN/Inf reports
  it (it does not die), and a batch whose old-log-prob pass meets NaN/Inf is not kept; the policy raises (the run
  stops) or the iteration is dropped and issued again (same prompts, same seed).

A checkpoint holds the cursor (next iteration to train on), the batches received and prepared but not trained on
(with their per-token versions) and the counters.  Generations in flight are not saved: on resume their iterations
are issued again with the same prompts and seeds (docs/async.md, "Nothing lost").
"""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
import time
from dataclasses import dataclass
from multiprocessing.connection import wait as wait_any
from typing import Any, Callable, Mapping, Optional

import torch

from offpolicy_moe.config.validate import ConfigError, async_problems
from offpolicy_moe.rollout.batch import RolloutBatch
from offpolicy_moe.rollout.seeds import iteration_seed
from offpolicy_moe.rollout.weights import WeightBoard
from offpolicy_moe.rollout.worker import (BatchDone, BatchNonFinite, Order, WorkerFailed, WorkerSpec, pack, pid_alive,
                                          unpack, worker_main)
from offpolicy_moe.run import probes
from offpolicy_moe.run.full_state import is_sharded
from offpolicy_moe.run.nonfinite import NonFiniteError
from offpolicy_moe.sources.base import BatchSource, SourceStopped
from offpolicy_moe.sources.schedule import Assignment, Dispatcher
from offpolicy_moe.sources.versions import VersionRing, prepare_at_versions

__all__ = ["AsyncBatchSource", "WorkerDied", "PipelineTimeout", "check_async_config"]
_MAX_RESTARTS = 3          # per worker; then the run stops with a checkpoint


class WorkerDied(SourceStopped):
    """A rollout worker died (or reported an error) and the configuration says stop."""


class PipelineTimeout(TimeoutError):
    """The trainer waited longer than ``rollout.worker_timeout_s`` for a batch."""


@dataclass
class _Worker:
    index: int
    proc: Any
    orders: Any                   # trainer -> worker connection
    results: Any                  # worker -> trainer connection
    restarts: int = 0
    error: str = ""


def _exit_reason(code: Optional[int]) -> str:
    if code is None:
        return "stopped answering"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


def check_async_config(cfg: Any) -> None:
    """One-line ``ValueError`` for a config ``buffer.mode=async`` cannot run (before any process starts)."""
    ro, b = cfg.rollout, cfg.buffer
    if int(ro.workers) < 1 or int(ro.worker_threads) < 1:
        raise ValueError(f"rollout.workers ({ro.workers}) and rollout.worker_threads ({ro.worker_threads}) must be "
                         ">= 1 with buffer.mode=async")
    if float(ro.worker_timeout_s) <= 0:
        raise ValueError(f"rollout.worker_timeout_s must be > 0, got {ro.worker_timeout_s}")
    if b.max_ahead is not None and int(b.max_ahead) < 0:
        raise ValueError(f"buffer.max_ahead must be >= 0 or null, got {b.max_ahead}")
    problems = async_problems(cfg)      # the cross-field rules live with the config validation
    if problems:
        raise ValueError(problems[0])


def _context() -> Any:
    """``forkserver`` processes whose server has imported the worker module once (torch, transformers, the
    package): later workers — restarts, the next run in the same Python process — start in a fraction of a second
    instead of re-importing everything (``spawn``); the server itself starts no threads, so forking it is safe."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["offpolicy_moe.rollout.worker", "transformers.modeling_utils",
                                "transformers.generation.utils"])
    return ctx


class AsyncBatchSource(BatchSource):
    """Rollout workers generating ahead of the trainer within ``buffer.staleness`` versions (see module
    docstring).  ``model``: the trainer's bare policy (old log-probs of older versions are taken with their weights
    loaded into it); ``prepare(batch)``: the trainer's old-logp pass; ``on_nonfinite(err)``: the trainer's
    non-finite policy (raises, or returns True: drop the batch; without it the error is raised).  The workers start
    on the first :meth:`next`, with the weights last published."""

    mode = "async"

    def __init__(self, cfg: Any, *, model: torch.nn.Module, prepare: Callable[[RolloutBatch], None],
                 rank: int = 0, world: int = 1, on_nonfinite: Optional[Callable[..., bool]] = None):
        check_async_config(cfg)
        if is_sharded(model):
            raise ConfigError("buffer.mode=async with a sharded (FSDP) policy: the workers' weights and the "
                              "per-version old log-probs need full copies of the policy; use DDP or "
                              "buffer.mode=fixed/bounded")
        b, ro = cfg.buffer, cfg.rollout
        self.cfg, self.rank, self.world = cfg, int(rank), int(world)
        self.model, self._prepare_pass = model, prepare
        self.on_nonfinite = on_nonfinite
        self.k = int(b.staleness)
        self.policy = b.on_stale
        self.n_workers = int(ro.workers)
        self.ahead = self.n_workers if b.max_ahead is None else int(b.max_ahead)
        self.on_death = ro.on_worker_death
        self.timeout = float(ro.worker_timeout_s)
        self.dispatch = Dispatcher(staleness=self.k, policy=self.policy, ahead=self.ahead,
                                   total=int(cfg.trainer.steps), workers=self.n_workers)
        self.ring = VersionRing(keep=self.k + 1)
        self.publish_every = int(ro.publish_every)
        self.version = 0                # the trainer's newest version (its model holds it)
        self.published = 0              # the newest version the workers may take
        self._before = dict()
        self.ready: dict[int, RolloutBatch] = {}
        self.restarts = 0
        self.timing = {"trainer_wait_s": 0.0, "prepare_s": 0.0, "weight_sync_s": 0.0, "worker_wait_s": 0.0, "worker_sync_s": 0.0,
                       "worker_generate_s": 0.0, "worker_cpu_s": 0.0}
        self._before = dict(self.timing)
        self._workers: dict[int, _Worker] = {}
        self._board: Optional[WeightBoard] = None
        self._ctx = _context()

    # ------------------------------------------------------------------ the BatchSource seam
    @property
    def iteration(self) -> int:
        """Iterations completed: the newest published version (step ``t`` trains on iteration ``t``)."""
        return self.version

    @property
    def cursor(self) -> int:
        """The next iteration the trainer takes (= its step)."""
        return self.dispatch.cursor

    @property
    def dropped(self) -> int:
        """Batches dropped for exceeding ``buffer.staleness`` (``on_stale=drop``) and generated again."""
        return self.dispatch.dropped

    def __len__(self) -> int:
        return len(self.ready)

    def versions(self) -> list[int]:
        """Versions of the batches received and not yet trained on, by iteration."""
        return [self.ready[i].version for i in sorted(self.ready)]

    def state_dict(self) -> dict:
        """The in-flight state a checkpoint needs (see module docstring).  With several trainer processes the
        checkpoint is written by process 0 alone, so the received batches (each process has its own share) are not
        kept: every process generates its share of those iterations again on resume."""
        ready = {i: b.state_dict() for i, b in sorted(self.ready.items())} if self.world == 1 else {}
        return {"mode": "async", "k": self.k, "cursor": self.cursor, "dropped": self.dropped,
                "restarts": self.restarts, "world": self.world, "published": self.published, "ready": ready}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`; iterations that were in flight are issued again when the workers start."""
        if state.get("mode") != "async" or state.get("k") != self.k:
            raise ValueError(f"checkpointed buffer has staleness={state.get('k')} mode={state.get('mode')!r}, "
                             f"but the config asks for staleness={self.k} mode='async'")
        self.ready = {int(i): RolloutBatch.from_state_dict(b) for i, b in state["ready"].items()}
        self.dispatch.restore(state["cursor"], list(self.ready))
        self.dispatch.dropped, self.restarts = state["dropped"], state["restarts"]
        self.published = int(state["published"])

    def next(self, step: int) -> tuple[RolloutBatch, dict[str, float]]:
        """The prepared batch of iteration ``step`` (starting the workers on the first call) and where the time
        went since the previous call (``async/*``: waits, weight publishing, the workers' generation)."""
        if self._board is None:
            self._start(step)
        batch, waited = self.take(step)
        delta = {k: self.timing[k] - self._before[k] for k in self.timing}
        self._before = dict(self.timing)
        return batch, {"async/trainer_wait_s": waited, "async/weight_sync_s": delta["weight_sync_s"],
                       "perf/time_old_logp_s": delta["prepare_s"], "async/worker_wait_s": delta["worker_wait_s"],
                       "async/worker_generate_s": delta["worker_generate_s"],
                       "async/worker_cpu_s": delta["worker_cpu_s"], "async/worker_restarts": float(self.restarts),
                       "async/trained_tokens": float(batch.num_tokens())}

    def publish(self, weights: Mapping[str, torch.Tensor], version: int,
                predictors: Optional[Mapping[str, torch.Tensor]] = None, *, force: bool = False) -> None:
        """``weights`` are the trainer's version ``version``; when it is a multiple of ``rollout.publish_every``
        (or ``force``) it goes to the workers (the shared board, once they run) and to the old-logp pass of the
        batches it generates (the ring of the last ``k + 1`` published versions)."""
        self.version = int(version)
        if not (force or version % self.publish_every == 0):
            return
        self.ring.add(version, weights)
        self.published = int(version)
        if self._board is not None:
            self.timing["weight_sync_s"] += self._board.publish(weights, version)
            self._issue(version)

    def _prepare(self, batch: RolloutBatch) -> None:
        prepare_at_versions(batch, self.ring, current=self.version, model=self.model, prepare=self._prepare_pass)

    # ------------------------------------------------------------------ workers
    def _start(self, step: int) -> None:
        """Start the workers with the newest published weights and hand out the first orders."""
        if step != self.cursor:
            raise RuntimeError(f"async pipeline: trainer step {step} but the pipeline's next iteration is "
                               f"{self.cursor} (a checkpoint from another buffer mode?)")
        weights = self.ring[self.published]
        self._board = WeightBoard(weights, self._ctx)
        self._board.publish(weights, self.published)
        self._workers = {i: self._spawn(i) for i in range(self.n_workers)}
        self._issue(self.published)

    def _spawn(self, index: int, restarts: int = 0) -> _Worker:
        o_recv, o_send = self._ctx.Pipe(duplex=False)
        r_recv, r_send = self._ctx.Pipe(duplex=False)
        ro = self.cfg.rollout
        spec = WorkerSpec(cfg=self.cfg, index=index, rank=self.rank, world=self.world, parent_pid=os.getpid(),
                          threads=int(ro.worker_threads), weight_timeout_s=self.timeout,
                          update_in_flight=bool(ro.update_in_flight), probe=probes.handoff())
        proc = self._ctx.Process(target=worker_main, args=(spec, self._board, o_recv, r_send),
                                 name=f"offpolicy-moe-rollout-{self.rank}-{index}", daemon=True)
        proc.start()
        o_recv.close()
        r_send.close()
        return _Worker(index=index, proc=proc, orders=o_send, results=r_recv, restarts=restarts)

    def worker_pids(self) -> list[int]:
        """Process ids of the live workers (index order)."""
        return [self._workers[i].proc.pid for i in sorted(self._workers)]

    def _issue(self, published: int) -> None:
        for a in self.dispatch.issue(published):
            self._send(a)

    def _send(self, a: Assignment) -> None:
        order = Order(iteration=a.iteration, seed=iteration_seed(self.cfg.seed, a.iteration, self.rank),
                      min_version=a.min_version, attempt=a.attempt)
        try:
            self._workers[a.worker].orders.send(order)
        except (BrokenPipeError, OSError):
            pass                    # a dead worker: found by its sentinel in the next wait, its orders re-issued

    # ------------------------------------------------------------------ receiving
    def take(self, step: int) -> tuple[RolloutBatch, float]:
        """The prepared batch of iteration ``step`` and the seconds the trainer waited for it (not counting the
        time it spent preparing batches that arrived meanwhile, ``timing["prepare_s"]``)."""
        if step != self.cursor:
            raise RuntimeError(f"async pipeline: the trainer asks for iteration {step}, the next one is "
                               f"{self.cursor}")
        t0, prep0 = time.perf_counter(), self.timing["prepare_s"]
        last = t0
        while step not in self.ready:
            if self._receive(timeout=min(1.0, self.timeout)):
                last = time.perf_counter()
            elif time.perf_counter() - last > self.timeout:
                holder = next((w for w in self._workers.values() if step in self.dispatch.inflight[w.index]), None)
                who = (f"rollout worker {holder.index} (pid {holder.proc.pid}, alive={holder.proc.is_alive()})"
                       if holder is not None else "no worker (the iteration was never issued)")
                raise PipelineTimeout(f"waited {self.timeout:.0f} s (rollout.worker_timeout_s) for the batch of "
                                      f"iteration {step} from {who}")
        waited = time.perf_counter() - t0 - (self.timing["prepare_s"] - prep0)
        self.timing["trainer_wait_s"] += waited
        self.dispatch.release(step)
        return self.ready.pop(step), waited

    def _receive(self, timeout: float) -> bool:
        """Handle what the workers sent within ``timeout`` seconds (batches, errors, deaths); True if anything."""
        by_conn = {w.results: w for w in self._workers.values()}
        by_sentinel = {w.proc.sentinel: w for w in self._workers.values()}
        got = wait_any(list(by_conn) + list(by_sentinel), timeout=timeout)
        for obj in got:
            if obj in by_conn:
                w = by_conn[obj]
                try:
                    msg = unpack(obj.recv_bytes())
                except (EOFError, OSError):
                    continue                    # the process is gone: its sentinel reports it
                self._handle(w, msg)
        for obj in got:
            if obj in by_sentinel and self._workers.get(by_sentinel[obj].index) is by_sentinel[obj]:
                w = by_sentinel[obj]
                w.proc.join(timeout=5)
                self._on_death(w)
        return bool(got)

    def _handle(self, w: _Worker, msg: Any) -> None:
        """One message of worker ``w`` (:mod:`~offpolicy_moe.rollout.worker`'s records)."""
        if isinstance(msg, WorkerFailed):
            text = msg.traceback_text.strip()
            w.error = text.splitlines()[-1] if text else "unknown error"
            return
        if isinstance(msg, BatchNonFinite):       # the worker's sampling met NaN/Inf; the worker goes on
            if self.dispatch.accept(w.index, msg.iteration, msg.attempt, msg.iteration):   # (not a superseded answer)
                self._nonfinite(NonFiniteError(msg.stage, f"{msg.what} (rollout worker {w.index})",
                                               iteration=msg.iteration))
            return
        if not isinstance(msg, BatchDone):
            return
        iteration, attempt, state, timings = msg.iteration, msg.attempt, msg.state, msg.timings
        for key in ("wait", "sync", "generate", "cpu"):
            self.timing[f"worker_{key}_s"] += float(timings[f"{key}_s"])
        batch = RolloutBatch.from_state_dict(state)
        batch.extras = {}
        oldest = int(batch.token_versions[batch.response_mask.bool()].min()) \
            if batch.token_versions is not None and bool(batch.response_mask.any()) else batch.version
        if not self.dispatch.accept(w.index, iteration, attempt, oldest):
            self._issue(self.published)      # a dropped batch's iteration goes out again
            return
        t0 = time.perf_counter()
        try:
            self._prepare(batch)
        except NonFiniteError as exc:
            self._nonfinite(exc if exc.iteration is not None else exc.located(iteration + 1, iteration))
            return
        finally:
            self.timing["prepare_s"] += time.perf_counter() - t0
        self.ready[iteration] = batch

    def _nonfinite(self, err: NonFiniteError) -> None:
        """The trainer's policy on a non-finite batch of iteration ``err.iteration`` (trained at step iteration + 1):
        it raises, or the iteration is issued again."""
        err = err.located(err.iteration + 1)
        if self.on_nonfinite is None or not self.on_nonfinite(err):
            raise err
        self.dispatch.requeue([err.iteration])     # the dispatcher's own re-issue (as for a dropped stale batch)
        self._issue(self.published)

    def _on_death(self, w: _Worker) -> None:
        reason = w.error or _exit_reason(w.proc.exitcode)
        if pid_alive(w.proc.pid):       # its fork server died, so its exit cannot be reported: end it
            reason = "its fork server died (the worker was ended)"
            try:
                os.kill(w.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        lost = self.dispatch.worker_lost(w.index)
        doing = f" while generating iteration(s) {lost}" if lost else ""
        msg = f"rollout worker {w.index} (pid {w.proc.pid}) died{doing}: {reason}"
        del self._workers[w.index]
        w.orders.close()
        w.results.close()
        if self.on_death == "stop" or w.restarts >= _MAX_RESTARTS:
            why = "rollout.on_worker_death=stop" if self.on_death == "stop" else f"{_MAX_RESTARTS} restarts"
            raise WorkerDied(f"{msg}; stopping ({why})")
        print(f"offpolicy-moe: {msg}; restarting it (rollout.on_worker_death=restart)", file=sys.stderr)
        self.restarts += 1
        new = self._spawn(w.index, restarts=w.restarts + 1)
        self._workers[w.index] = new
        self._issue(self.published)

    # ------------------------------------------------------------------ shutdown
    def close(self, timeout: float = 5.0) -> None:
        """Tell the workers to stop, wait up to ``timeout`` seconds, then terminate (and kill) those still running."""
        for w in self._workers.values():
            try:
                w.orders.send(None)
            except (BrokenPipeError, OSError):
                pass
        deadline = time.perf_counter() + timeout
        for w in self._workers.values():
            w.proc.join(timeout=max(deadline - time.perf_counter(), 0.0))
            if w.proc.is_alive():
                w.proc.terminate()
                w.proc.join(timeout=2)
            if w.proc.is_alive():           # stopped or stuck: SIGTERM is not enough
                w.proc.kill()
                w.proc.join(timeout=2)
            w.orders.close()
            w.results.close()
        self._workers = {}
