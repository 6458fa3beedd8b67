"""Full (unsharded) model and optimizer states, for models whose parameters FSDP2 has sharded into ``DTensor``\\ s.

DDP and single-process runs keep plain tensors, and these functions then return ``state_dict()`` unchanged.  For a
sharded model they go through PyTorch's distributed-checkpoint state-dict API with ``full_state_dict=True``
(collective: every process calls them), so the rollout engine, checkpoints and exports see ordinary full tensors.
"""
from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.tensor import DTensor

__all__ = ["as_full_tensor", "is_sharded", "full_model_state", "full_optimizer_state", "load_full_model_state",
           "load_full_optimizer_state"]

_FULL = StateDictOptions(full_state_dict=True, cpu_offload=False)


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether any parameter of ``model`` is a ``DTensor`` (FSDP2 / tensor-parallel sharding)."""
    return any(isinstance(p, DTensor) for p in model.parameters())


def as_full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor: ``t`` itself, or the full value of a ``DTensor`` (e.g. the gradient norm of a sharded
    model; collective)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def _bare(optimizer: Any) -> torch.optim.Optimizer:
    return getattr(optimizer, "optimizer", optimizer)     # Accelerate's AcceleratedOptimizer wraps the torch one


def full_model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's full state dict (plain tensors); collective when the model is sharded."""
    if not is_sharded(model):
        return model.state_dict()
    return get_model_state_dict(model, options=_FULL)


def full_optimizer_state(model: torch.nn.Module, optimizer: Any) -> dict:
    """The optimizer's state dict with full tensors; collective when the model is sharded."""
    if not is_sharded(model):
        return optimizer.state_dict()
    return get_optimizer_state_dict(model, _bare(optimizer), options=_FULL)


def load_full_model_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load a full state dict (every process holds it) into a plain or sharded model (strict keys); ``state`` is
    left as it was (PyTorch's loader replaces its values by shards, so it gets a copy of the mapping)."""
    if not is_sharded(model):
        model.load_state_dict(state)
        return
    set_model_state_dict(model, dict(state), options=_FULL)


def load_full_optimizer_state(model: torch.nn.Module, optimizer: Any, state: dict) -> None:
    """Load a full optimizer state dict into the optimizer of a plain or sharded model."""
    if not is_sharded(model):
        optimizer.load_state_dict(state)
        return
    set_optimizer_state_dict(model, _bare(optimizer), state, options=_FULL)
