"""The trainer's checkpoints, the one layer above the storage (:mod:`offpolicy_moe.run.checkpoint`: safe formats,
checksums, atomic writes, verification, full states of a sharded model).

A checkpoint is collected BY NAME: the caller hands :meth:`RunCheckpoints.save` a mapping of named parts, each an
object with ``state_dict()`` / ``load_state_dict(state)`` (the loop's counters, the policy update, the non-finite
counts, the batch source, the optimizer, the scheduler), and a mapping of named weight sets (the KL reference, the
PR2 predictors); :meth:`RunCheckpoints.load` checks a checkpoint against the configured model and process count and
hands each part its own state back, so no part's attributes are written from outside it.

Where each part lives in ``state.pt`` (trainer format 2, unchanged, so every checkpoint written before still
loads): under its own name (``source``, ``nan``, ``optimizer``, ``scheduler``), except the counters of the loop
(``step``, ``sft_done``, ``last_metrics``) and of the policy update (``updates``), which format 2 keeps at the top
level (:data:`TOP_LEVEL_PARTS`), and ``nan_skipped``, the non-finite count of the format's first checkpoints, still
written beside ``nan``.  The RNG states of every process are stored apart (``rng_<rank>.pt``); the weights in
safetensors files."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Optional

import torch

from offpolicy_moe.models.moe_shape import moe_shape
from offpolicy_moe.run.checkpoint import (CheckpointError, LoadedCheckpoint, full_optimizer_state, gather_rng_states,
                                          load_checkpoint, load_full_model_state, load_full_optimizer_state,
                                          save_checkpoint)
from offpolicy_moe.run.full_state import full_model_state
from offpolicy_moe.run.run_dir import RunDir

__all__ = ["FORMAT", "TOP_LEVEL_PARTS", "model_signature", "RunCheckpoints"]

FORMAT = "offpolicy_moe.trainer/2"      # 2: the batch source's state under "source"

#: the parts whose state format 2 spreads over the top level of ``state.pt`` (each reads its own keys back)
TOP_LEVEL_PARTS = ("trainer", "policy_update")

#: the order of the top-level keys of ``state.pt`` in format 2 (the keys of other parts follow)
_ORDER = ("format", "step", "updates", "nan_skipped", "nan", "sft_done", "source", "metrics_offset", "last_metrics",
          "model_signature", "world_size")

#: parts whose state is collective to take (every process calls ``state_dict``); the others only on the main one
_COLLECTIVE = ("optimizer",)


def model_signature(model: torch.nn.Module) -> dict:
    """The facts of the model a checkpoint must match: class, vocabulary, experts, top-k, layers, width."""
    cfg = model.config
    num_experts, top_k = moe_shape(cfg)
    return {"class": type(model).__name__, "vocab_size": int(getattr(cfg, "vocab_size", -1)),
            "num_experts": num_experts, "top_k": top_k,
            "num_layers": getattr(cfg, "num_hidden_layers", None),
            "hidden_size": getattr(cfg, "hidden_size", None)}


class RunCheckpoints:
    """Checkpoints of the run's step boundaries in ``run_dir``'s checkpoint folder (the newest ``keep`` kept) for the
    policy ``model`` (its weights are ``model.safetensors``)."""

    def __init__(self, *, accelerator: Any, run_dir: RunDir, model: torch.nn.Module, keep: int):
        self.accelerator, self.run_dir, self.model, self.keep = accelerator, run_dir, model, int(keep)
        self.rank, self.world = accelerator.process_index, accelerator.num_processes

    def save(self, step: int, parts: Mapping[str, Any], weights: Mapping[str, Any]) -> Optional[Path]:
        """Checkpoint ``step_<step>`` with each named part's ``state_dict()`` and each named weight set (None:
        left out); the main process writes, every process gives its RNG states, all wait; returns its path."""
        self.accelerator.wait_for_everyone()
        is_main = self.accelerator.is_main_process
        states = {name: part.state_dict() for name, part in parts.items()
                  if is_main and name not in _COLLECTIVE}
        rngs = gather_rng_states(self.accelerator)
        model = full_model_state(self.model)                      # collective for a sharded (FSDP2) model
        if "optimizer" in parts:
            states["optimizer"] = full_optimizer_state(self.model, parts["optimizer"])
        path = None
        if is_main:
            path = save_checkpoint(self.run_dir.ckpt_root, step, model=model, extra=self._layout(states),
                                   modules=weights, rng_states=rngs, keep=self.keep)
        self.accelerator.wait_for_everyone()
        return path

    def _layout(self, states: dict[str, dict]) -> dict:
        """The parts' states as ``state.pt`` (format 2, module docstring), with the facts a resume checks."""
        flat: dict = {"format": FORMAT, "metrics_offset": self.run_dir.metrics_offset(),
                      "model_signature": model_signature(self.model), "world_size": self.world}
        for name, state in states.items():
            if name in TOP_LEVEL_PARTS:
                flat.update(state)
            else:
                flat[name] = state
            if name == "nan":
                flat["nan_skipped"] = state["skipped"]
        first = [k for k in _ORDER if k in flat]
        return {**{k: flat[k] for k in first}, **{k: v for k, v in flat.items() if k not in first}}

    @staticmethod
    def part_state(name: str, state: dict) -> dict:
        """Part ``name``'s state in the checkpoint state ``state`` (format 2; a checkpoint without ``nan`` has only
        its ``nan_skipped`` count)."""
        if name in TOP_LEVEL_PARTS:
            return state
        if name == "nan" and "nan" not in state:
            return {"skipped": state["nan_skipped"]}
        return state[name]

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

    def load(self, path: Path, parts: Mapping[str, Any], weights: Mapping[str, Any]) -> LoadedCheckpoint:
        """The verified checkpoint ``path`` (:meth:`_verified`: the policy's weights are loaded), with each named
        part's state handed back to it (``load_state_dict``, in the order of ``parts``) and each named weight set
        that is not None and was saved loaded into it.  The caller takes what has no object yet from the returned
        checkpoint (weight sets in ``modules``, this process's RNG states in ``rng``)."""
        ck = self._verified(path)
        for name, part in parts.items():
            state = self.part_state(name, ck.state)
            if name == "optimizer":
                load_full_optimizer_state(self.model, part, state)
            else:
                part.load_state_dict(state)
        for name, module in weights.items():
            if module is not None and name in ck.modules:
                module.load_state_dict(ck.modules[name])
        return ck
