"""How routed experts run: ``model.experts_implementation=auto`` picks the faster of transformers' own kernels for the
device the layer runs on.

transformers runs a layer's routed experts through an implementation chosen by name (``ExpertsInterface``):
``grouped_mm`` sorts the (token, expert) pairs by expert and calls one grouped matmul per projection; ``eager`` is
the family's own loop, one dense matmul per expert and projection.  On the CPU neither always wins: the grouped
kernel is faster for small calls (a decode step, a short prompt) and slows down sharply above a size, e.g. for one
layer of the anchor model (hidden 128, 8 experts, top-2) forward at 640 tokens 1.64 ms against the loop's 1.76, at
768 tokens 3.38 against 2.03, at 33,664 tokens (an update at 256 response tokens) 202 against 119 ms
(``experiments/bench/bench_experts.py``, docs/benchmarks.md).  The crossover measured at hidden 32 / 64 / 128 / 256 lies
at about ``N * K * H = 2^18`` gathered values (N tokens, K experts each, hidden size H).  On a GPU the grouped
kernel is the fast one.  The config's default, ``auto``, therefore runs, at every call, the family's own loop when
the hidden states are on the CPU and ``N * K * H >=`` :data:`LOOP_MIN_ELEMENTS`, and ``grouped_mm`` otherwise (other
devices, smaller calls, expert parallelism), so one config serves both.  Both compute, for a token with selected
experts ``e_1..e_K`` and routing weights ``w_1..w_K``, ``y = sum_k w_k * down_{e_k}(gate(up_{e_k}(x)))``; they
differ in float rounding only (the order of the K terms).

:func:`resolve_experts_implementation` maps ``auto`` to :data:`NAME`, registered with transformers (once) the first
time; the name is not written into saved checkpoints, which load anywhere with transformers' default.
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
    ``top_k_weights [N, K]``: the family's own per-expert loop on the CPU from ``N * K * H >=``
    :data:`LOOP_MIN_ELEMENTS`, transformers' ``grouped_mm`` otherwise (module docstring); the signature of
    transformers' experts implementations."""
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
