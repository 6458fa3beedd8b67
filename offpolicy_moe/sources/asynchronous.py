"""The trainer's side of the asynchronous pipeline: rollout workers, work orders, batches by iteration.

:class:`AsyncBatchSource` stands where the synchronous loop has its staleness buffer (same ``state_dict`` /
``load_state_dict`` / ``dropped`` / ``len`` surface, so the checkpoint code is unchanged).  It decides everything
that is trained, whatever runs the workers; a :class:`~offpolicy_moe.sources.transport.WorkerTransport` only moves
orders, weights and results (worker processes on this machine, or Ray actors with ``rollout.backend=ray``:
:func:`make_transport`).  The source

* starts ``rollout.workers`` workers on its first :meth:`~AsyncBatchSource.next`, with the weights last published;
* hands out iterations in order as the bound allows (:func:`~offpolicy_moe.sources.schedule.issue_limit`),
  each to the worker with the fewest orders in flight, with the iteration's deterministic seed;
* receives batches, drops those that would exceed the bound (``buffer.on_stale=drop``; counted, re-issued), hands
  each kept batch to the preparation stage at once (old log-probs under the generating weights, which the stage
  keeps for the last ``k + 1`` published versions), and releases iteration ``t`` to trainer step ``t``;
* answers a worker's death (its transport names the worker and the cause): restarts it and re-issues its orders
  (``rollout.on_worker_death=restart``, at most ``transport.MAX_RESTARTS`` times a slot) or raises :class:`WorkerDied`
  (``stop``); when a Ray actor's node left the cluster, ``rollout.ray_on_node_loss`` decides instead: go on with
  the remaining workers (``continue``) or stop.  A wait longer than ``rollout.worker_timeout_s`` without news
  raises :class:`PipelineTimeout` naming what it waited for;
* returns non-finite batches as errors: a worker whose sampling met NaN/Inf reports it (it does not die), and a
  batch whose preparation meets NaN/Inf is not kept; the iteration is issued again (same prompts, same seed) and
  :meth:`~AsyncBatchSource.next` returns the error, to which the loop applies ``trainer.on_nan``.  Under
  ``rollout.backend=ray`` the error is raised instead (the run stops as diverged).

A checkpoint holds the cursor (next iteration to train on), the batches received and prepared but not trained on
(with their per-token versions) and the counters; its format does not depend on the transport, so a run may
resume on the other backend.  Generations in flight are not saved: on resume their iterations are issued again
with the same prompts and seeds (docs/async.md, "Nothing lost").
"""
from __future__ import annotations

import importlib
import sys
import time
from typing import Any, Optional

import torch

from offpolicy_moe.config.validate import ConfigError, Findings
from offpolicy_moe.rollout.batch import RolloutBatch
from offpolicy_moe.rollout.seeds import iteration_seed
from offpolicy_moe.rollout.messages import BatchDone, BatchNonFinite, Order
from offpolicy_moe.rollout.worker import worker_main
from offpolicy_moe.run.full_state import is_sharded
from offpolicy_moe.run.nonfinite import NonFiniteError
from offpolicy_moe.logprobs.stage import PreparedBatch
from offpolicy_moe.sources.base import BatchSource, Preparation, refuse_vllm_in_flight
from offpolicy_moe.sources.process_transport import ProcessTransport
from offpolicy_moe.sources.schedule import Dispatcher
from offpolicy_moe.sources.transport import (PipelineTimeout, PublishesToWorkers, WorkerDied, WorkerLost,
                                             WorkerTransport, handle_events, restart_or_stop)

__all__ = ["AsyncBatchSource", "WorkerDied", "PipelineTimeout", "check_async_config", "make_transport"]


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
    problems = AsyncBatchSource.problems(cfg)
    if problems:
        raise ValueError(problems[0])


def make_transport(cfg: Any, *, rank: int = 0, world: int = 1) -> WorkerTransport:
    """The transport of ``rollout.backend``: worker processes on this machine running
    :func:`~offpolicy_moe.rollout.worker.worker_main` (``local``), or Ray actors (``ray``; its module, and Ray, are
    imported only then)."""
    backend = cfg.rollout.backend
    if backend == "local":
        return ProcessTransport(cfg, entry=worker_main, rank=rank, world=world)
    if backend == "ray":
        ray_transport = importlib.import_module("offpolicy_moe.sources.ray_transport")
        return ray_transport.RayTransport(cfg, rank=rank, world=world)
    raise ValueError(f"rollout.backend must be 'local' or 'ray', got {backend!r}")


class AsyncBatchSource(PublishesToWorkers, BatchSource):
    """Rollout workers generating ahead of the trainer within ``buffer.staleness`` versions (see module
    docstring).  ``model``: the trainer's bare policy (refused when sharded); ``stage``: the preparation of each
    received batch (it keeps the published versions' weights); ``transport``:
    what runs the workers (default: :func:`make_transport` of the config, which connects to a Ray cluster at
    once with ``rollout.backend=ray``).  The workers start with the first weights published
    (``rollout.early_start``: while the trainer evaluates step 0), else on the first :meth:`next`, with the
    weights last published."""

    worker_entry = staticmethod(worker_main)

    @classmethod
    def build(cls, cfg: Any, *, engine: Any, task: Any, model: torch.nn.Module, stage: Preparation, rank: int,
              world: int, pad_id: int) -> "AsyncBatchSource":
        """Workers over copies of ``model`` (each builds its own engine and task)."""
        return cls(cfg, model=model, stage=stage, rank=rank, world=world)

    @classmethod
    def problems(cls, cfg: Any) -> list[str]:
        """What asynchronous workers cannot run: PR2 (the workers do not receive the predictors), and R2 with
        sequences continuing across weight updates (one recorded route for tokens of several versions); a
        ``rollout.publish_every`` that leaves iteration ``t`` without a version ``>= t - k``."""
        rt, ro = cfg.algo.routing, cfg.rollout
        out = []
        if rt.replay == "pr2":
            out.append("buffer.mode=async does not support algo.routing.replay=pr2: the rollout workers do not "
                       "receive the PR2 predictors")
        if rt.replay == "r2" and ro.update_in_flight:
            out.append("algo.routing.replay=r2 with rollout.update_in_flight=true: the trainer would record one "
                       "version's routes for tokens sampled by several; use r3 or turn update_in_flight off")
        if ro.publish_every > cfg.buffer.staleness + 1:
            out.append(f"rollout.publish_every={ro.publish_every} with buffer.mode=async and buffer.staleness="
                       f"{cfg.buffer.staleness}: iteration t needs a published version >= t - k, which publishing "
                       f"every n versions gives only when n <= k + 1; raise buffer.staleness or lower "
                       "rollout.publish_every")
        return out

    @classmethod
    def check_rules(cls, cfg: Any, found: Findings) -> None:
        """:meth:`problems` as errors, and no vLLM weights in flight."""
        super().check_rules(cfg, found)
        refuse_vllm_in_flight(cfg, found)

    def __init__(self, cfg: Any, *, model: torch.nn.Module, stage: Preparation, rank: int = 0, world: int = 1,
                 transport: Optional[WorkerTransport] = None):
        check_async_config(cfg)
        if is_sharded(model):
            raise ConfigError("buffer.mode=async with a sharded (FSDP) policy: the workers' weights and the "
                              "per-version old log-probs need full copies of the policy; use DDP or "
                              "buffer.mode=fixed/bounded")
        b, ro = cfg.buffer, cfg.rollout
        self.cfg, self.rank, self.world = cfg, int(rank), int(world)
        self.stage = stage
        self.raise_nonfinite = ro.backend == "ray"
        self.errors: list[NonFiniteError] = []      # non-finite batches not yet returned (their iterations re-issued)
        self.k = int(b.staleness)
        self.policy = b.on_stale
        self.n_workers = int(ro.workers)
        self.ahead = self.n_workers if b.max_ahead is None else int(b.max_ahead)
        self.on_death = ro.on_worker_death
        self.on_node_loss = ro.ray_on_node_loss
        self.timeout = float(ro.worker_timeout_s)
        self.dispatch = Dispatcher(staleness=self.k, policy=self.policy, ahead=self.ahead,
                                   total=int(cfg.trainer.steps), workers=self.n_workers)
        self.publish_every = int(ro.publish_every)
        self.version = 0                # the trainer's newest version (its model holds it)
        self.published = 0              # the newest version the workers may take
        self.ready: dict[int, RolloutBatch] = {}
        self.restarts = 0
        self.timing = {"trainer_wait_s": 0.0, "prepare_s": 0.0, "weight_sync_s": 0.0, "worker_wait_s": 0.0,
                       "worker_sync_s": 0.0, "worker_generate_s": 0.0, "worker_cpu_s": 0.0, "worker_pack_s": 0.0,
                       "worker_send_s": 0.0}
        self._before = dict(self.timing)
        self._slots: dict[int, int] = {}        # live worker slot -> how many times it was restarted
        self._started = False
        self.early_start = bool(ro.early_start)
        self.transport: WorkerTransport = (transport if transport is not None
                                           else make_transport(cfg, rank=self.rank, world=self.world))

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
        self.dispatch.restore(state["cursor"], list(self.ready), dropped=state["dropped"])
        self.restarts = state["restarts"]
        self.published = int(state["published"])

    def next(self, step: int) -> tuple[PreparedBatch, dict[str, float]]:
        """The prepared batch of iteration ``step`` (starting the workers on the first call), or the error of a
        non-finite batch received meanwhile, and where the time went since the previous call (``async/*``: waits,
        weight publishing, the workers' generation)."""
        if not self._started:
            self._start(step)
        batch, waited = self.take(step)
        if batch is None:
            return PreparedBatch(None, self.errors.pop(0)), {}
        delta = {k: self.timing[k] - self._before[k] for k in self.timing}
        self._before = dict(self.timing)
        wall = sum(delta[f"worker_{key}_s"] for key in ("wait", "sync", "generate", "pack", "send"))
        return PreparedBatch(batch), {
            "async/trainer_wait_s": waited, "async/weight_sync_s": delta["weight_sync_s"],
            "perf/time_old_logp_s": delta["prepare_s"], "async/worker_wait_s": delta["worker_wait_s"],
            "async/worker_generate_s": delta["worker_generate_s"], "async/worker_cpu_s": delta["worker_cpu_s"],
            "async/worker_pack_s": delta["worker_pack_s"], "async/worker_send_s": delta["worker_send_s"],
            "async/worker_wall_s": wall, "async/worker_blocked_share": delta["worker_send_s"] / max(wall, 1e-9),
            "async/worker_restarts": float(self.restarts), "async/trained_tokens": float(batch.num_tokens())}

    def _after_publish(self, version: int) -> None:
        self._issue(version)

    def _start_early(self) -> None:
        self._start(self.cursor)

    # ------------------------------------------------------------------ workers
    def _start(self, step: int) -> None:
        """Start the workers with the newest published weights and hand out the first orders."""
        if step != self.cursor:
            raise RuntimeError(f"async pipeline: trainer step {step} but the pipeline's next iteration is "
                               f"{self.cursor} (a checkpoint from another buffer mode?)")
        self.transport.start(self.stage.weights(self.published), self.published)
        self._started = True
        for i in range(self.n_workers):
            self.transport.spawn(i, 0)
            self._slots[i] = 0
        self._issue(self.published)

    def worker_pids(self) -> list[int]:
        """Process ids of the live workers (slot order)."""
        return self.transport.pids()

    def _issue(self, published: int) -> None:
        for a in self.dispatch.issue(published):
            self.transport.send(a.worker, Order(iteration=a.iteration,
                                                seed=iteration_seed(self.cfg.seed, a.iteration, self.rank),
                                                min_version=a.min_version, attempt=a.attempt))

    # ------------------------------------------------------------------ receiving
    def take(self, step: int) -> tuple[Optional[RolloutBatch], float]:
        """The prepared batch of iteration ``step`` and the seconds the trainer waited for it (not counting the
        time it spent preparing batches that arrived meanwhile, ``timing["prepare_s"]``); None when a non-finite
        batch's error is waiting in :attr:`errors`.  Deaths and errors that came meanwhile are handled first, even
        when the batch is ready already."""
        if step != self.cursor:
            raise RuntimeError(f"async pipeline: the trainer asks for iteration {step}, the next one is "
                               f"{self.cursor}")
        t0, prep0 = time.perf_counter(), self.timing["prepare_s"]
        last = t0
        self._receive(timeout=0)
        while step not in self.ready and not self.errors:
            if self._receive(timeout=min(1.0, self.timeout)):
                last = time.perf_counter()
            elif time.perf_counter() - last > self.timeout:
                raise PipelineTimeout(f"waited {self.timeout:.0f} s (rollout.worker_timeout_s) for the batch of "
                                      f"iteration {step} from {self._holder(step)}")
        waited = time.perf_counter() - t0 - (self.timing["prepare_s"] - prep0)
        self.timing["trainer_wait_s"] += waited
        if self.errors:
            return None, waited
        self.dispatch.release(step)
        return self.ready.pop(step), waited

    def _holder(self, iteration: int) -> str:
        """The worker that has ``iteration`` in flight, named for a message."""
        index = next((i for i in sorted(self._slots) if iteration in self.dispatch.inflight.get(i, [])), None)
        if index is None:
            return f"no {self.transport.noun} (the iteration was never issued)"
        return self.transport.describe(index, f"alive={self.transport.alive(index)}")

    def _receive(self, timeout: float) -> bool:
        """Handle what the workers sent within ``timeout`` seconds (batches, errors, deaths); True if anything."""
        return handle_events(self.transport, timeout, {WorkerLost: self._on_death, BatchDone: self._on_batch,
                                                       BatchNonFinite: self._on_nonfinite_sample}, "async pipeline")

    def _on_nonfinite_sample(self, msg: BatchNonFinite) -> None:
        """A worker's sampling met NaN/Inf (the worker goes on)."""
        if self.dispatch.accept(msg.index, msg.iteration, msg.attempt, msg.iteration):  # (not a superseded answer)
            self._nonfinite(NonFiniteError(msg.stage, f"{msg.what} (rollout worker {msg.index})",
                                           iteration=msg.iteration))

    def _on_batch(self, msg: BatchDone) -> None:
        """A worker's batch: kept and prepared, or dropped (stale, or a superseded answer)."""
        for key in ("wait", "sync", "generate", "cpu", "pack", "send"):     # a Ray actor sends no pack/send
            self.timing[f"worker_{key}_s"] += float(msg.timings.get(f"{key}_s", 0.0))
        batch = RolloutBatch.from_state_dict({**msg.state, "extras": {}})
        oldest = int(batch.token_versions[batch.response_mask.bool()].min()) \
            if batch.token_versions is not None and bool(batch.response_mask.any()) else batch.version
        if not self.dispatch.accept(msg.index, msg.iteration, msg.attempt, oldest):
            self._issue(self.published)      # a dropped batch's iteration goes out again
            return
        t0 = time.perf_counter()
        prepared = self.stage.prepare(batch, current=self.version)
        self.timing["prepare_s"] += time.perf_counter() - t0
        if prepared.error is not None:
            exc = prepared.error
            self._nonfinite(exc if exc.iteration is not None else exc.located(msg.iteration + 1, msg.iteration))
            return
        self.ready[msg.iteration] = prepared.batch

    def _nonfinite(self, err: NonFiniteError) -> None:
        """A non-finite batch of iteration ``err.iteration`` (trained at step iteration + 1): kept for :meth:`next`
        to return (raised under Ray), and the iteration is issued again."""
        err = err.located(err.iteration + 1)
        if self.raise_nonfinite:
            raise err
        self.errors.append(err)
        self.dispatch.requeue([err.iteration])     # the dispatcher's own re-issue (as for a dropped stale batch)
        self._issue(self.published)

    def _on_death(self, lost_worker: WorkerLost) -> None:
        """Worker ``lost_worker.index`` is gone: its iterations in flight are issued again (same seeds) after it is
        restarted, or the remaining workers go on without it (its node left: ``rollout.ray_on_node_loss=continue``);
        otherwise :class:`WorkerDied` stops the run."""
        index = lost_worker.index
        lost = self.dispatch.worker_lost(index)
        doing = f" while generating iteration(s) {lost}" if lost else ""
        msg = f"{self.transport.describe(index)} died{doing}: {lost_worker.reason}"
        restarts = self._slots.pop(index)
        self.transport.retire(index)
        noun = f"rollout {self.transport.noun}"
        if lost_worker.node_lost:
            if self.on_node_loss == "stop" or not self._slots:
                why = "rollout.ray_on_node_loss=stop" if self.on_node_loss == "stop" else f"no {noun} left"
                raise WorkerDied(f"{msg}; stopping ({why})")
            self.dispatch.retire(index)               # the dispatcher hands out to the remaining workers
            print(f"offpolicy-moe: {msg}; going on with {len(self._slots)} {noun}(s) "
                  "(rollout.ray_on_node_loss=continue)", file=sys.stderr)
        else:
            self._slots[index] = restart_or_stop(self.transport, index, restarts, msg, self.on_death)
            self.restarts += 1
        self._issue(self.published)

    # ------------------------------------------------------------------ shutdown
    def close(self, timeout: float = 5.0) -> None:
        """Stop the workers (the transport's way: processes are asked, then terminated after ``timeout`` seconds;
        actors are killed); idempotent."""
        self.transport.close(timeout)
        self._slots = {}
