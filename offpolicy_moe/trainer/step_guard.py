"""Divergence caught where it happens: a copy of the parameters and the optimizer state taken before
``optimizer.step()``, one fused finiteness check of the parameters after it, and an exact restore.

An update can be finite (finite loss, finite gradient norm) and still leave non-finite parameters, e.g. with a huge
learning rate; without this check the NaN only surfaces in the next forward, far from its cause.  The check is one
``torch._foreach_norm(·, inf)`` over all parameters (NaN and ±inf propagate through the max-norm, large finite
values do not overflow it) and one host sync.  The copy costs the memory of the parameters and of the optimizer
state once more; it is refreshed with ``torch._foreach_copy_`` into buffers allocated once.  Sharded (FSDP2)
parameters and their optimizer state are handled through their local shards (each process guards its own shard;
the trainer combines the finiteness verdict over processes).
"""
from __future__ import annotations

from typing import Any, Optional

import torch

__all__ = ["StepGuard", "max_abs"]


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor itself, or this process's shard of a ``DTensor``."""
    return t.to_local() if hasattr(t, "to_local") else t


def max_abs(params: list[torch.Tensor]) -> torch.Tensor:
    """0-d float32 tensor ``max_i max |p_i|`` over the tensors ``params`` (one fused max-norm, no host sync): it is
    finite iff every element is finite (NaN and ±inf propagate, finite values cannot overflow it)."""
    if not params:
        return torch.zeros(())
    norms = torch._foreach_norm([_local(p.detach()) for p in params], float("inf"))
    return torch.stack([n.float().to(norms[0].device) for n in norms]).max()


class StepGuard:
    """Snapshot / check / restore of the parameters and state of ``optimizer`` (every parameter of its groups),
    its group learning rates, and optionally a scheduler's state."""

    def __init__(self, optimizer: torch.optim.Optimizer, scheduler: Any = None):
        self.optimizer, self.scheduler = optimizer, scheduler
        self.params = [p for g in optimizer.param_groups for p in g["params"]]
        self._param_copy: Optional[list[torch.Tensor]] = None
        self._state_keys: list[tuple[int, str]] = []
        self._state_copy: list[torch.Tensor] = []
        self._state_other: dict[int, dict] = {}
        self._lrs: list[float] = []
        self._sched: Optional[dict] = None
        self.taken = False

    def _state_tensors(self) -> tuple[list[tuple[int, str]], list[torch.Tensor]]:
        keys, tensors = [], []
        for i, p in enumerate(self.params):
            for k, v in sorted(self.optimizer.state.get(p, {}).items()):
                if isinstance(v, torch.Tensor):
                    keys.append((i, k))
                    tensors.append(_local(v))
        return keys, tensors

    def snapshot(self) -> None:
        """Copy the current parameters, optimizer state, group lrs (and scheduler state) aside."""
        if self._param_copy is None:
            self._param_copy = [torch.empty_like(_local(p.detach())) for p in self.params]
        with torch.no_grad():
            torch._foreach_copy_(self._param_copy, [_local(p.detach()) for p in self.params])
            keys, tensors = self._state_tensors()
            if keys != self._state_keys:         # first step (state created lazily) or a changed layout
                self._state_keys, self._state_copy = keys, [torch.empty_like(t) for t in tensors]
            if tensors:
                torch._foreach_copy_(self._state_copy, tensors)
        self._state_other = {i: {k: v for k, v in self.optimizer.state[p].items() if not isinstance(v, torch.Tensor)}
                             for i, p in enumerate(self.params) if p in self.optimizer.state}
        self._lrs = [g["lr"] for g in self.optimizer.param_groups]
        self._sched = self.scheduler.state_dict() if self.scheduler is not None else None
        self.taken = True

    def params_max_abs(self) -> torch.Tensor:
        """:func:`max_abs` of the current parameters: finite iff they all are."""
        return max_abs(self.params)

    def restore(self) -> None:
        """Put back exactly what :meth:`snapshot` saw (parameters, optimizer state with its step counts, lrs,
        scheduler); optimizer state created after the snapshot is dropped."""
        if not self.taken:
            raise RuntimeError("StepGuard.restore() before any snapshot()")
        with torch.no_grad():
            torch._foreach_copy_([_local(p.detach()) for p in self.params], self._param_copy)
            present = {i for i, _ in self._state_keys} | set(self._state_other)
            for i, p in enumerate(self.params):
                if i not in present:
                    self.optimizer.state.pop(p, None)
            if self._state_keys:
                targets = []
                for i, k in self._state_keys:
                    st = self.optimizer.state[self.params[i]]
                    if not isinstance(st.get(k), torch.Tensor):     # dropped since: a plain tensor again
                        st[k] = torch.empty_like(self._state_copy[len(targets)])
                    targets.append(_local(st[k]))
                torch._foreach_copy_(targets, self._state_copy)
        for i, other in self._state_other.items():
            self.optimizer.state[self.params[i]].update(other)
        for g, lr in zip(self.optimizer.param_groups, self._lrs):
            g["lr"] = lr
        if self._sched is not None:
            self.scheduler.load_state_dict(self._sched)
