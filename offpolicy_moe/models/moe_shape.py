"""An MoE model config's routed-expert count and top-k, whatever the family calls them.

Families name the two numbers differently (transformers 5.x configs, or their ``config.json``):

| family | experts | top-k |
|---|---|---|
| Qwen2/3-MoE, OLMoE, Jamba | ``num_experts`` | ``num_experts_per_tok`` |
| Mixtral, PhiMoE, GraniteMoE, MiniMax, Llama 4, GPT-OSS | ``num_local_experts`` | ``num_experts_per_tok`` (GPT-OSS also ``experts_per_token``) |
| DeepSeek-V2/V3, GLM-4-MoE | ``n_routed_experts`` (shared experts are not routed) | ``num_experts_per_tok`` |
| Ernie 4.5 MoE | ``moe_num_experts`` | ``moe_k`` |
| Hunyuan MoE | ``num_experts`` | ``moe_topk`` |
| DBRX | ``ffn_config.moe_num_experts`` | ``ffn_config.moe_top_k`` |
| Gemma 4 | ``num_experts`` | ``top_k_experts`` |

Multimodal wrappers keep these under ``text_config``; both places are searched.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

EXPERT_COUNT_KEYS: tuple[str, ...] = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
TOP_K_KEYS: tuple[str, ...] = ("num_experts_per_tok", "experts_per_token", "num_experts_per_token", "top_k_experts",
                                "moe_topk", "moe_k", "moe_top_k", "top_k")
_NESTED: tuple[str, ...] = ("text_config", "ffn_config")


def _get(config: Any, key: str) -> Any:
    if isinstance(config, Mapping):
        return config.get(key)
    return getattr(config, key, None)


def _first_positive_int(config: Any, keys: tuple[str, ...]) -> Optional[int]:
    for scope in (config, *(_get(config, n) for n in _NESTED)):
        if scope is None:
            continue
        for key in keys:
            value = _get(scope, key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def moe_shape(config: Any) -> tuple[Optional[int], Optional[int]]:
    """``(num_experts, top_k)`` of a model config (a transformers config object or a ``config.json`` dict).

    Each is the first positive integer found under the family names of the module table, at the top level and then
    under ``text_config``/``ffn_config``; ``None`` where the config names none (a dense model gives ``(None, None)``).
    """
    return _first_positive_int(config, EXPERT_COUNT_KEYS), _first_positive_int(config, TOP_K_KEYS)


def declares_moe(config: Any) -> bool:
    """True when the config declares more than one routed expert."""
    n, _ = moe_shape(config)
    return n is not None and n > 1
