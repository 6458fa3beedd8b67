"""Tiny model presets built from config (random init, nothing downloaded; vocabulary and special ids from the
tokenizer).

* ``tiny-qwen3-moe``: ``Qwen3MoeForCausalLM``, every layer an MoE block (``norm_topk_prob=True`` as in Qwen3-MoE),
  head_dim 16 (32 is the variant vLLM's CPU attention serves, docs/engines.md), kv heads = heads / 2 (for an odd
  count the largest divisor below half of it: :func:`kv_heads`), expert width =
  hidden size, untied embeddings, no router aux loss in the model (the trainer owns that coefficient).
* ``tiny-dense``: ``Qwen3ForCausalLM`` with a dense MLP (4 × hidden), for tests that must refuse a dense model.
"""
from __future__ import annotations

from typing import Callable

import torch

from .dtypes import resolve_dtype
from .experts import AUTO, resolve_experts_implementation

HEAD_DIM = 16
MAX_POSITIONS = 256


def kv_heads(heads: int) -> int:
    """Key/value heads of a preset with ``heads`` query heads: the largest divisor of ``heads`` that is at most
    ``max(1, heads // 2)`` (``heads / 2`` for an even count; grouped-query attention needs a divisor: 5 heads get 1,
    9 get 3)."""
    half = max(1, heads // 2)
    return next(d for d in range(half, 0, -1) if heads % d == 0)


def _common(vocab_size: int, hidden_size: int, num_layers: int, special_ids: dict, head_dim: int = HEAD_DIM) -> dict:
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    if num_layers < 1:
        raise ValueError(f"model.num_layers must be >= 1, got {num_layers}")
    if head_dim < 1 or hidden_size < head_dim or hidden_size % head_dim:
        raise ValueError(f"model.hidden_size must be a positive multiple of model.head_dim={head_dim}, "
                         f"got {hidden_size}")
    heads = hidden_size // head_dim
    return dict(vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
                num_attention_heads=heads, num_key_value_heads=kv_heads(heads), head_dim=head_dim,
                max_position_embeddings=MAX_POSITIONS, tie_word_embeddings=False, attention_dropout=0.0,
                rms_norm_eps=1e-6, use_cache=True, **special_ids)


def tiny_qwen3_moe_config(vocab_size: int, *, num_layers: int = 2, hidden_size: int = 64, num_experts: int = 8,
                          top_k: int = 2, special_ids: dict | None = None, experts_implementation: str = AUTO,
                          head_dim: int = HEAD_DIM):
    """``Qwen3MoeConfig`` of the ``tiny-qwen3-moe`` preset."""
    from transformers import Qwen3MoeConfig

    if num_experts < 2:
        raise ValueError(f"model.num_experts must be >= 2 for an MoE preset, got {num_experts}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"model.top_k must be in [1, num_experts={num_experts}], got {top_k}")
    return Qwen3MoeConfig(**_common(vocab_size, hidden_size, num_layers, special_ids or {}, head_dim),
                          intermediate_size=4 * hidden_size, moe_intermediate_size=hidden_size,
                          num_experts=num_experts, num_experts_per_tok=top_k, norm_topk_prob=True,
                          decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.0,
                          output_router_logits=False,
                          experts_implementation=resolve_experts_implementation(experts_implementation))


def tiny_dense_config(vocab_size: int, *, num_layers: int = 2, hidden_size: int = 64, special_ids: dict | None = None,
                      head_dim: int = HEAD_DIM, **_ignored):
    """``Qwen3Config`` of the ``tiny-dense`` preset (no MoE)."""
    from transformers import Qwen3Config

    return Qwen3Config(**_common(vocab_size, hidden_size, num_layers, special_ids or {}, head_dim),
                       intermediate_size=4 * hidden_size)


def _build_moe(config):
    from transformers import Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM(config)


def _build_dense(config):
    from transformers import Qwen3ForCausalLM

    return Qwen3ForCausalLM(config)


PRESETS: dict[str, tuple[Callable, Callable]] = {
    "tiny-qwen3-moe": (tiny_qwen3_moe_config, _build_moe),
    "tiny-dense": (tiny_dense_config, _build_dense),
}

def build_preset(preset: str, vocab_size: int, *, num_layers: int = 2, hidden_size: int = 64, num_experts: int = 8,
                 top_k: int = 2, special_ids: dict | None = None, dtype="float32",
                 experts_implementation: str = AUTO, seed: int | None = None, head_dim: int = HEAD_DIM):
    """Instantiate a preset with random weights; ``seed`` makes the init deterministic without
    touching the caller's global RNG state (``torch.random.fork_rng``)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; expected one of {sorted(PRESETS)} or set model.path")
    make_config, make_model = PRESETS[preset]
    config = make_config(vocab_size, num_layers=num_layers, hidden_size=hidden_size, num_experts=num_experts,
                         top_k=top_k, special_ids=special_ids, experts_implementation=experts_implementation,
                         head_dim=head_dim)
    with torch.random.fork_rng(devices=[]):
        if seed is not None:
            torch.manual_seed(seed)
        model = make_model(config)
    return model.to(resolve_dtype(dtype))
