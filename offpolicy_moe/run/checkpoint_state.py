"""What a trainer checkpoint holds, built and checked in one place (the storage, its safe formats and checksums
live in :mod:`offpolicy_moe.run.checkpoint`)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch

from offpolicy_moe.run.checkpoint import (CheckpointError, LoadedCheckpoint, gather_rng_states, load_checkpoint,
                                             save_checkpoint)
from offpolicy_moe.run.full_state import full_model_state, full_optimizer_state, load_full_model_state
from offpolicy_moe.models.moe_shape import moe_shape

__all__ = ["FORMAT", "model_signature", "CheckpointState"]

FORMAT = "offpolicy_moe.trainer/2"      # 2: the batch source's state under "source"


def model_signature(model: torch.nn.Module) -> dict:
    """The facts of the model a checkpoint must match: class, vocabulary, experts, top-k, layers, width."""
    cfg = model.config
    num_experts, top_k = moe_shape(cfg)
    return {"class": type(model).__name__, "vocab_size": int(getattr(cfg, "vocab_size", -1)),
            "num_experts": num_experts, "top_k": top_k,
            "num_layers": getattr(cfg, "num_hidden_layers", None),
            "hidden_size": getattr(cfg, "hidden_size", None)}


class CheckpointState:
    """Builds the state of a checkpoint from the parts of a run and checks a loaded one against the configured
    model and process count; :meth:`save` / :meth:`load` go through the checkpoint storage."""

    def __init__(self, root: Path, *, model: torch.nn.Module, world: int, keep: int, accelerator: Any = None):
        self.root = Path(root)
        self.model = model
        self.world = int(world)
        self.keep = int(keep)
        self.accelerator = accelerator

    def build(self, *, counters: dict, source: Any, metrics_offset: int, last_metrics: dict) -> dict:
        """The checkpointed counters and the batch source's state (weights, optimizer, scheduler and RNG are
        stored apart); ``counters``: step, updates, nan_skipped, sft_done."""
        return {"format": FORMAT, **counters, "source": source.state_dict(),
                "metrics_offset": metrics_offset, "last_metrics": last_metrics,
                "model_signature": model_signature(self.model), "world_size": self.world}

    def save(self, step: int, state: Optional[dict], *, optimizer: Any, scheduler: Any,
             modules: dict[str, Any], is_main: bool) -> Optional[Path]:
        """Write checkpoint ``step_<step>`` (collective: every process passes its RNG states; the main process
        writes the model, ``modules`` (name -> module or None), optimizer, scheduler and ``state``)."""
        rngs = gather_rng_states(self.accelerator)
        weights = full_model_state(self.model)                    # collective for a sharded (FSDP2) model
        optim = full_optimizer_state(self.model, optimizer) if optimizer is not None else None
        if not is_main:
            return None
        return save_checkpoint(self.root, step, model=weights, optimizer=optim, scheduler=scheduler,
                               extra=state, modules=modules, rng_states=rngs, keep=self.keep)

    def load(self, path: Path, *, rank: int = 0) -> LoadedCheckpoint:
        """Read checkpoint ``path`` (checksums verified first), load its weights into the model and return it;
        one-line :class:`CheckpointError` when it is not a trainer checkpoint or does not fit the configured
        model."""
        ck = load_checkpoint(path, rank=rank)
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
