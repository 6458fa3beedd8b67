"""How routed experts run: ``model.experts_implementation=auto`` picks the faster of transformers' own kernels for the
device the layer runs on.

On the CPU transformers' ``grouped_mm`` is faster than the family's own per-expert loop (``eager``) for small calls
and slows down sharply above about ``N * K * H = 2^18`` gathered values (N tokens, K experts, hidden size H;
``experiments/bench/bench_experts.py``); on a GPU it is the fast one.  ``auto`` (registered as :data:`NAME`, never
written into checkpoints) runs the loop when the hidden states are on the CPU and ``N * K * H >=``
:data:`LOOP_MIN_ELEMENTS`, ``grouped_mm`` otherwise.  Both compute ``y = sum_k w_k * down_{e_k}(gate(up_{e_k}(x)))``
and differ in float rounding only.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from transformers.integrations.moe import ExpertsInterface, grouped_mm_experts_forward

from .vocabulary import EXPERTS_OWN

__all__ = ["AUTO", "LOOP_MIN_ELEMENTS", "NAME", "auto_experts_forward", "experts_implementations",
           "register_experts_implementation", "resolve_experts_implementation"]

AUTO = EXPERTS_OWN[0]              # the config value "auto"
LOOP_MIN_ELEMENTS = 2 ** 18        # N * K * H from which the per-expert loop beats grouped_mm on the CPU
NAME = "offpolicy_moe_auto"        # the name registered with transformers


def _own_loop(module: torch.nn.Module) -> Optional[Callable]:
    """The experts class's own forward (its per-expert loop), under transformers' dispatching wrapper."""
    return getattr(type(module).forward, "__wrapped__", None)


def auto_experts_forward(self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                         top_k_weights: torch.Tensor) -> torch.Tensor:
    """``[N, H]`` output of the routed experts for ``hidden_states [N, H]``, ``top_k_index [N, K]`` and
    ``top_k_weights [N, K]`` (the signature of transformers' experts implementations), by the rule of the module
    docstring."""
    loop = _own_loop(self)
    if hidden_states.device.type == "cpu" and loop is not None and not getattr(self, "_is_expert_parallel", False) \
            and top_k_index.numel() * hidden_states.shape[-1] >= LOOP_MIN_ELEMENTS:
        return loop(self, hidden_states, top_k_index, top_k_weights)
    return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)


def register_experts_implementation() -> None:
    """Register :func:`auto_experts_forward` with transformers' ``ExpertsInterface`` under :data:`NAME` (once)."""
    if NAME not in ExpertsInterface._global_mapping:
        ExpertsInterface.register(NAME, auto_experts_forward)


def experts_implementations() -> tuple[str, ...]:
    """The values ``model.experts_implementation`` takes: ``auto``, ``eager`` and every name transformers'
    ``ExpertsInterface`` knows (``grouped_mm``, ``batched_mm``, ...; our registered :data:`NAME` excluded)."""
    return (*EXPERTS_OWN, *sorted(k for k in ExpertsInterface._global_mapping if k != NAME))


def resolve_experts_implementation(name: Optional[str]) -> Optional[str]:
    """The name to hand transformers for ``model.experts_implementation``: ``"auto"`` is :data:`NAME` (registered
    here first); any other value (``grouped_mm``, ``eager``, ``batched_mm``, ...) is passed through."""
    if name == AUTO:
        register_experts_implementation()
        return NAME
    return name
