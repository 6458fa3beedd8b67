"""Load-balancing auxiliary loss computed from the experts actually used: transformers re-derives the router's own
top-k from ``router_logits``, which under R3/R2 replay balances experts that did not run.

Switch Transformer (Fedus et al., arXiv:2101.03961, eq. 4-6, K experts per token as in Mixtral):
``loss = E * sum_e f_e * P_e`` with ``f_e = (1/N) * #{(n, k): id[n, k] = e}`` and
``P_e = (1/N) * sum_n softmax(logits[n])_e``, over the N real tokens of every MoE layer pooled; the gradient flows
through ``P`` only.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

__all__ = ["load_balancing_loss"]


def load_balancing_loss(logits: Sequence[torch.Tensor], ids: Sequence[torch.Tensor], num_experts: int,
                        token_mask: Sequence[torch.Tensor | None] | None = None) -> torch.Tensor:
    """``E * sum_e f_e P_e`` pooled over layers (see module docstring), from each MoE-layer call's router
    ``logits[N_i, E]``, the expert ``ids[N_i, K]`` used and, optionally, a bool ``token_mask[N_i]`` of real tokens."""
    if len(logits) != len(ids) or not logits:
        raise ValueError(f"load_balancing_loss needs one ids tensor per logits tensor, got {len(logits)} and "
                         f"{len(ids)}")
    masks = list(token_mask) if token_mask is not None else [None] * len(logits)
    lg, sel, wt = [], [], []
    for i, (l, x, m) in enumerate(zip(logits, ids, masks)):
        l = l.reshape(-1, l.shape[-1])
        x = x.reshape(l.shape[0], -1)
        if l.shape[-1] != num_experts:
            raise ValueError(f"router logits of call {i} have {l.shape[-1]} experts, expected {num_experts}")
        lg.append(l)
        sel.append(x.long())
        wt.append(torch.ones(l.shape[0], device=l.device) if m is None else m.reshape(-1).to(l.device).float())
    probs = F.softmax(torch.cat(lg).float(), dim=-1)
    w = torch.cat(wt)
    n = w.sum().clamp_min(1.0)
    counts = F.one_hot(torch.cat(sel).clamp(0, num_experts - 1), num_experts).float().sum(1)  # [N, E]
    f = (counts * w[:, None]).sum(0) / n
    p = (probs * w[:, None]).sum(0) / n
    return num_experts * (f * p).sum()
