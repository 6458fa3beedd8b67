"""The synchronous batch source (``buffer.mode=fixed|bounded``): generation in the trainer's process, through a
staleness buffer.

Each :meth:`SyncBatchSource.next` runs generation iterations until the buffer releases a batch: generate
iteration ``i`` with the rollout engine (the process's share of its prompts, seeded by ``(seed, i, rank)``), hand
it to the preparation stage (old log-probs under the weights that generated it), push it into the
:class:`~offpolicy_moe.sources.buffer.StalenessBuffer`, and pop the batch to train on: the one of iteration
``i - k`` (``fixed``), or the earliest-generated one that has arrived within the bound (``bounded``).  During the
first ``k`` iterations of a fixed delay nothing is released, so the first ``next`` generates ``k + 1`` iterations.

A batch whose generation or preparation meets a NaN/Inf (agreed over processes) never enters the buffer: ``next``
returns its error and the next call generates the following iteration in its place, so the delay line keeps its
exact staleness; each dropped iteration extends the iteration budget by one.
"""
from __future__ import annotations

import time
from typing import Any, Mapping, Optional

import torch

from offpolicy_moe.rollout.batch import RolloutBatch
from offpolicy_moe.rollout.seeds import iteration_seed
from offpolicy_moe.rollout.worker import checked_generation
from offpolicy_moe.run.nonfinite import NonFiniteError
from offpolicy_moe.sources.buffer import StalenessBuffer, iteration_budget
from offpolicy_moe.logprobs.stage import PreparedBatch
from offpolicy_moe.config.validate import Findings, infer_model_is_moe
from offpolicy_moe.sources.base import BatchSource, Preparation, refuse_vllm_in_flight
from offpolicy_moe.sources.modes import mode_of

__all__ = ["SyncBatchSource"]


class SyncBatchSource(BatchSource):
    """Generation by ``engine`` in this process, prepared by ``stage``, released through a staleness buffer (module
    docstring); ``rank`` / ``world``: this process generates prompts ``rank, rank + world, ...`` of each
    iteration."""

    builds_engine = True

    @classmethod
    def build(cls, cfg: Any, *, engine: Any, task: Any, model: torch.nn.Module, stage: Preparation, rank: int,
              world: int, pad_id: int) -> "SyncBatchSource":
        """The source over the trainer's own ``engine`` (``model`` and ``pad_id`` are the workers' business)."""
        return cls(cfg, engine=engine, task=task, stage=stage, rank=rank, world=world)

    @classmethod
    def keeps_versions(cls, cfg: Any) -> int:
        """One past version when generation holds a version the trainer has moved past (``rollout.publish_every``
        > 1), else none: the delay line's batches are prepared as they are generated."""
        return 1 if int(cfg.rollout.publish_every) > 1 else 0

    @classmethod
    def on_policy(cls, cfg: Any) -> bool:
        """An exact delay line of staleness 0 (``buffer.mode=fixed``): every batch is trained by the weights that
        sampled it."""
        return not mode_of(cfg).random_delay and int(cfg.buffer.staleness) == 0

    @classmethod
    def check_rules(cls, cfg: Any, found: Findings) -> None:
        """No Ray backend (it places workers, and this source has none); drift metrics that an on-policy run with
        one update per step never logs (a warning); vLLM takes no weights in flight."""
        b, ro, rt = cfg.buffer, cfg.rollout, cfg.algo.routing
        if ro.backend == "ray":
            found.error(f"rollout.backend=ray places rollout workers of buffer.mode=async; buffer.mode={b.mode} "
                        "generates in the trainer's process: set buffer.mode=async or rollout.backend=local")
        if (rt.drift_metrics and (rt.metrics or rt.replay in ("r3", "pr2")) and infer_model_is_moe(cfg) is not False
                and cfg.trainer.updates_per_step == 1 and cls.on_policy(cfg)):
            found.warn("algo.routing.drift_metrics=true with one update per on-policy batch logs nothing: drift/* is "
                       "measured at off-policy mini-steps only")
        refuse_vllm_in_flight(cfg, found)

    def __init__(self, cfg: Any, *, engine: Any, task: Any, stage: Preparation, rank: int = 0, world: int = 1):
        b = cfg.buffer
        self.cfg, self.engine, self.task, self.stage = cfg, engine, task, stage
        self.nan_dropped = 0        # iterations dropped for non-finite values (each extends the budget by one)
        self.rank, self.world = int(rank), int(world)
        self.kind = mode_of(cfg).name           # the checkpoint's record of the mode
        random_delay = mode_of(cfg).random_delay
        self.buffer = StalenessBuffer(b.staleness, random_delay, max_delay=b.max_delay, seed=cfg.seed)
        self.max_iterations = iteration_budget(cfg.trainer.steps, b.staleness, random_delay)
        self.publish_every = int(cfg.rollout.publish_every)
        self.iteration = 0
        self.version = 0            # the version the trainer's model holds
        self.published = 0          # the version the engine holds
        self._released = False      # a batch was handed out and its iteration is not yet completed (publish)

    @property
    def dropped(self) -> int:
        return self.buffer.dropped

    def __len__(self) -> int:
        return len(self.buffer)

    def generate(self, iteration: int) -> RolloutBatch:
        """Iteration ``iteration``'s batch: this process's share of its ``rollout.prompts_per_step`` prompts,
        ``rollout.group_size`` responses each, with globally unique group ids ``iteration * prompts + j``."""
        return checked_generation(self.engine, self.task, self.cfg.rollout, iteration=iteration,
                                  seed=iteration_seed(self.cfg.seed, iteration, self.rank), rank=self.rank,
                                  world=self.world)

    def next(self, step: int) -> tuple[PreparedBatch, dict[str, float]]:
        """Generate and prepare iterations until the buffer releases the batch of step ``step``, or one of them is
        non-finite (its error is returned).  A bounded buffer that drops every batch raises once the run's iteration
        budget is spent (``check_buffer_feasible`` refuses such configurations before the run)."""
        t_gen = t_old = 0.0
        tokens = 0
        while True:
            if self.iteration >= self.max_iterations + self.nan_dropped:
                raise RuntimeError(f"bounded buffer starved: {self.iteration} iterations produced only {step} "
                                   "trained steps (every batch dropped?)")
            t0 = t1 = time.perf_counter()
            try:
                batch = self.generate(self.iteration)
            except NonFiniteError as exc:
                prepared = PreparedBatch(None, exc)
            else:
                t1 = time.perf_counter()
                prepared = self.stage.prepare(batch, current=self.version)
            prepared = self.stage.agree(prepared)      # every process, every iteration
            t_gen, t_old = t_gen + (t1 - t0), t_old + (time.perf_counter() - t1)
            if prepared.error is not None:
                err = prepared.error.located(step + 1, self.iteration)
                self.nan_dropped += 1
                self.iteration += 1
                return PreparedBatch(None, err), {}
            tokens += prepared.batch.num_tokens()
            self.buffer.push(prepared.batch, self.iteration)
            consumed, _ = self.buffer.pop(self.iteration, step)
            if consumed is not None:
                self._released = True
                return PreparedBatch(consumed), {"perf/time_generate_s": t_gen, "perf/time_old_logp_s": t_old,
                                                 "perf/gen_tokens_per_s": tokens / max(t_gen, 1e-9)}
            self.iteration += 1         # warm-up (fixed) or nothing arrived yet (bounded): only generated

    def publish(self, weights: Mapping[str, torch.Tensor], version: int,
                predictors: Optional[Mapping[str, torch.Tensor]] = None, *, force: bool = False) -> None:
        """After a trained step this completes the iteration whose batch it trained on; the engine takes
        ``weights`` as version ``version`` when ``version`` is a multiple of ``rollout.publish_every`` (or
        ``force``), and keeps the version it holds otherwise."""
        if self._released:
            self.iteration += 1
            self._released = False
        self.version = int(version)
        if force or version % self.publish_every == 0:
            self.engine.sync(weights, version, predictors)
            self.stage.keep(version, weights)
            self.published = int(version)

    def close(self) -> None:
        """Stop the engine this source generates with (a vLLM engine's processes and client threads), so that
        nothing it started outlives the run; idempotent."""
        self.engine.close()

    def state_dict(self) -> dict:
        return {"mode": self.kind, "iteration": self.iteration, "published": self.published,
                "nan_dropped": self.nan_dropped, "buffer": self.buffer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if state.get("mode") != self.kind:
            raise ValueError(f"checkpointed batch source has buffer.mode={state.get('mode')!r}, but the config asks "
                             f"for buffer.mode={self.kind!r}")
        self.buffer.load_state_dict(state["buffer"])
        self.iteration, self._released = int(state["iteration"]), False
        self.published = int(state["published"])
        self.nan_dropped = int(state.get("nan_dropped", 0))
