"""The weights of past policy versions, kept for old log-probs of tokens a version sampled after the trainer moved on.

:class:`VersionRing` keeps CPU copies of the last ``keep`` published versions; :class:`PastWeights` gives a model
that holds one of them: the trainer's own scratch copy of the policy, never its live model.
"""
from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Mapping, Optional

import torch

from offpolicy_moe.rollout.batch import RolloutBatch
from offpolicy_moe.logprobs.forward import RoutedForward

__all__ = ["VersionRing", "PastWeights", "versions_of"]


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


class PastWeights:
    """A scratch copy of ``model`` (made on first use, with its own routing controller in ``forward``) that holds
    the weights of one past version at a time."""

    def __init__(self, model: torch.nn.Module, forward: RoutedForward):
        self._live, self._forward = model, forward
        self._copy: Optional[torch.nn.Module] = None
        self._holds: Optional[dict] = None       # the ring entry loaded

    def model_at(self, version: int, ring: VersionRing) -> torch.nn.Module:
        """The scratch model with ``ring[version]`` loaded."""
        if self._copy is None:
            self._copy = copy.deepcopy(self._live).requires_grad_(False)
            self._copy.zero_grad(set_to_none=True)
            self._forward.attach(self._copy)
        state = ring[version]
        if self._holds is not state:
            with torch.no_grad():
                for k, v in self._copy.state_dict().items():
                    v.copy_(state[k])
            self._holds = state
        return self._copy


def versions_of(batch: RolloutBatch) -> list[int]:
    """The policy versions that sampled ``batch``'s response tokens, oldest first."""
    if batch.token_versions is None or not bool(batch.response_mask.any()):
        return [int(batch.version)]
    return sorted({int(v) for v in batch.token_versions[batch.response_mask.bool()].tolist()})
