"""Attention for the sampling loop's decode steps: one query per row against the KV cache, as two batched matmuls.

PyTorch's CPU ``scaled_dot_product_attention`` kernel is tiled for many queries; with one query per row it took
1.1-1.7x (float32) and 2.3-4.2x (bfloat16) the time of::

    o_h = softmax(scale * q_h K_{h//g}^T + m) V_{h//g}

(``experiments/bench/bench_decode_attention.py``; ``g = heads / kv_heads``, ``m`` the additive mask), computed in
float32 whatever the cache dtype, the ``g`` query heads of one key/value head in one ``[g, D] x [D, L]`` matmul so
the cache is read once.  Every other call (prefill, several queries, dropout, a position bias, soft-capping,
attention sinks) goes to transformers' own SDPA function unchanged (:func:`use_single_query_decode`).
"""
from __future__ import annotations

from typing import Optional

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

__all__ = ["NAME", "single_query_attention", "use_single_query_decode"]

NAME = "offpolicy_moe_single_query"
# keyword arguments that change the attention formula: such calls keep transformers' SDPA path
_DELEGATE_KWARGS = ("position_bias", "softcap", "s_aux", "sinks", "cache")


def single_query_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: Optional[torch.Tensor], dropout: float = 0.0,
                           scaling: Optional[float] = None, is_causal: Optional[bool] = None,
                           **kwargs) -> tuple[torch.Tensor, None]:
    """``softmax(scale * q K^T + mask) V`` for ``query [B, H, 1, D]`` against ``key, value [B, H_kv, L, D]``,
    returned as ``([B, 1, H, D], None)`` like transformers' attention functions; any other call is transformers'
    ``sdpa_attention_forward``.  Values may have their own head size (multi-head latent attention: ``[B, H_kv, L, Dv]``
    gives ``[B, 1, H, Dv]``).  ``attention_mask``: ``None``, boolean (True = attend) or additive float, shaped
    ``[B or 1, 1 or H, 1, L]``."""
    B, H, q_len, D = query.shape
    if q_len != 1 or dropout or key.shape[1] == 0 or H % key.shape[1] \
            or any(kwargs.get(k) is not None for k in _DELEGATE_KWARGS):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    kv, L = key.shape[1], key.shape[2]
    g = H // kv
    scale = D ** -0.5 if scaling is None else float(scaling)
    q = query.reshape(B, kv, g, D).float()                      # head h = (h // g, h % g), as repeat_kv lays out
    scores = torch.matmul(q, key.float().transpose(-1, -2)).mul_(scale)     # [B, kv, g, L]
    if attention_mask is not None:
        m = attention_mask[..., :L]
        m = m.reshape(m.shape[0], kv, g, L) if m.shape[1] == H else m.reshape(m.shape[0], 1, 1, L)
        if m.dtype == torch.bool:
            scores = scores.masked_fill_(~m, float("-inf"))
        else:
            scores = scores.add_(m.float())
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, value.float()).to(query.dtype)    # [B, kv, g, Dv]
    return out.reshape(B, 1, H, value.shape[-1]), None


def _register() -> None:
    """Register :data:`NAME` with transformers (idempotent): the attention function and SDPA's mask builder."""
    if NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(NAME, single_query_attention)
    if NAME not in AttentionMaskInterface._global_mapping:
        AttentionMaskInterface.register(NAME, sdpa_mask)


def use_single_query_decode(model: torch.nn.Module) -> bool:
    """Switch ``model`` (a transformers model) from ``"sdpa"`` attention to :func:`single_query_attention`; returns
    whether it was switched.  A model on any other implementation (eager, flash, flex) or one that cannot change its
    implementation after loading is left as it is."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != "sdpa" or not hasattr(model, "set_attn_implementation"):
        return False
    _register()
    if not model._can_set_attn_implementation():
        return False
    model.set_attn_implementation(NAME)
    return model.config._attn_implementation == NAME
