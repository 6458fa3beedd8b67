"""The rollout worker process: its own engine copy, weights by version, one batch per work order.

A worker (a ``forkserver`` process of :class:`~offpolicy_moe.sources.process_transport.ProcessTransport`) builds its
engine as the trainer builds its own, sets its GPU (:mod:`~offpolicy_moe.rollout.devices`) before touching CUDA, and
serves :class:`~offpolicy_moe.rollout.messages.Order` s: newest published weights (at least the order's version), the iteration's seed, the batch
sent back as ``torch.save`` bytes over its own pipe (a worker killed mid-send corrupts nothing shared).  It exits on
:class:`~offpolicy_moe.rollout.messages.Shutdown`, when the trainer is gone, or after an error; non-finite
sampling is reported (:class:`~offpolicy_moe.rollout.messages.BatchNonFinite`) and the worker goes on.
"""
from __future__ import annotations

import os
import time
import traceback
from dataclasses import replace
from typing import Any, Optional

import torch

from offpolicy_moe.rollout.batch import RolloutBatch
from offpolicy_moe.rollout.weights import WeightBoard
from offpolicy_moe.rollout.engine import REPLAY_ENGINE
from offpolicy_moe.rollout.engine import RolloutEngine, make_engine
from offpolicy_moe.rollout.messages import (BatchDone, BatchNonFinite, Order, Shutdown, WorkerFailed, WorkerReady,
                                            WorkerSpec, pack, send_timed)
from offpolicy_moe.models import is_moe, load_policy
from offpolicy_moe.run import probes
from offpolicy_moe.run.nonfinite import NonFiniteError, all_finite
from offpolicy_moe.tasks import apply_chat_template, make_task

__all__ = ["generate_iteration", "checked_generation", "build_engine", "records_routes", "worker_main"]


def build_engine(cfg: Any, model: torch.nn.Module, tok: Any) -> RolloutEngine:
    """The rollout engine named by ``cfg.rollout.engine`` around ``model``, recording routes when the run needs
    them (R3 / routing metrics on an MoE model) — the engine the trainer builds for itself (no PR2 offsets: PR2 is
    refused in async mode); its router perturbation (``rollout.router_perturb``) is drawn from the run's seed, so
    it is the trainer's own ``dW``."""
    return make_engine(model, tok, cfg.rollout, record_routes=records_routes(cfg, model), device=torch.device("cpu"),
                       seed=cfg.seed)


def records_routes(cfg: Any, model: torch.nn.Module) -> bool:
    """True when a rollout engine of this run records routes: an MoE model under R3 or with routing metrics."""
    rt = cfg.algo.routing
    return bool(is_moe(model)) and (rt.replay in REPLAY_ENGINE or bool(rt.metrics))


def generate_iteration(engine: Any, task: Any, rollout: Any, *, iteration: int, seed: int, rank: int = 0,
                       world: int = 1) -> RolloutBatch:
    """Process ``rank``'s share (prompts ``rank, rank + world, ...``) of iteration ``iteration``'s
    ``rollout.prompts_per_step`` prompts, ``rollout.group_size`` samples each, sampled with ``seed``; group ids
    ``iteration * prompts_per_step + prompt index`` (globally unique), as the synchronous trainer makes them."""
    rows = task.sample_prompts(iteration, rollout.prompts_per_step)
    mine = list(range(rank, rollout.prompts_per_step, world))
    if not mine:
        raise ValueError(f"rollout.prompts_per_step={rollout.prompts_per_step} < number of processes {world}")
    batch = engine.generate([rows[j]["prompt"] for j in mine], [rows[j]["answer"] for j in mine],
                            group_size=rollout.group_size, seed=seed, iteration=iteration)
    return replace(batch, group_ids=iteration * rollout.prompts_per_step
                   + torch.tensor(mine, dtype=torch.long).repeat_interleave(rollout.group_size))


def checked_generation(engine: Any, task: Any, rollout: Any, *, iteration: int, seed: int, rank: int = 0,
                       world: int = 1) -> RolloutBatch:
    """:func:`generate_iteration`, raising :class:`~offpolicy_moe.run.nonfinite.NonFiniteError` (stage
    ``generation``) when sampling met non-finite probabilities or a sampled token's log-prob is not finite."""
    with probes.poisoned("generation", iteration + 1, getattr(engine, "model", None)):
        try:
            batch = generate_iteration(engine, task, rollout, iteration=iteration, seed=seed, rank=rank, world=world)
        except NonFiniteError as exc:
            raise NonFiniteError(exc.stage, exc.what, iteration=iteration) from exc
    if not all_finite(batch.behav_logp, batch.response_mask):
        raise NonFiniteError("generation", "behaviour log-probs of the sampled tokens", iteration=iteration)
    return batch


def pid_alive(pid: Optional[int]) -> bool:
    """True while process ``pid`` exists (signal 0 checks without sending anything); False for None."""
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# how long a worker waits on its order pipe before it checks that its trainer still lives (seconds)
ORDER_POLL_S = 1.0


def _next_order(conn: Any, trainer_pid: int) -> Optional[Order]:
    """The next order (None: stop, on :class:`Shutdown`), polling every :data:`ORDER_POLL_S` so that a worker whose
    trainer died exits within that time (the worker's parent is the fork server, not the trainer: the trainer's pid
    is checked, and its pipe's end)."""
    while True:
        if conn.poll(ORDER_POLL_S):
            try:
                msg = conn.recv()
            except EOFError:      # the trainer closed the pipe
                return None
            return None if isinstance(msg, Shutdown) else msg
        if not pid_alive(trainer_pid):
            return None


def worker_main(spec: WorkerSpec, board: WeightBoard, orders: Any, results: Any) -> None:
    """Entry point of a rollout worker process (see module docstring); messages sent on ``results`` (packed):
    :class:`WorkerReady`, then per order :class:`BatchDone` or :class:`BatchNonFinite` (the worker goes on), or
    :class:`WorkerFailed` before it exits."""
    iteration = -1
    try:
        os.environ.update(spec.env or {})           # before CUDA is touched: the worker's GPU is its only one
        probes.receive(spec.probe)
        torch.set_num_threads(max(int(spec.threads), 1))
        cfg = spec.cfg
        task = make_task(cfg.task)
        model, tok = load_policy(cfg.model, seed=cfg.seed, task=task, progress=cfg.logging.progress)
        apply_chat_template(task, tok, cfg.task.chat_template)      # the prompts the trainer's engine would see
        engine = build_engine(cfg, model, tok)
        engine.forget_version()                   # nothing loaded yet: the first order loads the board
        if spec.update_in_flight:
            engine.call_between_tokens(board.load_into)
        results.send_bytes(pack(WorkerReady(spec.index, os.getpid())))
        carried = {"pack_s": 0.0, "send_s": 0.0}      # the previous message's, reported with the next one
        while True:
            t0 = time.perf_counter()
            order = _next_order(orders, spec.parent_pid)
            if order is None:
                return
            iteration = order.iteration
            board.wait_for(order.min_version, spec.weight_timeout_s,
                           what=f"iteration {order.iteration} (rollout worker {spec.index})")
            t1, c1 = time.perf_counter(), time.process_time()
            board.load_into(engine)
            t2 = time.perf_counter()
            try:
                batch = checked_generation(engine, task, cfg.rollout, iteration=order.iteration, seed=order.seed,
                                           rank=spec.rank, world=spec.world)
            except NonFiniteError as exc:
                results.send_bytes(pack(BatchNonFinite(spec.index, order.iteration, order.attempt, exc.stage,
                                                       exc.what)))
                continue
            t3 = time.perf_counter()
            timings = {"wait_s": t1 - t0, "sync_s": t2 - t1, "generate_s": t3 - t2, "cpu_s": time.process_time() - c1,
                       **carried}
            carried = send_timed(results, BatchDone(spec.index, order.iteration, order.attempt, batch.state_dict(),
                                                    timings))
    except Exception:  # noqa: BLE001 - reported to the trainer, which names this worker
        try:
            results.send_bytes(pack(WorkerFailed(spec.index, iteration, traceback.format_exc())))
        finally:
            raise SystemExit(1)
