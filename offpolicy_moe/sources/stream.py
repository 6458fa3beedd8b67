"""The trainer's side of streaming rollouts (``buffer.mode=stream``, docs/async.md "Streaming").

:class:`StreamBatchSource` keeps ``rollout.workers`` streaming workers
(:func:`~offpolicy_moe.rollout.stream_worker.stream_main`) busy with groups: whenever a version is published it
issues new groups, up to ``P (k + 1)`` outstanding (:func:`~offpolicy_moe.sources.admission.may_issue`), each with
the deadline ``published + k``.  Workers send each group when its last sample finishes; a step trains ``P`` complete
groups chosen by ``buffer.admission`` (:mod:`~offpolicy_moe.sources.admission`), concatenated into one batch and
handed to the preparation stage (old log-probs per token under the version that sampled it; the stage keeps the
last ``k + 1`` published versions).

A worker's death is answered as in the asynchronous source (restart and re-issue its groups, or stop); a group whose
sampling met NaN/Inf comes back as the step's error (the loop applies ``trainer.on_nan``) and is issued again.

A checkpoint holds the complete groups not yet trained (with their per-token versions and routes), every outstanding
group's deadline and attempt, the counters and the length records; groups in flight are not saved: on resume they
are issued again under the same seeds.
"""
from __future__ import annotations

import time
from dataclasses import replace
from statistics import fmean
from typing import Any, Optional

import torch

from offpolicy_moe.config.schema import BufferConfig, RolloutConfig
from offpolicy_moe.config.validate import ConfigError
from offpolicy_moe.logprobs.stage import PreparedBatch
from offpolicy_moe.rollout.batch import RolloutBatch
from offpolicy_moe.rollout.group_batch import cat_batches
from offpolicy_moe.rollout.seeds import iteration_seed
from offpolicy_moe.rollout.slots import check_slot_settings
from offpolicy_moe.rollout.messages import GroupDone, GroupOrder, GroupsNonFinite
from offpolicy_moe.rollout.stream_worker import stream_main
from offpolicy_moe.run.full_state import is_sharded
from offpolicy_moe.run.nonfinite import NonFiniteError
from offpolicy_moe.sources.admission import Ticket, deadline_choice, first_finished_choice, ks_distance, may_issue
from offpolicy_moe.sources.base import BatchSource, Preparation
from offpolicy_moe.sources.process_transport import ProcessTransport
from offpolicy_moe.sources.transport import (PipelineTimeout, PublishesToWorkers, WorkerLost, WorkerTransport,
                                            handle_events, restart_or_stop)

__all__ = ["StreamBatchSource", "check_stream_config"]


def check_stream_config(cfg: Any, world: int = 1) -> None:
    """One-line ``ValueError`` for a config ``buffer.mode=stream`` cannot run (before any process starts)."""
    problems = StreamBatchSource.problems(cfg)
    if problems:
        raise ValueError(problems[0])
    if world != 1:
        raise ValueError(f"buffer.mode=stream trains in one process; this run has {world}: use buffer.mode=async "
                         "for several trainer processes")


def _lengths(batch: RolloutBatch) -> list[int]:
    return [int(n) for n in batch.response_mask.sum(1).tolist()]


class StreamBatchSource(PublishesToWorkers, BatchSource):
    """Streaming workers and the admission of their groups (module docstring).  ``model``: the trainer's bare
    policy (refused when sharded); ``stage``: the preparation of each step's batch; ``pad_id``: the tokenizer's
    padding id; ``transport``: the workers (default: processes on this machine)."""

    worker_entry = staticmethod(stream_main)
    reads = (("rollout.stream_slots", RolloutConfig().stream_slots), ("buffer.admission", BufferConfig().admission))

    @classmethod
    def build(cls, cfg: Any, *, engine: Any, task: Any, model: torch.nn.Module, stage: Preparation, rank: int,
              world: int, pad_id: int) -> "StreamBatchSource":
        """Streaming workers over copies of ``model``; ``pad_id`` pads the groups concatenated into a step."""
        return cls(cfg, model=model, stage=stage, pad_id=pad_id, rank=rank, world=world)

    @classmethod
    def problems(cls, cfg: Any) -> list[str]:
        """What a stream cannot run: its rows always span weight updates (R2's one recorded route per token cannot
        hold, PR2's predictors do not reach the workers), its slots are the built-in engine's native sampler or
        vLLM's scheduler, over the full distribution, its workers run on this machine, and a group must be trained
        within ``k`` versions of the newest one published when it was issued."""
        rt, ro = cfg.algo.routing, cfg.rollout
        out = []
        if rt.replay in ("r2", "pr2"):
            out.append(f"buffer.mode=stream does not support algo.routing.replay={rt.replay}: its rows continue "
                       "across weight updates, so the trainer cannot record one version's routes for them; use r3 "
                       "or none")
        if ro.engine == "hf" and ro.sampler != "native":
            out.append(f"buffer.mode=stream with rollout.engine=hf runs the built-in engine's slots, which need "
                       f"rollout.sampler=native; got rollout.sampler={ro.sampler}")
        if ro.top_k > 0 or ro.top_p < 1:
            out.append("buffer.mode=stream samples the full distribution: set rollout.top_k=0 and rollout.top_p=1")
        if ro.backend != "local":
            out.append("buffer.mode=stream runs its workers on this machine: set rollout.backend=local")
        if ro.publish_every > cfg.buffer.staleness + 1:
            out.append(f"rollout.publish_every={ro.publish_every} with buffer.mode=stream and buffer.staleness="
                       f"{cfg.buffer.staleness}: a group must be trained within k versions of the newest published "
                       "one when it was issued; lower rollout.publish_every to <= k + 1")
        return out

    @classmethod
    def check_engine(cls, cfg: Any, model_config: Any) -> None:
        """On the built-in engine, its slot sampler's settings (vLLM's stream engine is the vLLM engine, whose own
        checks ran)."""
        ro = cfg.rollout
        if ro.engine == "hf":
            check_slot_settings(ro.sampler, int(ro.top_k), float(ro.top_p), cfg.algo.routing.replay == "pr2",
                                model_config)

    def __init__(self, cfg: Any, *, model: torch.nn.Module, stage: Preparation, pad_id: int, rank: int = 0,
                 world: int = 1, transport: Optional[WorkerTransport] = None):
        check_stream_config(cfg, world)
        if is_sharded(model):
            raise ConfigError("buffer.mode=stream with a sharded (FSDP) policy: the workers' weights and the "
                              "per-version old log-probs need full copies of the policy")
        b, ro = cfg.buffer, cfg.rollout
        self.cfg, self.rank, self.pad_id = cfg, int(rank), int(pad_id)
        self.stage = stage
        self.k, self.per_step = int(b.staleness), int(ro.prompts_per_step)
        self.rule = b.admission
        self.n_workers = int(ro.workers)
        self.on_death = ro.on_worker_death
        self.timeout = float(ro.worker_timeout_s)
        self.publish_every = int(ro.publish_every)
        self.early_start = bool(ro.early_start)
        self.version = 0
        self.published = 0
        self.cursor = 0                          # the next step to train
        self.next_group = 0                      # the next group never issued
        self.tickets: dict[int, Ticket] = {}     # outstanding groups: issued, neither trained nor dropped
        self.ready: dict[int, RolloutBatch] = {}
        self.attempts: dict[int, int] = {}
        self.holder: dict[int, int] = {}         # group in flight -> worker slot
        self.arrivals = 0
        self.dropped_late = 0
        self.restarts = 0
        self.errors: list[NonFiniteError] = []
        self.generated_lengths: list[int] = []   # response lengths of every row received
        self.trained_lengths: list[int] = []     # ... and of every row trained
        self.trained_groups: list[int] = []      # every group trained, in order
        self._arrived_since: list[int] = []
        self.timing = {"worker_generate_s": 0.0, "worker_wait_s": 0.0, "worker_cpu_s": 0.0, "worker_tokens": 0.0,
                       "worker_pack_s": 0.0, "worker_send_s": 0.0, "worker_wall_s": 0.0, "weight_sync_s": 0.0}
        self._before = dict(self.timing)
        self._slots: dict[int, int] = {}
        self._started = False
        self.transport: WorkerTransport = (transport if transport is not None
                                           else ProcessTransport(cfg, entry=stream_main, rank=rank))

    # ------------------------------------------------------------------ the BatchSource seam
    @property
    def iteration(self) -> int:
        """The newest version the trainer holds (a step's groups span several iterations' prompts)."""
        return self.version

    @property
    def dropped(self) -> int:
        """Groups dropped for exceeding the bound (``buffer.admission=first_finished`` only)."""
        return self.dropped_late

    def __len__(self) -> int:
        return len(self.ready)

    def state_dict(self) -> dict:
        """What a checkpoint needs to resume without losing or repeating a group (module docstring)."""
        return {"mode": "stream", "k": self.k, "cursor": self.cursor, "published": self.published,
                "next_group": self.next_group, "arrivals": self.arrivals, "dropped": self.dropped_late,
                "restarts": self.restarts, "attempts": dict(self.attempts),
                "tickets": {g: [t.deadline, t.done, t.oldest_version] for g, t in self.tickets.items()},
                "ready": {g: b.state_dict() for g, b in self.ready.items()},
                "generated_lengths": list(self.generated_lengths), "trained_lengths": list(self.trained_lengths),
                "trained_groups": list(self.trained_groups)}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`; groups that were in flight are issued again when the workers start."""
        if state.get("mode") != "stream" or state.get("k") != self.k:
            raise ValueError(f"checkpointed buffer has staleness={state.get('k')} mode={state.get('mode')!r}, "
                             f"but the config asks for staleness={self.k} mode='stream'")
        self.cursor, self.published = int(state["cursor"]), int(state["published"])
        self.next_group, self.arrivals = int(state["next_group"]), int(state["arrivals"])
        self.dropped_late, self.restarts = int(state["dropped"]), int(state["restarts"])
        self.attempts = {int(g): int(a) for g, a in state["attempts"].items()}
        self.ready = {int(g): RolloutBatch.from_state_dict(b) for g, b in state["ready"].items()}
        self.tickets = {int(g): Ticket(int(g), int(d), done, oldest)
                        for g, (d, done, oldest) in state["tickets"].items()}
        self.generated_lengths = list(state["generated_lengths"])
        self.trained_lengths = list(state["trained_lengths"])
        self.trained_groups = list(state["trained_groups"])

    def next(self, step: int) -> tuple[PreparedBatch, dict[str, float]]:
        """The prepared batch of step ``step``: ``P`` complete groups chosen by the admission rule, waiting for
        those it must have; or the error of a group whose sampling met NaN/Inf."""
        if step != self.cursor:
            raise RuntimeError(f"stream: the trainer asks for step {step}, the next one is {self.cursor} (a checkpoint "
                               "from another buffer mode?)")
        if not self._started:
            self._start()
        t0 = time.perf_counter()
        last = t0
        while True:
            self._receive(timeout=0)
            if self.errors:
                return PreparedBatch(None, self.errors.pop(0)), {}
            choice = self._choose(step)
            if not choice.wait:
                break
            if self._receive(timeout=min(1.0, self.timeout)):
                last = time.perf_counter()
            elif time.perf_counter() - last > self.timeout:
                raise PipelineTimeout(f"waited {self.timeout:.0f} s (rollout.worker_timeout_s) for the groups of "
                                      f"step {step} ({len(self.ready)} complete, {len(self.holder)} in flight)")
        waited = time.perf_counter() - t0
        # a step's batch counts as iteration ``step`` (its groups come from several), as in the other sources
        batch = replace(cat_batches([self.ready.pop(g) for g in choice.train], self.pad_id), generated_at=step)
        t1 = time.perf_counter()
        prepared = self.stage.prepare(batch, current=self.version)
        prep = time.perf_counter() - t1
        if prepared.error is not None:         # not trained: the groups are generated again under their seeds
            self._reissue(list(choice.train))
            return prepared, {}
        for g in choice.train:
            del self.tickets[g]
        self.trained_groups.extend(choice.train)
        trained = _lengths(batch)
        self.trained_lengths.extend(trained)
        self.cursor = step + 1
        delta = {k: self.timing[k] - self._before[k] for k in self.timing}
        self._before = dict(self.timing)
        generated = self._arrived_since or self.generated_lengths or trained
        self._arrived_since = []
        return prepared, {
            "async/trainer_wait_s": waited, "perf/time_old_logp_s": prep,
            "async/weight_sync_s": delta["weight_sync_s"], "async/worker_wait_s": delta["worker_wait_s"],
            "async/worker_generate_s": delta["worker_generate_s"], "async/worker_cpu_s": delta["worker_cpu_s"],
            "async/worker_pack_s": delta["worker_pack_s"], "async/worker_send_s": delta["worker_send_s"],
            "async/worker_wall_s": delta["worker_wall_s"],
            "async/worker_blocked_share": delta["worker_send_s"] / max(delta["worker_wall_s"], 1e-9),
            "async/worker_restarts": float(self.restarts), "async/trained_tokens": float(sum(trained)),
            "stream/worker_tokens": delta["worker_tokens"],
            "stream/generated_len_mean": fmean(generated), "stream/trained_len_mean": fmean(trained),
            "stream/ks_trained_vs_generated": ks_distance(self.trained_lengths, self.generated_lengths),
            "stream/dropped_late": float(self.dropped_late), "stream/outstanding": float(len(self.tickets))}

    def _after_publish(self, version: int) -> None:
        self._issue()

    def _start_early(self) -> None:
        self._start()

    # ------------------------------------------------------------------ groups
    def _choose(self, step: int):
        tickets = list(self.tickets.values())
        if self.rule == "deadline":
            return deadline_choice(tickets, step, self.per_step)
        choice = first_finished_choice(tickets, step, self.per_step, self.k)
        if choice.drop:
            for g in choice.drop:
                del self.tickets[g]
                self.ready.pop(g)
            self.dropped_late += len(choice.drop)
            self._issue()
        return choice

    def _start(self) -> None:
        """Start the workers with the newest published weights; issue the outstanding groups not in hand (a
        resumed run's groups in flight, same seeds) and new ones.  A resumed run's complete groups sampled by a
        version older than the one it resumes at are generated again too: the weights of those versions are not
        in the checkpoint, so their old log-probs could not be taken."""
        self.transport.start(self.stage.weights(self.published), self.published)
        self._started = True
        for i in range(self.n_workers):
            self.transport.spawn(i, 0)
            self._slots[i] = 0
        for g in [g for g, b in self.ready.items() if int(b.version) < self.published]:
            del self.ready[g]
        self._reissue([g for g in sorted(self.tickets) if g not in self.ready])
        self._issue()

    def _send(self, group: int) -> None:
        busy = {i: 0 for i in self._slots}
        for w in self.holder.values():
            if w in busy:
                busy[w] += 1
        worker = min(busy, key=lambda i: (busy[i], i))
        self.holder[group] = worker
        self.transport.send(worker, GroupOrder(group, iteration_seed(self.cfg.seed, group, self.rank, salt=1),
                                               self.attempts[group]))

    def _issue(self) -> None:
        """New groups, as many as :func:`may_issue` allows, due ``k`` versions after the newest published."""
        for _ in range(may_issue(len(self.tickets), self.per_step, self.k)):
            g = self.next_group
            self.next_group += 1
            self.attempts[g] = 0
            self.tickets[g] = Ticket(g, self.published + self.k)
            self._send(g)

    def _reissue(self, groups: list[int]) -> None:
        """Issue ``groups`` again (same seeds, the next attempt), due ``k`` versions after the newest published."""
        for g in groups:
            self.attempts[g] = self.attempts.get(g, -1) + 1
            self.tickets[g] = Ticket(g, max(self.tickets[g].deadline, self.published + self.k))
            self.holder.pop(g, None)
            self._send(g)

    # ------------------------------------------------------------------ receiving
    def _receive(self, timeout: float) -> bool:
        return handle_events(self.transport, timeout, {WorkerLost: self._on_death, GroupDone: self._on_group,
                                                       GroupsNonFinite: self._on_nonfinite}, "stream")

    def _current(self, group: int, attempt: int) -> bool:
        return group in self.tickets and group not in self.ready and self.attempts.get(group) == attempt

    def _on_group(self, msg: GroupDone) -> None:
        for key in ("generate_s", "wait_s", "cpu_s", "pack_s", "send_s", "wall_s"):
            self.timing[f"worker_{key}"] += float(msg.timings.get(key, 0.0))
        self.timing["worker_tokens"] += float(msg.timings["tokens"])
        if not self._current(msg.group, msg.attempt):
            return                                # a superseded attempt, or a dropped group
        self.holder.pop(msg.group, None)
        batch = RolloutBatch.from_state_dict({**msg.state, "extras": {}})
        self.ready[msg.group] = batch
        t = self.tickets[msg.group]
        self.tickets[msg.group] = Ticket(t.group, t.deadline, self.arrivals, int(batch.version))
        self.arrivals += 1
        lengths = _lengths(batch)
        self.generated_lengths.extend(lengths)
        self._arrived_since.extend(lengths)

    def _on_nonfinite(self, msg: GroupsNonFinite) -> None:
        lost = [g for g, a in zip(msg.groups, msg.attempts) if self._current(g, a)]
        if not lost:
            return
        self.errors.append(NonFiniteError(msg.stage, f"{msg.what} (streaming worker {msg.index}, groups {lost})",
                                          iteration=self.cursor - 1))
        self._reissue(lost)

    def _on_death(self, lost_worker: WorkerLost) -> None:
        index = lost_worker.index
        lost = sorted(g for g, w in self.holder.items() if w == index)
        msg = f"{self.transport.describe(index)} died while generating group(s) {lost[:8]}: {lost_worker.reason}"
        restarts = self._slots.pop(index)
        self.transport.retire(index)
        self._slots[index] = restart_or_stop(self.transport, index, restarts, msg, self.on_death)
        self.restarts += 1
        self._reissue(lost)

    def worker_pids(self) -> list[int]:
        """Process ids of the live workers (slot order)."""
        return self.transport.pids()

    def close(self, timeout: float = 5.0) -> None:
        """Stop the workers; idempotent."""
        self.transport.close(timeout)
        self._slots = {}
