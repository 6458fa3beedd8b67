"""The trainer's checkpoints: ``step_<n>`` written with the run's counters, a checkpoint read back into the
optimizer, scheduler, batch source, PR2 predictors and non-finite counts, and the iteration boundary that a step
stopping before it trains is put back to (and checkpointed at)."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Optional

import torch

from offpolicy_moe.run.checkpoint import rng_state, set_rng_state
from offpolicy_moe.run.checkpoint_state import CheckpointState
from offpolicy_moe.run.full_state import load_full_optimizer_state
from offpolicy_moe.run.nonfinite import NanCounter
from offpolicy_moe.run.run_dir import RunDir
from offpolicy_moe.sources.base import BatchSource

__all__ = ["RunCheckpoints"]


class RunCheckpoints:
    """Checkpoints of the run's step boundaries, built with the checkpoint contents (:class:`CheckpointState`) and
    what is saved and loaded besides the trainer's counters (``publish_every``: ``rollout.publish_every``, for the
    warning of a resume between two publications)."""

    def __init__(self, store: CheckpointState, *, accelerator: Any, run_dir: RunDir, source: BatchSource,
                 model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, nan: NanCounter,
                 predictors: Any, rank: int, publish_every: int = 1):
        self.store, self.accelerator, self.run_dir, self.source = store, accelerator, run_dir, source
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.nan, self.predictors, self.rank, self.publish_every = nan, predictors, rank, publish_every

    def save(self, step: int, counters: dict, *, last_metrics: dict, modules: dict) -> Optional[Path]:
        """Checkpoint ``step_<step>`` with ``counters`` and ``modules`` (the main process writes; every process
        gives its RNG states; all wait); returns its path."""
        self.accelerator.wait_for_everyone()
        is_main = self.accelerator.is_main_process
        state = self.store.build(counters=counters, source=self.source, metrics_offset=self.run_dir.metrics_offset(),
                                 last_metrics=last_metrics) if is_main else None
        path = self.store.save(step, state, optimizer=self.optimizer, scheduler=self.scheduler, modules=modules,
                               is_main=is_main)
        self.accelerator.wait_for_everyone()
        return path

    def load(self, path: Path) -> Any:
        """The verified checkpoint ``path`` (:meth:`CheckpointState.load`), with the optimizer, scheduler, batch
        source, PR2 predictors and non-finite counts put back from it (and a warning when its step falls between
        two publications); the trainer takes its counters, reference model and RNG states from the returned
        checkpoint (``state``, ``modules``, ``rng``)."""
        ck = self.store.load(path, rank=self.rank)
        st = ck.state
        load_full_optimizer_state(self.model, self.optimizer, st["optimizer"])
        self.scheduler.load_state_dict(st["scheduler"])
        self.source.load_state_dict(st["source"])
        if self.predictors is not None and "predictors" in ck.modules:
            self.predictors.load_state_dict(ck.modules["predictors"])
        self.nan.load_state_dict(st.get("nan", {"skipped": st["nan_skipped"]}))
        step = st["step"]
        # a resume between two publications (rollout.publish_every > 1) can only give generation the newest
        # weights: the version it held is not kept
        if self.source.published != step and step % self.publish_every:
            print(f"offpolicy-moe: warning: resumed at step {step} between publications "
                  f"(rollout.publish_every={self.publish_every}): generation restarts from version "
                  f"{step} instead of {self.source.published}", file=sys.stderr)
        return ck

    def boundary(self) -> dict:
        """What a step changes before its update besides weights and optimizer (the RNG states, the batch
        source's counters and queue, the non-finite counts: skips of a step that is rolled back are not kept)."""
        return {"rng": rng_state(), "source": self.source.state_dict(), "nan": self.nan.state_dict()}

    def restore_boundary(self, boundary: dict) -> None:
        """Put back the iteration boundary ``boundary`` (:meth:`boundary`)."""
        self.source.load_state_dict(boundary["source"])
        set_rng_state(boundary["rng"])
        self.nan.load_state_dict(boundary["nan"])
