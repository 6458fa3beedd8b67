"""The trainer's checkpoints, the one layer above the storage (:mod:`offpolicy_moe.run.checkpoint`: safe formats,
checksums, atomic writes, verification): ``step_<n>`` written with the run's counters and the state of each part
by name (optimizer, scheduler, batch source, PR2 predictors, non-finite counts, reference model), a checkpoint
checked against the configured model and process count and read back into those parts, and the iteration boundary
that a step stopping before it trains is put back to (and checkpointed at)."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Optional

import torch

from offpolicy_moe.models.moe_shape import moe_shape
from offpolicy_moe.run.checkpoint import (CheckpointError, LoadedCheckpoint, gather_rng_states, load_checkpoint,
                                          rng_state, save_checkpoint, set_rng_state)
from offpolicy_moe.run.full_state import (full_model_state, full_optimizer_state, load_full_model_state,
                                          load_full_optimizer_state)
from offpolicy_moe.run.nonfinite import NanCounter
from offpolicy_moe.run.run_dir import RunDir
from offpolicy_moe.sources.base import BatchSource

__all__ = ["FORMAT", "model_signature", "RunCheckpoints"]

FORMAT = "offpolicy_moe.trainer/2"      # 2: the batch source's state under "source"


def model_signature(model: torch.nn.Module) -> dict:
    """The facts of the model a checkpoint must match: class, vocabulary, experts, top-k, layers, width."""
    cfg = model.config
    num_experts, top_k = moe_shape(cfg)
    return {"class": type(model).__name__, "vocab_size": int(getattr(cfg, "vocab_size", -1)),
            "num_experts": num_experts, "top_k": top_k,
            "num_layers": getattr(cfg, "num_hidden_layers", None),
            "hidden_size": getattr(cfg, "hidden_size", None)}


class RunCheckpoints:
    """Checkpoints of the run's step boundaries in ``run_dir``'s checkpoint folder (the newest ``keep`` kept), with
    what is saved and loaded besides the trainer's counters (``publish_every``: ``rollout.publish_every``, for the
    warning of a resume between two publications)."""

    def __init__(self, *, accelerator: Any, run_dir: RunDir, source: BatchSource, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer, scheduler: Any, nan: NanCounter, predictors: Any, keep: int,
                 publish_every: int = 1):
        self.accelerator, self.run_dir, self.source = accelerator, run_dir, source
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.nan, self.predictors, self.keep, self.publish_every = nan, predictors, int(keep), publish_every
        self.rank, self.world = accelerator.process_index, accelerator.num_processes

    def save(self, step: int, counters: dict, *, last_metrics: dict, modules: dict) -> Optional[Path]:
        """Checkpoint ``step_<step>`` with ``counters`` and ``modules`` (the main process writes; every process
        gives its RNG states; all wait); returns its path."""
        self.accelerator.wait_for_everyone()
        is_main = self.accelerator.is_main_process
        state = self._state(counters, last_metrics) if is_main else None
        rngs = gather_rng_states(self.accelerator)
        weights = full_model_state(self.model)                    # collective for a sharded (FSDP2) model
        optim = full_optimizer_state(self.model, self.optimizer)
        path = None
        if is_main:
            path = save_checkpoint(self.run_dir.ckpt_root, step, model=weights, optimizer=optim,
                                   scheduler=self.scheduler, extra=state, modules=modules, rng_states=rngs,
                                   keep=self.keep)
        self.accelerator.wait_for_everyone()
        return path

    def _state(self, counters: dict, last_metrics: dict) -> dict:
        """The checkpointed counters and the batch source's state (weights, optimizer, scheduler and RNG are
        stored apart); ``counters``: step, updates, nan_skipped, sft_done."""
        return {"format": FORMAT, **counters, "source": self.source.state_dict(),
                "metrics_offset": self.run_dir.metrics_offset(), "last_metrics": last_metrics,
                "model_signature": model_signature(self.model), "world_size": self.world}

    def _verified(self, path: Path) -> LoadedCheckpoint:
        """Checkpoint ``path`` read (checksums verified first) with its weights loaded into the model; one-line
        :class:`CheckpointError` when it is not a trainer checkpoint or does not fit the configured model and
        process count."""
        ck = load_checkpoint(path, rank=self.rank)
        st = ck.state
        if st.get("format") == "offpolicy_moe.trainer/1":
            raise CheckpointError(f"{str(path)!r} was written before the batch sources (trainer format 1); "
                                  "resume it with offpolicy_moe 0.1's engine layout, or start the run again")
        if st.get("format") != FORMAT:
            raise CheckpointError(f"{str(path)!r} is not an offpolicy_moe trainer checkpoint")
        mine, theirs = model_signature(self.model), st.get("model_signature", {})
        diff = {k: (theirs.get(k), v) for k, v in mine.items() if theirs.get(k) != v}
        if diff:
            desc = ", ".join(f"{k}: checkpoint {a!r} vs config {b!r}" for k, (a, b) in diff.items())
            raise CheckpointError(f"checkpoint {str(path)!r} does not match the configured model ({desc})")
        if st.get("world_size", 1) != self.world:
            raise CheckpointError(f"checkpoint {str(path)!r} was written by {st.get('world_size')} processes; "
                                  f"resume with the same number (now {self.world})")
        try:
            load_full_model_state(self.model, ck.model)
        except RuntimeError as exc:
            raise CheckpointError(f"checkpoint {str(path)!r} weights do not fit the configured model: {exc}") from exc
        return ck

    def load(self, path: Path) -> Any:
        """The verified checkpoint ``path`` (:meth:`_verified`), with the weights, optimizer, scheduler, batch
        source, PR2 predictors and non-finite counts put back from it (and a warning when its step falls between
        two publications); the trainer takes its counters, reference model and RNG states from the returned
        checkpoint (``state``, ``modules``, ``rng``)."""
        ck = self._verified(path)
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
