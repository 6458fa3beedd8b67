"""Policy weights by version, shared between the trainer and its rollout workers on one machine.

:class:`WeightBoard` holds one copy of the policy's tensors in shared memory (``Tensor.share_memory_``, what
``torch.multiprocessing`` ships), a version counter and a condition variable.  The trainer :meth:`publish`-es the
weights of version ``v`` after every trained step (one in-place copy); a worker :meth:`load_into` its engine when
the board is newer than the engine (one in-place copy, cast to the engine's dtype) and may :meth:`wait_for` a
version.  Writer and readers hold the board's lock while copying, so a reader never sees half of two versions.

Across machines the same role is played by a ``torch.distributed`` broadcast of the same tensors from the trainer's
rank to the worker ranks (gloo on CPU, NCCL on GPU); see docs/async.md.
"""
from __future__ import annotations

import time
from typing import Any, Mapping

import torch

__all__ = ["WeightBoard", "WeightWaitTimeout"]


class WeightWaitTimeout(TimeoutError):
    """A worker waited too long for a policy version."""


class WeightBoard:
    """Shared-memory policy weights with a version (see module docstring); pass it to ``spawn``-ed processes."""

    def __init__(self, state_dict: Mapping[str, torch.Tensor], ctx: Any):
        self.tensors = {k: v.detach().to("cpu", copy=True).contiguous().share_memory_()
                        for k, v in state_dict.items()}
        self._version = ctx.Value("q", -1, lock=False)
        self._cond = ctx.Condition(ctx.Lock())

    @property
    def version(self) -> int:
        """The newest published version (-1 before the first publish)."""
        return int(self._version.value)

    def publish(self, state_dict: Mapping[str, torch.Tensor], version: int) -> float:
        """Copy ``state_dict`` (same keys and shapes as the board) in as ``version``; returns the seconds spent."""
        t0 = time.perf_counter()
        if state_dict.keys() != self.tensors.keys():
            missing = sorted(set(self.tensors) - set(state_dict))[:3]
            extra = sorted(set(state_dict) - set(self.tensors))[:3]
            raise KeyError(f"weight board: state_dict keys differ from the board's (missing {missing}, extra {extra})")
        if version < self.version:
            raise ValueError(f"weight board: version {version} is older than the published {self.version}")
        with self._cond, torch.no_grad():
            for k, dst in self.tensors.items():
                dst.copy_(state_dict[k])
            self._version.value = int(version)
            self._cond.notify_all()
        return time.perf_counter() - t0

    def wait_for(self, version: int, timeout: float, what: str = "") -> float:
        """Block until version ``>= version`` is published; returns the seconds waited;
        :class:`WeightWaitTimeout` naming ``what`` after ``timeout`` seconds."""
        t0 = time.perf_counter()
        with self._cond:
            ok = self._cond.wait_for(lambda: self._version.value >= version, timeout=timeout)
        if not ok:
            raise WeightWaitTimeout(f"waited {timeout:.0f} s for policy version {version} (newest published: "
                                    f"{self.version}){' for ' + what if what else ''}")
        return time.perf_counter() - t0

    def load_into(self, engine: Any) -> bool:
        """``engine.sync`` the board's weights when they are newer than ``engine.version``; True if it synced."""
        if self._version.value <= engine.version:
            return False
        with self._cond:
            engine.sync(self.tensors, int(self._version.value))
        return True
