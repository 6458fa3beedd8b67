"""What a trainer checkpoint holds, built and checked in one place (the storage lives in
:mod:`offpolicy_moe.engine.checkpoint`)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from offpolicy_moe.engine.checkpoint import CheckpointError, load_checkpoint, rng_state, save_checkpoint

__all__ = ["FORMAT", "model_signature", "CheckpointState"]

FORMAT = "offpolicy_moe.trainer/1"


def model_signature(model: torch.nn.Module) -> dict:
    """The facts of the model a checkpoint must match: class, vocabulary, experts, top-k, layers, width."""
    cfg = model.config
    return {"class": type(model).__name__, "vocab_size": int(getattr(cfg, "vocab_size", -1)),
            "num_experts": getattr(cfg, "num_experts", getattr(cfg, "num_local_experts", None)),
            "top_k": getattr(cfg, "num_experts_per_tok", None),
            "num_layers": getattr(cfg, "num_hidden_layers", None),
            "hidden_size": getattr(cfg, "hidden_size", None)}


class CheckpointState:
    """Builds the state dict of a checkpoint from the parts of a run and checks a loaded one against the
    configured model and process count; :meth:`save` / :meth:`load` go through the checkpoint storage."""

    def __init__(self, root: Path, *, model: torch.nn.Module, world: int, keep: int):
        self.root = Path(root)
        self.model = model
        self.world = int(world)
        self.keep = int(keep)

    def build(self, *, counters: dict, optimizer: Any, scheduler: Any, buffer: Any, engine_version: int,
              predictors: Any, ref_model: Any, metrics_offset: int, last_metrics: dict) -> dict:
        """The checkpointed state (everything but the model weights); ``counters``: iteration, step, updates,
        nan_skipped, sft_done."""
        return {
            "format": FORMAT, **counters,
            "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
            "buffer": buffer.state_dict(), "engine_version": engine_version,
            "predictors": predictors.state_dict() if predictors is not None else None,
            "ref_model": ref_model.state_dict() if ref_model is not None else None,
            "rng": rng_state(), "metrics_offset": metrics_offset, "last_metrics": last_metrics,
            "model_signature": model_signature(self.model), "world_size": self.world,
        }

    def save(self, step: int, state: dict) -> Path:
        """Write checkpoint ``step_<step>`` (model weights + ``state``)."""
        return save_checkpoint(self.root, step, self.model.state_dict(), state, keep=self.keep)

    def load(self, path: Path) -> dict:
        """Read checkpoint ``path``, load its weights into the model and return its state; one-line
        :class:`CheckpointError` when it is not a trainer checkpoint or does not fit the configured model."""
        weights, st = load_checkpoint(path)
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
            self.model.load_state_dict(weights)
        except RuntimeError as exc:
            raise CheckpointError(f"checkpoint {str(path)!r} weights do not fit the configured model: {exc}") from exc
        return st
