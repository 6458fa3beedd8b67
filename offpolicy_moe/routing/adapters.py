"""Per-family router adapters: how a Hugging Face router selects experts and weights them.

Every supported transformers 5.x MoE router returns ``(router_logits[N, E], topk_weights[N, K],
topk_indices[N, K])``; an adapter re-implements both halves from the logits, reproducing the router bit-exactly
(``tests/routing``), so that a hook can change the selection and recompute the weights with the model's own rule.
Under replay (R3, arXiv:2510.11370, section 3) the weights are gathered from the FULL distribution at the replayed
ids, then renormalised iff the model renormalises (never from top-k-zeroed probabilities, which would give a
replayed expert outside the current top-k zero weight and gradient).

Families (router class names; ``mlp.gate`` unless noted):
  * softmax (Qwen3-MoE, Qwen2-MoE, OLMoE): ``topk(softmax(l, fp32))``; weights = gathered probs,
    ``/ sum`` iff ``norm_topk_prob``, cast to the logits dtype.
  * mixtral (Mixtral, MiniMax): ``topk(softmax(l.float()))``; always renormalised; weights stay fp32.
  * deepseek_v3: ``sigmoid(l) + e_score_correction_bias`` with group-limited top-k for selection;
    weights = ``sigmoid(l)`` gathered (bias excluded), ``/ (sum + 1e-20)`` iff ``norm_topk_prob``,
    ``* routed_scaling_factor``. Dense first layers have no router.
  * gpt_oss (``mlp.router``, linear with bias): ``topk(l)``; weights = softmax over the K selected logits.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "RouterAdapter",
    "UnsupportedRouterError",
    "register_router_adapter",
    "get_router_adapter",
    "ROUTER_ADAPTERS",
    "REFUSED_ROUTERS",
    "NUM_EXPERTS_ATTRS",
    "TOP_K_ATTRS",
]


class UnsupportedRouterError(ValueError):
    """The model's router is not one this library can record/replay faithfully (its class is named)."""


@dataclass(frozen=True)
class RouterAdapter:
    """Selection and weighting rule of one router family.

    ``select(router, logits[N, E]) -> indices[N, K]`` (int64) is the router's own top-k rule;
    ``weights(router, logits[N, E], indices[N, K]) -> weights[N, K]`` its weighting rule applied to arbitrary indices
    (gathered from the full distribution); ``num_experts`` and ``top_k`` read E and K from the router.
    """

    family: str
    select: Callable[[nn.Module, torch.Tensor], torch.Tensor]
    weights: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
    num_experts: Callable[[nn.Module], int]
    top_k: Callable[[nn.Module], int]


def _attr(name: str):
    return lambda r: int(getattr(r, name))


# ------------------------------------------------------------------------------------------ softmax (Qwen, OLMoE)
def _softmax_select(r, logits):
    probs = F.softmax(logits, dim=-1, dtype=torch.float)
    return torch.topk(probs, r.top_k, dim=-1)[1]


def _softmax_weights(r, logits, idx):
    w = F.softmax(logits, dim=-1, dtype=torch.float).gather(-1, idx)
    if r.norm_topk_prob:
        w = w / w.sum(dim=-1, keepdim=True)
    return w.to(logits.dtype)


# --------------------------------------------------------------------------------------------------- Mixtral
def _mixtral_select(r, logits):
    return torch.topk(F.softmax(logits.float(), dim=-1), r.top_k, dim=-1)[1]


def _mixtral_weights(r, logits, idx):
    w = F.softmax(logits.float(), dim=-1).gather(-1, idx)
    return w / w.sum(dim=-1, keepdim=True)


# ----------------------------------------------------------------------------------------------- DeepSeek-V3
def _dsv3_select(r, logits):
    scores = logits.sigmoid() + r.e_score_correction_bias
    n, e = scores.shape
    group_scores = scores.view(n, r.num_group, e // r.num_group).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=r.topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(n, r.num_group, e // r.num_group).reshape(n, e)
    scores = scores.masked_fill(~score_mask.bool(), float("-inf"))
    return torch.topk(scores, k=r.top_k, dim=-1, sorted=False)[1]


def _dsv3_weights(r, logits, idx):
    w = logits.sigmoid().gather(1, idx)
    if r.norm_topk_prob:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return w * r.routed_scaling_factor


# --------------------------------------------------------------------------------------------------- GPT-OSS
def _gptoss_select(r, logits):
    return torch.topk(logits, r.top_k, dim=-1)[1]


def _gptoss_weights(r, logits, idx):
    v = logits.gather(-1, idx)
    return F.softmax(v, dim=1, dtype=v.dtype)


SOFTMAX = RouterAdapter("softmax", _softmax_select, _softmax_weights, _attr("num_experts"), _attr("top_k"))
MIXTRAL = RouterAdapter("mixtral", _mixtral_select, _mixtral_weights, _attr("num_experts"), _attr("top_k"))
DEEPSEEK_V3 = RouterAdapter("deepseek_v3", _dsv3_select, _dsv3_weights, _attr("num_experts"), _attr("top_k"))
GPT_OSS = RouterAdapter("gpt_oss", _gptoss_select, _gptoss_weights, _attr("num_experts"), _attr("top_k"))

#: Router class name -> adapter. Only classes whose forward was checked against the adapter are listed.
ROUTER_ADAPTERS: dict[str, RouterAdapter] = {
    "Qwen3MoeTopKRouter": SOFTMAX,
    "Qwen2MoeTopKRouter": SOFTMAX,
    "OlmoeTopKRouter": SOFTMAX,
    "MixtralTopKRouter": MIXTRAL,
    "MiniMaxTopKRouter": MIXTRAL,
    "DeepseekV3TopkRouter": DEEPSEEK_V3,
    "GptOssTopKRouter": GPT_OSS,
}


#: Router class name -> why its routes cannot be replayed (a design limit of the routing, not a missing adapter).
REFUSED_ROUTERS: dict[str, str] = {
    "DeepseekV4HashRouter": "hash routing: experts are a function of the token id, nothing to replay",
    "PhimoeTopKRouter": ("sparsemixer: experts are picked by a sequence of masked arg-maxes with a jitter threshold "
                         "and weighted by a straight-through estimator, not by a top-k over scores, so a forced "
                         "selection has no weight under the model's own rule"),
    "DogeCDMoE": ("product-key routing through a view that mixes tokens: the block's plain linear `router_gate` "
                  "logits [B, S, 2 * keys] are read as [2, B * S, keys], so a token's experts depend on other "
                  "tokens and a full forward routes otherwise than generate (transformers notes it is not causal)"),
}

#: Attribute names that hold E (routed experts) and K (experts per token) on routers, blocks or configs.
NUM_EXPERTS_ATTRS = ("num_router_classes", "n_routed_experts", "num_experts", "num_local_experts", "n_experts",
                     "moe_num_experts", "num_routed_experts", "expert_num")
TOP_K_ATTRS = ("top_k", "num_experts_per_tok", "top_k_experts", "topk", "moe_top_k", "moe_topk", "moe_k", "k")


def register_router_adapter(class_name: str, adapter: RouterAdapter) -> None:
    """Register an adapter for a router class (by class name). Test it reproduces the router bit-exactly."""
    if not isinstance(adapter, RouterAdapter):
        raise TypeError(f"adapter must be a RouterAdapter, got {type(adapter).__name__}")
    ROUTER_ADAPTERS[class_name] = adapter


def get_router_adapter(router: nn.Module) -> RouterAdapter:
    """The adapter for ``router``'s class; :class:`UnsupportedRouterError` naming the class when unknown."""
    name = type(router).__name__
    try:
        return ROUTER_ADAPTERS[name]
    except KeyError:
        raise UnsupportedRouterError(
            f"router class {name!r} is not supported for routing record/replay (supported: "
            f"{sorted(ROUTER_ADAPTERS)}); register one with register_router_adapter") from None
