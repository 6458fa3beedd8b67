"""The rollout worker as a Ray actor, and the registry that tells actors the newest published weights.

:class:`RolloutActor` is :func:`~offpolicy_moe.rollout.worker.worker_main`'s loop body as an object; per
:meth:`RolloutActor.generate` it pulls the newest weights from Ray's object store when newer than the engine's (one
object, one version per call).  Neither class imports Ray: :mod:`~offpolicy_moe.sources.ray_transport` wraps them
with ``ray.remote``, so ``import offpolicy_moe`` stays Ray-free.
"""
from __future__ import annotations

import importlib
import os
import time
import warnings
from typing import Any, Mapping, Optional

import torch

from offpolicy_moe.models import load_policy
from offpolicy_moe.rollout.messages import BatchDone, Order, WorkerSpec
from offpolicy_moe.rollout.worker import build_engine, generate_iteration
from offpolicy_moe.tasks import make_task

__all__ = ["RolloutActor", "WeightRegistry", "encode_weights", "decode_weights"]

_POLL_S = 0.05          # update_in_flight: the registry is asked at most this often between decode steps


def _ray() -> Any:
    return importlib.import_module("ray")


def encode_weights(state_dict: Mapping[str, torch.Tensor]) -> dict[str, tuple[Any, str, tuple]]:
    """``{name: (bytes as a uint8 NumPy array, dtype name, shape)}``: how a version goes into Ray's object store.
    NumPy arrays are stored out of band and read back without a copy (a ``torch.Tensor`` would be pickled, i.e.
    copied, on both sides); the byte view keeps every dtype (bfloat16 too) bit for bit."""
    out = {}
    for k, v in state_dict.items():
        t = v.detach().to("cpu").contiguous()
        out[k] = (t.reshape(-1).view(torch.uint8).numpy(), str(t.dtype).removeprefix("torch."), tuple(t.shape))
    return out


def decode_weights(encoded: Mapping[str, tuple[Any, str, tuple]]) -> dict[str, torch.Tensor]:
    """Inverse of :func:`encode_weights`: tensors viewing the (read-only, shared) object-store buffers; read them
    only (:meth:`RolloutEngine.sync` copies them into the engine)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return {k: (torch.from_numpy(arr).view(getattr(torch, dtype)).reshape(shape) if arr.size
                    else torch.empty(shape, dtype=getattr(torch, dtype)))
                for k, (arr, dtype, shape) in encoded.items()}


class WeightRegistry:
    """The newest published policy version and the object-store reference of its weights (one per version,
    put by the trainer); the reference is held in a one-element list so Ray hands it over unresolved."""

    def __init__(self) -> None:
        self.version = -1
        self.ref: list = []

    def set(self, version: int, ref: list) -> None:
        """Version ``version``'s weights are ``ref[0]``; an older version than the newest is ignored."""
        if int(version) >= self.version:
            self.version, self.ref = int(version), list(ref)

    def node(self) -> str:
        """Ray node id of the node this registry runs on."""
        return _ray().get_runtime_context().get_node_id()

    def newest(self) -> tuple[int, list]:
        """``(version, [reference])`` of the newest published weights (``(-1, [])`` before the first)."""
        return self.version, self.ref


class RolloutActor:
    """One rollout worker on a Ray node (see module docstring)."""

    def __init__(self, spec: WorkerSpec, registry: Any):
        torch.set_num_threads(max(int(spec.threads), 1))
        self.spec, self.registry = spec, registry
        cfg = spec.cfg
        self.task = make_task(cfg.task)
        model, tok = load_policy(cfg.model, seed=cfg.seed, task=self.task, progress=cfg.logging.progress)
        self.engine = build_engine(cfg, model, tok)
        self.engine.forget_version()              # nothing loaded yet: the first order pulls the newest weights
        self._last_end: Optional[float] = None
        self._last_poll = 0.0
        if spec.update_in_flight:
            self.engine.call_between_tokens(self._poll)

    def watch(self) -> None:
        """Never returns while the actor lives (called in its own concurrency group, beside the orders): the
        trainer's pending call fails the moment the actor or its node dies, as a process sentinel does locally,
        even when the actor has no order in flight."""
        while True:
            time.sleep(3600)

    def ready(self) -> dict:
        """Where this actor runs: ``{"pid", "node_id", "ip"}``."""
        ctx = _ray().get_runtime_context()
        return {"pid": os.getpid(), "node_id": ctx.get_node_id(), "ip": _ray().util.get_node_ip_address()}

    def _load_newest(self, floor: int, floor_ref: list, timeout: float) -> float:
        """Load the newest published weights (at least version ``floor``, whose reference ``floor_ref`` came with
        the order) when newer than the engine's; returns the seconds spent pulling and copying."""
        t0 = time.perf_counter()
        ray = _ray()
        version, ref = ray.get(self.registry.newest.remote(), timeout=timeout)
        if version < floor:
            version, ref = floor, floor_ref
        if version > self.engine.version:
            self.engine.sync(decode_weights(ray.get(ref[0], timeout=timeout)), version)
        return time.perf_counter() - t0

    def _poll(self, engine: Any) -> None:
        """Between decode steps (``rollout.update_in_flight``): take a newer version if one was published."""
        now = time.perf_counter()
        if now - self._last_poll >= _POLL_S:
            self._last_poll = now
            self._load_newest(engine.version, [], self.spec.weight_timeout_s)

    def generate(self, order: Order, version: int, ref: list) -> BatchDone:
        """Generate ``order``'s iteration with the newest published weights (version ``>= version``, whose
        object-store reference is ``ref[0]``); returns the batch and the timings as a :class:`BatchDone`."""
        if version < order.min_version:
            raise ValueError(f"iteration {order.iteration} needs policy version >= {order.min_version}, the order "
                             f"carries version {version}")
        t0 = time.perf_counter()
        c0 = time.process_time()
        sync_s = self._load_newest(version, ref, self.spec.weight_timeout_s)
        t1 = time.perf_counter()
        batch = generate_iteration(self.engine, self.task, self.spec.cfg.rollout, iteration=order.iteration,
                                   seed=order.seed, rank=self.spec.rank, world=self.spec.world)
        t2 = time.perf_counter()
        wait_s = 0.0 if self._last_end is None else t0 - self._last_end
        self._last_end = t2
        timings = {"wait_s": wait_s, "sync_s": sync_s, "generate_s": t2 - t1, "cpu_s": time.process_time() - c0}
        return BatchDone(self.spec.index, order.iteration, order.attempt, batch.state_dict(), timings)

