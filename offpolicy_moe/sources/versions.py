"""Policy versions: the weights of the last few versions, the old-log-prob pass under the version that sampled
each token, and the lag of a batch's tokens behind the trainer.

Old log-probs are taken under the weights that generated each token: the trainer keeps CPU copies of the last
``k + 1`` versions (:class:`VersionRing`) and :func:`prepare_at_versions` runs the trainer's old-log-prob pass with
the generating version's weights loaded (one pass per distinct version in the batch; with updates in flight each
token takes the value of its own version).  TIS, M2PO and decoupled PPO then read ``old_logp`` / ``behav_logp``
per token, unchanged.
"""
from __future__ import annotations

import contextlib
from collections import OrderedDict
from dataclasses import replace
from typing import Callable, Iterator, Mapping

import torch

from offpolicy_moe.rollout.batch import RolloutBatch
from offpolicy_moe.sources.schedule import lag

__all__ = ["VersionRing", "loaded_weights", "prepare_at_versions", "token_lag"]


class VersionRing:
    """CPU copies of the policy's weights for the last ``keep`` versions."""

    def __init__(self, keep: int):
        if keep < 1:
            raise ValueError(f"VersionRing keeps at least one version, got keep={keep}")
        self.keep = int(keep)
        self._states: "OrderedDict[int, dict]" = OrderedDict()

    def add(self, version: int, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Remember ``state_dict`` (copied to CPU) as ``version``; forgets the oldest beyond ``keep``."""
        self._states[int(version)] = {k: v.detach().to("cpu", copy=True) for k, v in state_dict.items()}
        while len(self._states) > self.keep:
            self._states.popitem(last=False)

    def __getitem__(self, version: int) -> dict:
        if version not in self._states:
            raise KeyError(f"policy version {version} is not kept (kept: {list(self._states)}); buffer.staleness "
                           "bounds how old a batch can be")
        return self._states[version]

    def __contains__(self, version: int) -> bool:
        return version in self._states


@contextlib.contextmanager
def loaded_weights(model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> Iterator[None]:
    """``model`` holds ``state`` inside the block and its own weights again afterwards (in-place copies)."""
    own = model.state_dict()
    saved = {k: v.detach().clone() for k, v in own.items()}
    with torch.no_grad():
        for k, v in own.items():
            v.copy_(state[k])
    try:
        yield
    finally:
        with torch.no_grad():
            for k, v in own.items():
                v.copy_(saved[k])


def _versions_of(batch: RolloutBatch) -> list[int]:
    if batch.token_versions is None or not bool(batch.response_mask.any()):
        return [int(batch.version)]
    return sorted({int(v) for v in batch.token_versions[batch.response_mask.bool()].tolist()})


def prepare_at_versions(batch: RolloutBatch, ring: VersionRing, *, current: int, model: torch.nn.Module,
                        prepare: Callable[[RolloutBatch], None]) -> None:
    """The old-log-prob pass ``prepare`` on ``batch`` under the weights of the versions that sampled it: the whole
    pass (measurements, R2 routes) under the oldest version, and for each newer version present its tokens'
    ``old_logp`` from a pass under that version (``old_logp[b, t]`` is then ``log π_{v(b,t)}(x_t)``).  ``model``
    holds version ``current``; older versions' weights come from ``ring`` and are loaded for their pass only."""
    versions = _versions_of(batch)
    for j, v in enumerate(versions):
        ctx = contextlib.nullcontext() if v == current else loaded_weights(model, ring[v])
        with ctx:
            if j == 0:
                prepare(batch)
                continue
            part = replace(batch, old_logp=None, extras={})
            prepare(part)
        if batch.old_logp is not None and part.old_logp is not None:
            sel = batch.token_versions == v
            batch.old_logp = torch.where(sel, part.old_logp, batch.old_logp)


def token_lag(step: int, batch: RolloutBatch) -> tuple[float, float]:
    """Mean and max over the batch's response tokens of their lag at ``step`` (:func:`~.schedule.lag`)."""
    mask = batch.response_mask.bool()
    if batch.token_versions is None or not bool(mask.any()):
        whole = float(lag(step, batch.version))
        return whole, whole
    lags = lag(step, batch.token_versions[mask]).double()
    return float(lags.mean()), float(lags.max())
