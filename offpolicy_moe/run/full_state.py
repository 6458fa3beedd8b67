"""Full (unsharded) tensors of a model whose parameters FSDP2 has sharded into ``DTensor``\\ s, through PyTorch's
distributed-checkpoint state-dict API with ``full_state_dict=True`` (collective: every process calls them).  Plain
tensors (DDP, one process) are returned unchanged.
"""
from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

__all__ = ["as_full_tensor", "is_sharded", "full_model_state", "FULL"]

#: the state-dict options of a full (unsharded) state
FULL = StateDictOptions(full_state_dict=True, cpu_offload=False)


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether any parameter of ``model`` is a ``DTensor`` (FSDP2 / tensor-parallel sharding)."""
    return any(isinstance(p, DTensor) for p in model.parameters())


def as_full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor: ``t`` itself, or the full value of a ``DTensor`` (e.g. the gradient norm of a sharded
    model; collective)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def full_model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's full state dict (plain tensors); collective when the model is sharded."""
    if not is_sharded(model):
        return model.state_dict()
    return get_model_state_dict(model, options=FULL)
