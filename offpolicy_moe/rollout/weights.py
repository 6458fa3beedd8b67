"""Policy weights by version, shared between the trainer and its rollout workers on one machine.

:class:`WeightBoard` holds TWO copies of the policy's tensors in shared memory, each with its version and a
sequence counter.  The trainer (the only writer) publishes into the copy that is NOT the newest, then points readers
at it; a worker copies the newest into its engine and copies again if the counter moved meanwhile (a seqlock).  No
lock is shared between processes, so a worker killed mid-copy cannot block anyone.  Across machines a
``torch.distributed`` broadcast plays this role (docs/async.md).
"""
from __future__ import annotations

import time
from typing import Any, Mapping

import torch

__all__ = ["WeightBoard", "WeightWaitTimeout"]

_MAX_READ_TRIES = 1000


class WeightWaitTimeout(TimeoutError):
    """A worker waited too long for a policy version."""


class WeightBoard:
    """Shared-memory policy weights with versions (see module docstring); pass it to the worker processes."""

    def __init__(self, state_dict: Mapping[str, torch.Tensor], ctx: Any):
        self.slots = [{k: v.detach().to("cpu", copy=True).contiguous().share_memory_() for k, v in state_dict.items()}
                      for _ in range(2)]
        self._seq = ctx.Array("q", [0, 0], lock=False)             # odd while the trainer writes the copy
        self._slot_version = ctx.Array("q", [-1, -1], lock=False)
        self._newest = ctx.Value("q", 0, lock=False)                # the copy readers take

    @property
    def version(self) -> int:
        """The newest published version (-1 before the first publish)."""
        return int(self._slot_version[self._newest.value])

    def publish(self, state_dict: Mapping[str, torch.Tensor], version: int) -> float:
        """Copy ``state_dict`` (same keys and shapes as the board) in as ``version``; returns the seconds spent.
        Only one process (the trainer) may publish."""
        t0 = time.perf_counter()
        keys = self.slots[0].keys()
        if state_dict.keys() != keys:
            missing = sorted(set(keys) - set(state_dict))[:3]
            extra = sorted(set(state_dict) - set(keys))[:3]
            raise KeyError(f"weight board: state_dict keys differ from the board's (missing {missing}, extra {extra})")
        if version < self.version:
            raise ValueError(f"weight board: version {version} is older than the published {self.version}")
        slot = 1 - self._newest.value if self.version >= 0 else 0
        self._seq[slot] += 1
        with torch.no_grad():
            for k, dst in self.slots[slot].items():
                dst.copy_(state_dict[k])
        self._slot_version[slot] = int(version)
        self._seq[slot] += 1
        self._newest.value = slot
        return time.perf_counter() - t0

    def wait_for(self, version: int, timeout: float, what: str = "") -> float:
        """Block until version ``>= version`` is published; returns the seconds waited;
        :class:`WeightWaitTimeout` naming ``what`` after ``timeout`` seconds."""
        t0 = time.perf_counter()
        while self.version < version:
            if time.perf_counter() - t0 > timeout:
                raise WeightWaitTimeout(f"waited {timeout:.0f} s for policy version {version} (newest published: "
                                        f"{self.version}){' for ' + what if what else ''}")
            time.sleep(0.002)
        return time.perf_counter() - t0

    def load_into(self, engine: Any) -> bool:
        """``engine.sync`` the newest weights when they are newer than ``engine.version``; True if it synced."""
        for _ in range(_MAX_READ_TRIES):
            slot = int(self._newest.value)
            seq, version = int(self._seq[slot]), int(self._slot_version[slot])
            if version <= engine.version:
                return False
            if seq % 2:                       # being rewritten: the newest pointer moves on at once
                time.sleep(0.001)
                continue
            engine.sync(self.slots[slot], version)
            if int(self._seq[slot]) == seq:
                return True
            engine.forget_version()           # a torn copy: not this version, read again
        raise RuntimeError(f"weight board: no consistent copy of the weights in {_MAX_READ_TRIES} reads")
