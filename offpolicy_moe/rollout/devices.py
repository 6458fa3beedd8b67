"""One device per rollout engine: which GPU each vLLM engine of a run takes (docs/engines.md, "On a GPU").

* **slots.**  The trainer's own engine takes its process's local rank ``r`` (``LOCAL_RANK``); rollout worker ``i``
  of local rank ``r`` takes ``r * rollout.workers + i``;
* **devices.**  The engine of slot ``s`` runs on ``devices[s % len(devices)]``, ``devices`` being
  ``rollout.vllm_devices`` (indices as the trainer sees them) or every GPU it sees;
* **Ray actors** ask Ray for ``rollout.ray_num_gpus`` GPUs each (null: 1 for vLLM on CUDA, else 0).

A worker gets its GPU as ``CUDA_VISIBLE_DEVICES`` narrowed from the trainer's own (so an index means the same GPU in
both), set before it touches CUDA.
"""
from __future__ import annotations

import os
from typing import Any, Optional, Sequence

import torch

__all__ = ["local_rank", "visible_gpus", "engine_gpu", "worker_slot", "visible_devices", "worker_environment",
           "ray_gpus_per_actor"]


def local_rank(rank: int = 0) -> int:
    """This process's rank on its machine: ``LOCAL_RANK`` (set by torchrun / accelerate launch, read by accelerate
    as ``local_process_index``), else ``rank`` (one machine)."""
    return int(os.environ.get("LOCAL_RANK", rank))


def visible_gpus() -> int:
    """How many CUDA GPUs this process sees (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def engine_gpu(slot: int, devices: Sequence[int], n_visible: int) -> Optional[int]:
    """The GPU index (as this process sees it) of the engine of ``slot``: ``devices[slot % len(devices)]``, or
    ``slot % n_visible`` with no ``devices``; None without GPUs.  A one-line ``ValueError`` for a listed device this
    process does not see."""
    if n_visible <= 0:
        return None
    devices = [int(d) for d in devices]
    bad = [d for d in devices if not 0 <= d < n_visible]
    if bad:
        raise ValueError(f"rollout.vllm_devices={devices}: GPU {bad[0]} is not one of the {n_visible} this process "
                         "sees (indices as CUDA_VISIBLE_DEVICES numbers them)")
    return devices[slot % len(devices)] if devices else slot % n_visible


def worker_slot(local: int, index: int, workers: int) -> int:
    """Slot of rollout worker ``index`` of local rank ``local``, each rank having ``workers`` of them."""
    return int(local) * int(workers) + int(index)


def visible_devices(index: int, current: Optional[str]) -> str:
    """``CUDA_VISIBLE_DEVICES`` that shows only GPU ``index`` of those ``current`` (this process's value; None or
    empty: all) shows."""
    if current is None or not current.strip():
        return str(index)
    ids = [x.strip() for x in current.split(",") if x.strip()]
    if not 0 <= index < len(ids):
        raise ValueError(f"GPU {index} is not one of the {len(ids)} of CUDA_VISIBLE_DEVICES={current}")
    return ids[index]


def worker_environment(cfg: Any, *, rank: int, index: int, n_visible: Optional[int] = None) -> dict[str, str]:
    """The environment a local rollout worker starts with: ``CUDA_VISIBLE_DEVICES`` of its GPU (the rule above)
    when its engine is vLLM and the trainer sees GPUs; empty otherwise (the built-in engine's workers run on the
    CPU)."""
    ro = cfg.rollout
    if ro.engine != "vllm":
        return {}
    n = visible_gpus() if n_visible is None else int(n_visible)
    gpu = engine_gpu(worker_slot(local_rank(rank), index, ro.workers), list(ro.vllm_devices or []), n)
    if gpu is None:
        return {}
    return {"CUDA_VISIBLE_DEVICES": visible_devices(gpu, os.environ.get("CUDA_VISIBLE_DEVICES"))}


def ray_gpus_per_actor(cfg: Any, cuda: Optional[bool] = None) -> float:
    """GPUs each Ray rollout actor asks for: ``rollout.ray_num_gpus``, else 1 when the engine is vLLM and the
    trainer sees CUDA (``cuda``; read here when None), else 0."""
    ro = cfg.rollout
    if ro.ray_num_gpus is not None:
        return float(ro.ray_num_gpus)
    if cuda is None:
        cuda = torch.cuda.is_available()
    return 1.0 if ro.engine == "vllm" and cuda else 0.0
