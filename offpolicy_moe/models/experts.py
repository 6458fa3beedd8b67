"""An experts forward for transformers' MoE layers that is fast on the CPU: ``model.experts_implementation=auto``.

transformers runs a layer's routed experts through an implementation chosen by name (``ExpertsInterface``).  Its
``grouped_mm`` sorts the (token, expert) pairs by expert and calls one grouped matmul per projection; on the CPU
that kernel is slower than one dense matmul per expert: the experts of a 4-layer, hidden-128, 8-expert top-2 model
took 1.2-1.6x longer forward + backward than the loop below at 64-256 response tokens
(``experiments/bench_experts.py``, docs/benchmarks.md).  :func:`auto_experts_forward` computes, for token ``x``
with selected experts ``e_1..e_K`` and routing weights ``w_1..w_K``::

    y(x) = sum_k w_k * down_{e_k}( gate(up_{e_k}(x)) )

with the pairs sorted by expert (a stable sort, so the order inside an expert is the token order), each expert's rows
one dense ``F.linear`` per projection (the expert module's own gate function, biases, transposed layout and
post-expert norm), then the K contributions of a token summed in the order of its top-k list, as ``grouped_mm``
sums them.  On any other device, or with expert parallelism (routes that point outside this rank's experts), it is
transformers' ``grouped_mm`` itself.

It is registered with transformers under :data:`NAME` by :func:`register_experts_implementation` (idempotent),
which the model loaders call before building a model that asks for it.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from transformers.integrations.moe import ExpertsInterface, grouped_mm_experts_forward

__all__ = ["AUTO", "NAME", "auto_experts_forward", "register_experts_implementation", "resolve_experts_implementation"]

AUTO = "auto"                      # the config value
NAME = "offpolicy_moe_auto"        # the name registered with transformers


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], transposed: bool) -> torch.Tensor:
    """``x W^T + b`` for a ``[out, in]`` weight, ``x W + b`` for a transposed ``[in, out]`` one."""
    if transposed:
        out = x @ weight
        return out + bias if bias is not None else out
    return F.linear(x, weight, bias)


def auto_experts_forward(self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                         top_k_weights: torch.Tensor) -> torch.Tensor:
    """``[N, H]`` output of the routed experts for ``hidden_states [N, H]``, ``top_k_index [N, K]`` and
    ``top_k_weights [N, K]`` (module docstring); the signature of transformers' experts implementations."""
    E = int(self.num_experts)
    if hidden_states.device.type != "cpu" or getattr(self, "_is_expert_parallel", False) or top_k_index.numel() == 0:
        return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    N, K = top_k_index.shape[0], top_k_index.shape[-1]
    expert_ids = top_k_index.reshape(-1)
    counts = torch.bincount(expert_ids, minlength=E)
    if counts.numel() != E:          # an id >= E: not this rank's expert (expert-parallel sentinel)
        return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    order = torch.argsort(expert_ids, stable=True)
    rows = hidden_states.index_select(0, order // K)
    up_w = self.gate_up_proj if self.has_gate else self.up_proj
    up_b = (self.gate_up_proj_bias if self.has_gate else self.up_proj_bias) if self.has_bias else None
    down_b = self.down_proj_bias if self.has_bias else None
    outs = []
    for e, x in enumerate(rows.split(counts.tolist())):
        if x.shape[0] == 0:
            continue
        h = _linear(x, up_w[e], up_b[e] if up_b is not None else None, self.is_transposed)
        h = self._apply_gate(h) if self.has_gate else self.act_fn(h)
        h = _linear(h, self.down_proj[e], down_b[e] if down_b is not None else None, self.is_transposed)
        if self.has_post_expert_norm:
            h = self.post_expert_norm(h)
        outs.append(h)
    out = torch.cat(outs) * top_k_weights.reshape(-1).index_select(0, order).unsqueeze(-1)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    out = out.index_select(0, inverse).view(N, K, -1).sum(dim=1)
    return out.to(hidden_states.dtype)


def register_experts_implementation() -> None:
    """Register :func:`auto_experts_forward` with transformers' ``ExpertsInterface`` under :data:`NAME` (once)."""
    if NAME not in ExpertsInterface._global_mapping:
        ExpertsInterface.register(NAME, auto_experts_forward)


def resolve_experts_implementation(name: Optional[str]) -> Optional[str]:
    """The name to hand transformers for ``model.experts_implementation``: ``"auto"`` is :data:`NAME` (registered
    here first); any other value (``grouped_mm``, ``eager``, ``batched_mm``, ...) is passed through."""
    if name == AUTO:
        register_experts_implementation()
        return NAME
    return name
