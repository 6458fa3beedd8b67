"""The streaming rollout worker (``buffer.mode=stream``): continuous batching, groups sent as they complete.

Where :func:`~offpolicy_moe.rollout.worker.worker_main` generates one whole iteration per order, this worker keeps
``rollout.stream_slots`` rows decoding (:class:`~offpolicy_moe.rollout.slots.SlotSampler` on the built-in engine,
:class:`~offpolicy_moe.rollout.vllm_stream.VLLMStreamSampler` on vLLM's own scheduler): a finished row's slot
takes the next queued sample at the next decode step, so no row waits for the longest one.  Orders name groups
(:class:`GroupOrder`: group ``g`` is prompt ``g mod P`` of iteration ``g div P``, the prompt the synchronous trainer
gives that group id; each of its ``G`` samples has its own seed).  Newer weights are loaded from the board before
every decode step (updates in flight): each token keeps the version whose forward gave its scores, and a sample is
admitted only after that load, so its first token is sampled by the newest published version.  A group is sent
back (:class:`GroupDone`) when its last sample finishes.  Sampling that meets NaN/Inf ends every group in the slots
(:class:`GroupsNonFinite`; the trainer issues them again) and the worker goes on.
"""
from __future__ import annotations

import os
import time
import traceback
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from offpolicy_moe.models import load_policy
from offpolicy_moe.rollout.group_batch import group_batch
from offpolicy_moe.rollout.seeds import iteration_seed
from offpolicy_moe.rollout.slots import SlotSampler, StreamSample
from offpolicy_moe.rollout.vllm_engine import VLLMRolloutEngine
from offpolicy_moe.rollout.vllm_stream import VLLMStreamSampler
from offpolicy_moe.rollout.weights import WeightBoard
from offpolicy_moe.rollout.messages import (GroupDone, GroupOrder, GroupsNonFinite, Shutdown, WorkerFailed, WorkerReady, WorkerSpec,
                                            pack, send_timed)
from offpolicy_moe.rollout.worker import build_engine, pid_alive, records_routes
from offpolicy_moe.routing.state import ModelShape
from offpolicy_moe.run import probes
from offpolicy_moe.run.nonfinite import NonFiniteError, all_finite
from offpolicy_moe.tasks import apply_chat_template, encode_prompts, make_task

__all__ = ["sample_seed", "stream_sampler", "stream_main"]

_ALIVE_CHECK_STEPS = 64         # decode steps between checks that the trainer still runs


def sample_seed(group_seed: int, sample: int) -> int:
    """The sampling seed of sample ``sample`` of a group whose seed is ``group_seed``."""
    return iteration_seed(group_seed, sample)


@dataclass
class _Open:
    order: GroupOrder
    answer: str
    done: dict = field(default_factory=dict)      # sample index -> FinishedSample


class _Clock:
    """The worker's time since its last report (``wall_s``): decoding (weights taken between tokens included),
    waiting for orders, building and packing groups, blocked sending them, the rest (``wall_s`` minus those: the
    loop's own bookkeeping); CPU seconds and tokens finished."""

    def __init__(self):
        self.generate_s = self.wait_s = self.pack_s = self.send_s = 0.0
        self.tokens = 0
        self.cpu0 = time.process_time()
        self.t0 = time.perf_counter()

    def report(self) -> dict:
        """The parts since the last report, and start a new period."""
        out = {"generate_s": self.generate_s, "wait_s": self.wait_s, "pack_s": self.pack_s, "send_s": self.send_s,
               "wall_s": time.perf_counter() - self.t0, "cpu_s": time.process_time() - self.cpu0,
               "tokens": float(self.tokens)}
        self.__init__()
        return out


def stream_sampler(cfg: Any, model: torch.nn.Module, tok: Any) -> tuple[Any, Any, Any]:
    """``(engine, sampler, route shape)`` of a streaming worker: the built-in engine's
    :class:`~offpolicy_moe.rollout.slots.SlotSampler`, or for ``rollout.engine=vllm`` a vLLM engine started for
    stepping (``stream=True``, ``rollout.stream_slots`` sequences at once) and its
    :class:`~offpolicy_moe.rollout.vllm_stream.VLLMStreamSampler`; the route shape is None when no routes are
    recorded."""
    ro = cfg.rollout
    slots = int(ro.stream_slots)
    if ro.engine == "vllm":
        engine = VLLMRolloutEngine(model, tok, replace(ro, batch_size=slots), record_routes=records_routes(cfg, model),
                                   seed=cfg.seed, stream=True)
        shape = (ModelShape(engine.num_experts, engine.top_k_experts, tuple(engine.layer_ids))
                 if engine.record_routes else None)
        return engine, VLLMStreamSampler(engine), shape
    engine = build_engine(cfg, model, tok)
    shape = engine.controller.shape if engine.controller is not None and engine.record_routes else None
    return engine, SlotSampler(engine, slots), shape


@dataclass
class _Stream:
    """A running streaming worker's state: what it samples with, the groups in its slots, its clock and decode
    steps, and ``group``, the last group a finished sample belonged to (named if the worker fails)."""

    spec: WorkerSpec
    task: Any
    tok: Any
    engine: Any
    sampler: Any
    route_shape: Any
    open_groups: dict[int, _Open] = field(default_factory=dict)
    clock: _Clock = field(default_factory=_Clock)
    steps: int = 0
    group: int = -1

    @property
    def prompts(self) -> int:
        """``rollout.prompts_per_step`` (``P``): group ``g`` is prompt ``g mod P`` of iteration ``g div P``."""
        return int(self.spec.cfg.rollout.prompts_per_step)

    @property
    def group_size(self) -> int:
        """``rollout.group_size`` (``G``): the samples of one group."""
        return int(self.spec.cfg.rollout.group_size)

    @property
    def idle(self) -> bool:
        """No sample is decoding or queued."""
        return self.sampler.active == 0 and self.sampler.queued == 0


def _start_stream(spec: WorkerSpec, board: WeightBoard, results: Any) -> _Stream:
    """Set the process up (environment, probes, threads), load the task and the policy, start the sampler with the
    weights of version 0 (and the newest before every decode step after it), then report
    :class:`~offpolicy_moe.rollout.worker.WorkerReady`."""
    os.environ.update(spec.env or {})
    probes.receive(spec.probe)
    torch.set_num_threads(max(int(spec.threads), 1))
    cfg = spec.cfg
    task = make_task(cfg.task)
    model, tok = load_policy(cfg.model, seed=cfg.seed, task=task, progress=cfg.logging.progress)
    apply_chat_template(task, tok, cfg.task.chat_template)
    engine, sampler, route_shape = stream_sampler(cfg, model, tok)
    engine.forget_version()
    engine.call_between_tokens(board.load_into)      # weights in flight: the newest before every decode step
    board.wait_for(0, spec.weight_timeout_s, what=f"streaming worker {spec.index}")
    board.load_into(engine)
    results.send_bytes(pack(WorkerReady(spec.index, os.getpid())))
    return _Stream(spec, task, tok, engine, sampler, route_shape)


def _take_orders(stream: _Stream, orders: Any) -> bool:
    """Queue the samples of every order waiting on ``orders`` (waiting up to a second for the first one when
    nothing is decoding); False when the trainer said stop (:class:`~offpolicy_moe.rollout.worker.Shutdown`) or
    closed its end."""
    P, G = stream.prompts, stream.group_size
    t0 = time.perf_counter()
    wait = 1.0 if stream.idle else 0.0
    while orders.poll(wait):
        try:
            msg = orders.recv()
        except EOFError:
            return False
        if isinstance(msg, Shutdown):
            return False
        row = stream.task.sample_prompts(msg.group // P, P)[msg.group % P]
        prompt = encode_prompts(stream.tok, [row["prompt"]])[0][0]
        stream.sampler.submit(StreamSample((msg.group, j), prompt, sample_seed(msg.seed, j)) for j in range(G))
        stream.open_groups[msg.group] = _Open(msg, row["answer"])
        wait = 0.0
    stream.clock.wait_s += time.perf_counter() - t0
    return True


def _lose_slots(stream: _Stream, exc: NonFiniteError, results: Any) -> None:
    """Sampling met NaN/Inf: report every group in the slots lost (:class:`GroupsNonFinite`) and empty the
    slots, so the worker goes on with the groups the trainer issues again."""
    lost = sorted(stream.open_groups)
    results.send_bytes(pack(GroupsNonFinite(stream.spec.index, tuple(lost),
                                            tuple(stream.open_groups[g].order.attempt for g in lost),
                                            exc.stage, exc.what)))
    stream.open_groups.clear()
    if isinstance(stream.sampler, VLLMStreamSampler):
        stream.sampler.abort()
    else:
        stream.sampler = SlotSampler(stream.engine, int(stream.spec.cfg.rollout.stream_slots))


def _send_finished(stream: _Stream, finished: Any, results: Any) -> None:
    """File each finished sample under its group, and send every group whose last sample this was: a
    :class:`GroupDone`, or a :class:`GroupsNonFinite` when its behaviour log-probs are not finite."""
    G = stream.group_size
    for sample in finished:
        group, j = sample.key
        stream.group = group
        stream.clock.tokens += int(sample.response_ids.numel())
        entry = stream.open_groups.get(group)
        if entry is None:
            continue
        entry.done[j] = sample
        if len(entry.done) < G:
            continue
        del stream.open_groups[group]
        t0 = time.perf_counter()
        batch = group_batch([entry.done[i] for i in range(G)], answer=entry.answer, group=group,
                            tokenizer=stream.tok, route_shape=stream.route_shape)
        finite = all_finite(batch.behav_logp, batch.response_mask)
        state = batch.state_dict() if finite else None
        stream.clock.pack_s += time.perf_counter() - t0
        if finite:      # its report closes the clock's period; packing and sending it fall in the next one
            msg: Any = GroupDone(stream.spec.index, group, entry.order.attempt, state, stream.clock.report())
        else:
            msg = GroupsNonFinite(stream.spec.index, (group,), (entry.order.attempt,), "generation",
                                  "behaviour log-probs of the sampled tokens")
        spent = send_timed(results, msg)
        stream.clock.pack_s += spent["pack_s"]
        stream.clock.send_s += spent["send_s"]


def _serve(stream: _Stream, orders: Any, results: Any) -> None:
    """Take orders and decode until the trainer says stop or is gone: one decode step at a time, each followed by
    the groups it finished (module docstring)."""
    parent = stream.spec.parent_pid
    while True:
        if not _take_orders(stream, orders):
            return
        if stream.idle:
            if not pid_alive(parent):
                return
            continue
        stream.steps += 1
        if stream.steps % _ALIVE_CHECK_STEPS == 0 and not pid_alive(parent):
            return
        t1 = time.perf_counter()
        try:
            finished = stream.sampler.step()
        except NonFiniteError as exc:
            _lose_slots(stream, exc, results)
            continue
        stream.clock.generate_s += time.perf_counter() - t1
        _send_finished(stream, finished, results)


def stream_main(spec: WorkerSpec, board: WeightBoard, orders: Any, results: Any) -> None:
    """Entry point of a streaming worker process (module docstring); messages on ``results`` (packed):
    :class:`~offpolicy_moe.rollout.worker.WorkerReady`, then :class:`GroupDone` / :class:`GroupsNonFinite`, or
    :class:`~offpolicy_moe.rollout.worker.WorkerFailed` (naming the last group a finished sample belonged to, or
    -1) before it exits."""
    stream = None
    try:
        stream = _start_stream(spec, board, results)
        _serve(stream, orders, results)
    except Exception:  # noqa: BLE001 - reported to the trainer, which names this worker
        try:
            results.send_bytes(pack(WorkerFailed(spec.index, -1 if stream is None else stream.group,
                                                 traceback.format_exc())))
        finally:
            raise SystemExit(1)
