"""The Accelerate training loop.

One iteration ``i`` of :meth:`Trainer.run`:

1. ``generate``: the engine (weights of policy version ``v``, its own precision) samples ``G`` responses for this
   process's share of ``rollout.prompts_per_step`` prompts (prompts and sampling seeded by ``(seed, i)``: a resumed
   run regenerates the same batch);
2. ``prepare`` (the run's :mod:`~offpolicy_moe.trainer.old_logp_strategy`): ``old_logp`` under the same weights θ_v
   (R3/PR2: replaying the engine's routes; R2: recording its own routes), and the train/inference and routing
   mismatch measurements;
3. the batch enters the staleness buffer, which releases the batch to train on (exact delay ``k`` or bounded);
4. ``update`` (:class:`~offpolicy_moe.trainer.update.PolicyUpdate`): rewards and group advantages of the released
   batch; ``trainer.updates_per_step`` optimizer updates over contiguous mini-batches of ``trainer.grad_accum``
   micro-batches; global loss denominators; every forward replays routes as configured (PR2: predictor loss in
   its own parameter group);
5. evaluation when due; the engine is synced (version v+1) with weights known to be finite, metrics are logged,
   checkpoints written every ``trainer.checkpoint_every``.

Each iteration is a transaction owned by the loop (:class:`~offpolicy_moe.trainer.transaction.StepTransaction`):
opened at the iteration boundary, committed when the step is done, rolled back when it cannot be.  A NaN/Inf in
any stage is one :class:`~offpolicy_moe.run.nonfinite.NonFiniteError`, raised where it is found; the loop alone
applies ``trainer.on_nan`` to it (:meth:`Trainer.apply_nan_policy`, the one :class:`NanCounter` of the run,
docs/faults.md): ``skip`` drops the batch (generation, old log-probs, measurements, reference) or the optimizer
update (loss, gradients, parameters; that update rolled back), or rolls the update back (evaluation), counts it
and goes on, up to ``trainer.max_nan_skips`` in a row; ``stop`` (or one skip too many) rolls the step back to its
boundary, checkpoints that last finite state and ends the run with status ``diverged``.

``trainer.steps`` counts TRAINED steps; with staleness ``k`` the first ``k`` iterations only generate.

Faults: the run holds its folder's lock (:mod:`~offpolicy_moe.run.run_lock`) while it lives; SIGINT / SIGTERM
stop it at the next iteration boundary with a checkpoint there (:mod:`~offpolicy_moe.run.signals`, status
``stopped``); a diverged run checkpoints the last good step boundary before failing (status ``diverged``).
"""
from __future__ import annotations

import os
import random
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import DistributedDataParallelKwargs

from offpolicy_moe.rollout.batch import RolloutBatch
from offpolicy_moe.sources import fork_server
from offpolicy_moe.trainer.micro_batch import MicroBatching, max_over_processes
from offpolicy_moe.trainer.checks import CheckedConfig, check_config
from offpolicy_moe.trainer.callbacks import Callback, CallbackList
from offpolicy_moe.run.checkpoint import LoadedCheckpoint, set_rng_state
from offpolicy_moe.run.export import export_final
from offpolicy_moe.run.full_state import full_model_state
from offpolicy_moe.trainer.forward import RoutedForward
from offpolicy_moe.run import probes
from offpolicy_moe.run.nonfinite import NanCounter, NonFiniteError, all_finite, as_nonfinite
from offpolicy_moe.run.loggers import ConsoleLogger, MultiLogger
from offpolicy_moe.trainer.old_logp import OldLogpPass
from offpolicy_moe.sources.base import SourceStopped
from offpolicy_moe.run.run_dir import RunDir
from offpolicy_moe.trainer.build import (build_engine, build_optimizer, build_source, frozen_reference,
                                        old_logp_strategy, routing_controller)
from offpolicy_moe.trainer.evaluation import eval_due, evaluate_policy
from offpolicy_moe.trainer.finite_agreement import agree_on_stage
from offpolicy_moe.trainer.run_checkpoints import RunCheckpoints
from offpolicy_moe.trainer.transaction import StepTransaction
from offpolicy_moe.trainer.sft import sft_warm_start
from offpolicy_moe.trainer.step_metrics import mean_over_processes, offpolicy_metrics
from offpolicy_moe.run.signals import RunInterrupted, StopRequest, graceful_stop
from offpolicy_moe.trainer.update import PolicyUpdate, TrainedPolicy, loss_setup
from offpolicy_moe.models import is_moe, load_policy
from offpolicy_moe.routing import PR2Predictors, RoutingController
from offpolicy_moe.tasks import RewardError, apply_chat_template, make_task

__all__ = ["Trainer", "TrainingStopped"]


class TrainingStopped(RuntimeError):
    """The run was stopped (e.g. by a callback or a signal) after a clean checkpoint."""


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's global generators."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _set_determinism(tc: Any) -> None:
    if tc.threads and tc.threads > 0:
        torch.set_num_threads(int(tc.threads))
    if tc.deterministic and torch.cuda.is_available():   # CPU kernels are deterministic at a fixed thread count
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False


def _accelerator() -> Accelerator:
    # (no cpu=True: Accelerate would then force a single process.)  Launched as several CPU processes
    # (torchrun / accelerate launch set WORLD_SIZE), Accelerate only goes MULTI_CPU with ACCELERATE_USE_CPU.
    if not torch.cuda.is_available() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        os.environ.setdefault("ACCELERATE_USE_CPU", "true")
    return Accelerator(kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True)])


class Trainer:
    """Builds everything a run needs from a :class:`~offpolicy_moe.config.schema.TrainConfig` and runs it.

    ``callbacks``: :class:`~offpolicy_moe.trainer.callbacks.Callback` observers (tests, experiments); they never
    change what is computed."""

    def __init__(self, cfg: Any, *, resume: bool = False, callbacks: Optional[Iterable[Callback]] = None,
                 checked: Optional[CheckedConfig] = None):
        """``checked``: what :func:`~offpolicy_moe.trainer.checks.check_config` returned for ``cfg`` (the CLI checks
        once, before the run folder is touched); without it the checks run here."""
        self.cfg, self.resume = cfg, resume
        self.callbacks = CallbackList(callbacks)
        tc, rt = cfg.trainer, cfg.algo.routing
        # the folder lock is taken by the main process (global rank 0; several processes share the folder)
        self.run_dir = RunDir(cfg.run_dir, min_free_mb=tc.min_free_mb, resume=resume,
                              is_main=int(os.environ.get("RANK", "0")) == 0)
        _set_determinism(tc)
        if checked is None:
            checked = check_config(cfg)
            for w in checked.warnings:
                print(f"offpolicy-moe: warning: {w}", file=sys.stderr)
        # a checked config with local workers started early: their fork server imports beside the model load
        # (`offpolicy-moe train` has started it already, right after validating the config)
        fork_server.start_early(cfg)
        self.accelerator = _accelerator()
        self.world, self.rank = self.accelerator.num_processes, self.accelerator.process_index
        self.run_dir.is_main = self.is_main
        seed_everything(cfg.seed)
        self.task = checked.task if checked.task is not None else make_task(cfg.task)
        model, self.tok = load_policy(cfg.model, seed=cfg.seed, task=self.task)
        # prompts in the tokenizer's chat template when it has one (task.chat_template=auto); recorded in the run
        self.chat = apply_chat_template(self.task, self.tok, cfg.task.chat_template)
        self.is_moe = bool(is_moe(model))
        if not self.is_moe and rt.replay != "none":
            raise ValueError(f"algo.routing.replay={rt.replay!r} needs a Mixture-of-Experts model, but "
                             f"{type(model).__name__} has no MoE layer (model.preset={cfg.model.preset!r})")
        self.measure_routing = self.is_moe and bool(rt.metrics)
        model.train()
        self.controller = routing_controller(model, cfg, is_moe=self.is_moe, measure_routing=self.measure_routing)
        self.predictors = PR2Predictors.from_controller(self.controller) if rt.replay == "pr2" else None
        self.ref_model: Optional[torch.nn.Module] = None   # created after the SFT warm start when algo.kl.coef > 0
        self.optimizer, self.scheduler = build_optimizer(model, self.predictors, cfg)
        if self.predictors is not None:
            self.predictors.to(self.accelerator.device)
        self.unwrapped = model
        # the synchronous source's engine: its own copy of the bare model, before FSDP can shard it (the
        # asynchronous source's workers build theirs from the config)
        self.engine = (build_engine(model, self.tok, cfg, self.predictors, is_moe=self.is_moe,
                                    measure_routing=self.measure_routing, device=self.accelerator.device)
                       if cfg.buffer.mode != "async" else None)
        self.model, self.optimizer = self.accelerator.prepare(model, self.optimizer)
        self.unwrapped = self.accelerator.unwrap_model(self.model)     # the bare model (no DDP wrapper)
        self.forward = RoutedForward(device=self.accelerator.device, controller=self.controller, replay=rt.replay,
                                     share_prompt=tc.share_prompt,
                                     temperature=cfg.rollout.temperature, group_size=cfg.rollout.group_size,
                                     micro_batching=MicroBatching.from_trainer(
                                         tc, max_over_processes(self.accelerator.device) if self.world > 1 else None))
        self.nan = NanCounter(tc.on_nan, tc.max_nan_skips)     # the run's one non-finite policy (the loop's alone)
        loss = loss_setup(cfg.algo.loss, self.world)
        passes = OldLogpPass(self.forward, self.unwrapped, cfg, is_moe=self.is_moe,
                             measure_routing=self.measure_routing)
        # the run's one old-log-prob strategy (trainer/build.py decides it, once)
        self.old_logp = old_logp_strategy(cfg, passes, needs_global_pass=loss.spec.needs_global_pass,
                                          device=self.accelerator.device)
        policy = TrainedPolicy(self.model, self.unwrapped, self.optimizer, self.scheduler, self.predictors)
        self.policy_update = PolicyUpdate(cfg, loss=loss, forward=self.forward, old_logps=self.old_logp,
                                          policy=policy, accelerator=self.accelerator, task=self.task)
        self.source = build_source(cfg, engine=self.engine, task=self.task, model=self.unwrapped, prepare=self.prepare,
                                   on_nonfinite=self.drop_nonfinite, rank=self.rank, world=self.world)
        self.run_checkpoints = RunCheckpoints(accelerator=self.accelerator, run_dir=self.run_dir, model=self.unwrapped,
                                              keep=tc.keep_checkpoints)
        # counters (all checkpointed; updates live in the policy update, non-finite counts in self.nan, iterations
        # in the source)
        self.step = 0               # trained steps done = policy version
        self.sft_done = False
        self.last_metrics: dict[str, float] = {}
        self.saved_at: Optional[tuple[int, int]] = None     # (step, iteration) of the newest checkpoint written
        self.stop_request = StopRequest()                    # set by a signal inside run()
        self.logger: Optional[MultiLogger] = None
        self.console: Optional[ConsoleLogger] = None
        # the step as a transaction: what a rolled-back step puts back besides weights, optimizer and scheduler
        self.transaction = StepTransaction(self.optimizer, self.scheduler,
                                           {"source": self.source, "nan": self.nan, "trainer": self},
                                           on_nan=tc.on_nan)

    # ------------------------------------------------------------------ building
    def make_ref_model(self, state: Optional[dict] = None) -> None:
        """The frozen reference policy for the KL penalty (a copy of the current weights, or ``state``); the
        routed forward gives it its own routing controller (it replays the actor's routes under R3/R2)."""
        self.ref_model = frozen_reference(self.unwrapped, state)
        self.forward.set_reference(self.ref_model)

    @property
    def ref_controller(self) -> Optional[RoutingController]:
        """The reference model's routing controller (None without one)."""
        return self.forward.ref_controller

    @property
    def is_main(self) -> bool:
        return self.accelerator.is_main_process

    @property
    def iteration(self) -> int:
        """Generation iterations completed (the batch source's counter)."""
        return self.source.iteration

    @property
    def updates(self) -> int:
        """Optimizer updates applied."""
        return self.policy_update.updates

    @property
    def nan_skipped(self) -> int:
        """Batches and optimizer updates skipped as non-finite (``actor/nan_skipped``)."""
        return self.nan.skipped

    def state_dict(self) -> dict:
        """The loop's own counters: trained steps, whether the SFT warm start ran, the latest logged metrics."""
        return {"step": self.step, "sft_done": self.sft_done, "last_metrics": dict(self.last_metrics)}

    def load_state_dict(self, state: dict) -> None:
        """Put back :meth:`state_dict` (extra keys are ignored: a checkpoint keeps other counters beside them)."""
        self.step = int(state["step"])
        self.sft_done = bool(state["sft_done"])
        self.last_metrics = dict(state.get("last_metrics", {}))

    # ------------------------------------------------------------------ the steps of an iteration
    def prepare(self, batch: RolloutBatch) -> None:
        """Step 2: the old-log-prob strategy's pass after generation (:meth:`OldLogpStrategy.prepare`: the
        mismatch / routing measurements, and ``old_logp`` where it is taken then).  Non-finite values raise
        :class:`NonFiniteError`: stage ``old_logp`` when this pass takes the old log-probs, ``metrics`` when it
        only measures (a fused batch, bypass)."""
        takes_old = self.old_logp.takes_at_prepare(batch)
        stage = "old_logp" if takes_old else "metrics"
        try:
            with probes.poisoned(stage, batch.generated_at + 1, self.unwrapped):
                self.old_logp.prepare(batch)
        except (ValueError, RuntimeError) as exc:
            err = as_nonfinite(exc, stage, "trainer log-probs" if takes_old else "log-probs of the measurements")
            if err is None:
                raise
            raise err from exc
        if batch.old_logp is not None and not all_finite(batch.old_logp, batch.response_mask):
            raise NonFiniteError("old_logp", "old log-probs")

    def drop_nonfinite(self, err: Optional[NonFiniteError], *, collective: bool = False) -> bool:
        """The batch sources' door to ``trainer.on_nan``: ``err`` (None: this batch is finite here) is applied to
        the policy, which raises (``stop``, or too many skips in a row) or counts the skip; True when the batch
        must be dropped.  ``collective``: every process calls this for the same iteration, and one process's error
        is everyone's (their batches must stay in step)."""
        if collective and self.world > 1:
            err = agree_on_stage(err, self.accelerator)
        if err is None:
            return False
        self.apply_nan_policy(err.located(self.step + 1))
        return True

    def apply_nan_policy(self, err: NonFiniteError) -> None:
        """``trainer.on_nan`` applied to ``err``, the one place it is: raise it (``stop``, or the
        ``trainer.max_nan_skips``-th skip in a row; the loop then rolls the step back and checkpoints it) or count
        the skip (the caller drops what ``err`` spoiled and goes on)."""
        self.nan.record(err)

    def _attempt(self, part: Callable[[], Any], undo: Optional[Callable[[], Any]] = None) -> tuple[bool, Any]:
        """Run one part of the step; a :class:`NonFiniteError` from it is undone (``undo``: the rollback of what the
        part changed) and handed to :meth:`apply_nan_policy`.  ``(True, its result)``, or ``(False, None)`` when it
        was skipped."""
        try:
            return True, part()
        except NonFiniteError as exc:
            if undo is not None:
                undo()
            self.apply_nan_policy(exc)
            return False, None

    def update(self, batch: RolloutBatch, *, keep_start: bool = False) -> dict[str, float]:
        """Step 4: train on one consumed batch (this process's share of it); returns the step's metrics
        (``_tokens``: attention tokens processed).  Callable on any :class:`RolloutBatch` whose ``old_logp`` is set
        (or ``algo.old_logp_source=proximal``), e.g. a fixed batch loaded from disk.  ``keep_start``: keep the
        state of before the update for :meth:`StepTransaction.rollback_update` (the loop evaluates the new weights
        before publishing them).

        The update (:class:`PolicyUpdate`) raises what is non-finite; here each of its parts runs under the step's
        transaction: a batch whose old or reference log-probs are non-finite is dropped, an optimizer update with
        a non-finite loss, gradient norm or parameters is rolled back and dropped (``skip``)."""
        txn, pu = self.transaction, self.policy_update
        txn.begin_update(keep_start=keep_start, updates_per_step=self.cfg.trainer.updates_per_step)
        work = pu.start(batch, step=self.step, iteration=self.iteration)
        if work.batch is None or not self._attempt(lambda: pu.prepare(work))[0]:
            return pu.no_update(work, self.nan.metrics())
        for index in range(pu.optimizer_updates(work)):
            txn.begin_optimizer_update()
            ok, _ = self._attempt(lambda: pu.optimizer_update(work, index), undo=txn.rollback_optimizer_update)
            if ok:
                txn.commit_optimizer_update()
            else:
                pu.dropped_update(work)
        return pu.finish(work, self.nan.metrics())

    def publish(self, version: int, *, force: bool = False) -> None:
        """Step 5: the batch source gets the current weights (and PR2 predictors) as policy version ``version``
        (generation takes them every ``rollout.publish_every`` versions, or when ``force``)."""
        self.source.publish(full_model_state(self.unwrapped), version,
                            self.predictors.state_dict() if self.predictors is not None else None, force=force)

    def evaluate(self) -> dict[str, float]:
        """Greedy accuracy on the held-out split and on as many training prompts (``eval/*``,
        :func:`~offpolicy_moe.trainer.evaluation.evaluate_policy`); non-finite logits raise :class:`NonFiniteError`
        (stage ``evaluation``)."""
        return evaluate_policy(self.unwrapped, self.tok, self.task, self.cfg, self.step)

    # ------------------------------------------------------------------ checkpoints
    def checkpoint_parts(self) -> dict[str, Any]:
        """The run's checkpointed parts by name, each with ``state_dict()`` / ``load_state_dict()`` (loaded back in
        this order): optimizer, scheduler, batch source, non-finite counts, the loop's counters, the update's."""
        return {"optimizer": self.optimizer, "scheduler": self.scheduler, "source": self.source, "nan": self.nan,
                "trainer": self, "policy_update": self.policy_update}

    def save(self) -> Optional[Path]:
        """Checkpoint ``step_<step>`` (main process writes; every process gives its RNG states; all wait)."""
        path = self.run_checkpoints.save(self.step, self.checkpoint_parts(),
                                         {"ref_model": self.ref_model, "predictors": self.predictors})
        self.saved_at = (self.step, self.iteration)
        return path

    def load(self, path: Path) -> LoadedCheckpoint:
        """Restore everything from a checkpoint folder (each part from its own state); clear errors when it does
        not fit the configured model."""
        ck = self.run_checkpoints.load(path, self.checkpoint_parts(), {"predictors": self.predictors})
        if "ref_model" in ck.modules:
            self.make_ref_model(ck.modules["ref_model"])
        # a resume between two publications (rollout.publish_every > 1) can only give generation the newest
        # weights: the version it held is not kept
        every = self.cfg.rollout.publish_every
        if self.source.published != self.step and self.step % every:
            print(f"offpolicy-moe: warning: resumed at step {self.step} between publications "
                  f"(rollout.publish_every={every}): generation restarts from version "
                  f"{self.step} instead of {self.source.published}", file=sys.stderr)
        self.publish(self.step, force=True)
        set_rng_state(ck.rng)
        self.run_dir.restore_metrics(ck.state["metrics_offset"], path)
        self.saved_at = (self.step, self.iteration)
        return ck

    # ------------------------------------------------------------------ logging
    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Mean over processes, remembered as the latest values, written by the loggers."""
        metrics = mean_over_processes(metrics, self.accelerator)
        self.last_metrics.update(metrics)
        if self.logger is not None:
            self.logger.log(step, metrics)

    def open_loggers(self) -> None:
        """The run's loggers (console, ``metrics.jsonl``, wandb)."""
        self.logger, self.console = self.run_dir.open_loggers(self.cfg, initial_step=self.step)

    # ------------------------------------------------------------------ the run
    def run(self) -> dict:
        """Train to ``trainer.steps`` trained steps; always writes ``summary.json``; returns the summary.

        A SIGINT / SIGTERM stops at the next iteration boundary with a checkpoint there and raises
        :class:`~offpolicy_moe.run.signals.RunInterrupted` (status ``stopped``); the folder lock is released
        on the way out, however the run ends."""
        with graceful_stop() as self.stop_request:
            try:
                return self._run()
            finally:
                self.run_dir.close()

    def _run(self) -> dict:
        t_start = time.perf_counter()
        status, error = "failed", None
        try:
            self.run_dir.clean_checkpoints()
            self.accelerator.wait_for_everyone()
            resumed_from = self.run_dir.resume_checkpoint() if self.resume else None
            if resumed_from is not None:
                self.load(resumed_from)
            elif self.resume:
                self.run_dir.truncate_metrics(0)
            self.run_dir.write_run_files(self.cfg, self.chat.to_dict())
            self.open_loggers()
            if resumed_from is not None:
                self.console.write(f"resumed from {resumed_from} (step {self.step}, iteration {self.iteration})")
            else:
                self.start()
            self.loop()
            if self.cfg.trainer.export_final:   # RUN_DIR/export (a Hugging Face folder)
                weights = full_model_state(self.unwrapped)          # collective for a sharded model
                if self.is_main:
                    export_final(self.run_dir.path, self.unwrapped, self.tok, self.predictors, state_dict=weights)
            status = "completed"
        except RunInterrupted as exc:
            status, error = "stopped", str(exc)
            raise
        except KeyboardInterrupt:
            status, error = "stopped", "interrupted"
            raise
        except TrainingStopped as exc:
            status, error = "stopped", str(exc)
        except NonFiniteError as exc:       # trainer.on_nan=stop, or trainer.max_nan_skips skips in a row
            status, error = "diverged", str(exc)
            raise
        except RewardError as exc:      # outside the loop's own handler (the step-0 evaluation): checkpoint here
            error = f"{type(exc).__name__}: {exc}"
            if "checkpointed in" not in str(exc):
                path = self.save()
                error = f"{error}; the last good state (step {self.step}) is checkpointed in {path}"
                raise RewardError(error.split(": ", 1)[1], fn=exc.fn, row=exc.row) from exc
            raise
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            # the workers (started at the first publish: rollout.early_start) and the math reward's process stop
            # however the run ends, the step-0 evaluation's failure included
            self.source.close()
            self.task.rewards.close()
            if self.logger is not None:
                self.logger.close()
            summary = {"status": status, "steps": int(self.step), "iterations": int(self.iteration),
                       "final": dict(self.last_metrics), "wall_time_s": time.perf_counter() - t_start,
                       "run_dir": str(self.run_dir.path)}
            if error:
                summary["error"] = error
            self.run_dir.write_summary(summary)
        return summary

    def start(self) -> None:
        """A fresh run: SFT warm start, reference model, engine at version 0, evaluation and checkpoint of step 0."""
        cfg, tc = self.cfg, self.cfg.trainer
        if tc.sft_warmup_steps > 0 and not self.sft_done:
            self.console.write(f"SFT warm start: {tc.sft_warmup_steps} steps")
            sft = sft_warm_start(self.unwrapped, self.tok, self.task, steps=tc.sft_warmup_steps, lr=tc.sft_lr,
                                 batch_size=tc.sft_batch_size, seed=cfg.seed,
                                 progress=cfg.logging.progress and self.is_main)
            self.unwrapped.train()
            self.sft_done = True
            seed_everything(cfg.seed + 1)
            self.console.write(f"SFT done: loss {sft.get('sft/loss', float('nan')):.4f}")
        self.optimizer.zero_grad(set_to_none=True)     # gradients never cross from one phase into the next
        if cfg.algo.kl.coef > 0:
            self.make_ref_model()
        self.publish(0)
        t0 = time.perf_counter()
        try:
            ev = self.evaluate()
        except NonFiniteError as exc:   # no step has been trained: nothing finite to go back to
            raise exc.with_note("the starting weights give non-finite logits; no checkpoint was written") from exc
        ev["perf/time_eval_s"] = time.perf_counter() - t0
        self.log(0, ev)
        if tc.checkpoint_every > 0:
            self.save()

    def loop(self) -> None:
        """Steps until ``trainer.steps`` are trained (module docstring, steps 1-5): the batch source gives each
        step's prepared batch, whatever its staleness; the update trains on it; the new weights are published.
        Each step is one transaction (:attr:`transaction`), begun at its boundary and committed at its end; a
        :class:`NonFiniteError` that ends the run (``stop``, or one skip too many) rolls it back to that boundary,
        which is checkpointed before the error goes on."""
        tc = self.cfg.trainer
        txn = self.transaction
        t_loop = time.perf_counter() - self.last_metrics.get("perf/elapsed_s", 0.0)   # a resume goes on counting
        while self.step < tc.steps:
            self.stop_if_requested()
            txn.begin()                    # rolled back if the step cannot be finished
            t_step = time.perf_counter()
            try:
                self._step(t_step, t_loop)
            except NonFiniteError as exc:   # the policy said stop (or too many skips in a row)
                txn.rollback()
                path = self.save()
                raise exc.with_note(f"the last finite state (step {self.step}) is checkpointed in {path}") from exc
            txn.commit()
            self.nan.step_done()

    def _step(self, t_step: float, t_loop: float) -> None:
        """One iteration inside the loop's transaction: batch, update, evaluation when due, publication, log and
        checkpoint."""
        tc = self.cfg.trainer
        try:
            batch, source_metrics = self.source.next(self.step)
        except SourceStopped as exc:
            self.save()
            raise TrainingStopped(f"{exc}; checkpoint written at step {self.step}") from exc
        self.callbacks.on_batch(self, batch)
        t0 = time.perf_counter()
        due = eval_due(tc, self.step + 1)
        try:
            m = self.update(batch, keep_start=due)
        except RewardError as exc:      # task.on_reward_error=stop: nothing was trained on this batch yet
            self.transaction.rollback()
            path = self.save()
            raise RewardError(f"{exc}; the last good state (step {self.step}) is checkpointed in {path}",
                              fn=exc.fn, row=exc.row) from exc
        t_update = time.perf_counter() - t0
        m.update(source_metrics)
        m.update(offpolicy_metrics(self.step, batch, self.source, tc.updates_per_step, m.pop("_tokens"), t_update))
        self.step += 1
        if due:           # before publishing: generation only ever gets weights known to be finite
            m.update(self._evaluate_step())
        self.publish(self.step)
        self._end_step(m, t_step, t_loop)

    def _evaluate_step(self) -> dict[str, float]:
        """The evaluation of the step just trained (``eval/*``, ``perf/time_eval_s``).  Non-finite logits roll the
        update back (the weights of before the step); then ``skip`` counts it and goes on (no ``eval/*`` this
        step), ``stop`` (or one skip too many) raises to the loop."""
        t0 = time.perf_counter()
        ok, out = self._attempt(self.evaluate, undo=self.transaction.rollback_update)
        if not ok:
            out = self.nan.metrics()
        out["perf/time_eval_s"] = time.perf_counter() - t0
        return out

    def _end_step(self, m: dict[str, float], t_step: float, t_loop: float) -> None:
        """Log, checkpoint when due, call back (evaluation, when due, is in ``m`` already).  ``perf/elapsed_s``:
        wall seconds of the training loop so far (evaluation included, start-up and SFT not), summed over the run's
        segments."""
        tc = self.cfg.trainer
        now = time.perf_counter()
        m["perf/time_step_s"] = now - t_step
        m["perf/elapsed_s"] = now - t_loop
        self.log(self.step, m)
        if (tc.checkpoint_every > 0 and self.step % tc.checkpoint_every == 0) or self.step == tc.steps:
            self.save()
        self.callbacks.on_step_end(self, self.step, m)

    # ------------------------------------------------------------------ stopping
    def stop_if_requested(self) -> None:
        """At an iteration boundary: when a stop signal arrived (on any process), checkpoint here (unless this
        boundary is checkpointed already) and raise :class:`RunInterrupted`."""
        signum = self.stop_request.signum or 0
        if self.world > 1:
            t = torch.tensor([float(signum)], device=self.accelerator.device)
            signum = int(self.accelerator.reduce(t, "max").item())
        if not signum:
            return
        if self.saved_at != (self.step, self.iteration):
            path = self.save()
        else:
            path = self.run_dir.latest_checkpoint()
        raise RunInterrupted(signum, self.step, str(path) if path is not None else None)
