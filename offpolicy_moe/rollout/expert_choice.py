"""The experts a vLLM MoE layer chooses from its router logits, reproduced from the layer's own settings.

Where a kernel selects inside itself, the route recorder (:mod:`.vllm_worker`) chooses from the router logits, and
must choose exactly as the layer does, or the trainer would silently replay other experts.  Three ways: **top-k**
(the ``K`` largest logits); **with a correction bias** (DeepSeek-V3 and its copies: ``e_score_correction_bias``
added to sigmoid or softmax scores for the choice only); **group-limited** (DeepSeek-V2/V3: a group scores the sum
of its two best scores with a bias, its best score otherwise; the ``K`` best experts of the ``topk_group`` best
groups).  ``renormalize`` and ``routed_scaling_factor`` change the weights, never the ids; everything else is
refused by name in one line.

The rules were read in vLLM's routers (https://github.com/vllm-project/vllm/tree/main/vllm/model_executor/layers/
fused_moe/router: ``grouped_topk_router.py``, ``fused_topk_bias_router.py``, ``router_factory.py``) and its CPU path
(``fused_moe/cpu_fused_moe.py``); ``tests/rollout/test_expert_choice.py`` compares the ids with vLLM's own functions.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Optional

import torch

__all__ = ["ExpertRule", "KNOWN_ROUTERS", "SCORING", "choose_experts", "rule_of", "moe_layer_settings"]

#: scoring functions whose choice is reproduced
SCORING = ("softmax", "sigmoid")
#: vLLM's router classes whose choice is the top-k / biased / grouped rule above (the CPU path uses the same rules)
KNOWN_ROUTERS = ("FusedTopKRouter", "FusedTopKBiasRouter", "GroupedTopKRouter")

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class ExpertRule:
    """How one MoE layer chooses its ``top_k`` experts: ``scoring`` (``softmax`` | ``sigmoid``), ``groups`` /
    ``top_groups`` (``num_expert_group`` / ``topk_group``; 1 and 1: no grouping), whether it adds its correction
    bias, and ``refused``: why its choice cannot be reproduced ("" when it can)."""

    top_k: int
    scoring: str = "softmax"
    groups: int = 1
    top_groups: int = 1
    biased: bool = False
    refused: str = ""

    @property
    def grouped(self) -> bool:
        """Whether the choice is limited to the best groups (one group is no limit)."""
        return self.groups > 1


def choose_experts(logits: torch.Tensor, rule: ExpertRule, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``[N, K]`` ids of the experts ``rule`` chooses from router ``logits`` ``[N, E]`` (``bias``: the layer's
    ``e_score_correction_bias`` ``[E]``, read when ``rule.biased``); a ``ValueError`` with ``rule.refused`` when the
    layer's choice cannot be reproduced."""
    if rule.refused:
        raise ValueError(rule.refused)
    if rule.biased and bias is None:
        raise ValueError("the layer adds e_score_correction_bias to its scores, but it has none")
    if not rule.biased and not rule.grouped:
        return logits.topk(rule.top_k, dim=-1).indices          # softmax and sigmoid keep the logits' order
    x = logits.float()
    scores = torch.softmax(x, dim=-1) if rule.scoring == "softmax" else x.sigmoid()
    if rule.biased:
        scores = scores + bias.float()
    if rule.grouped:
        n, e = scores.shape
        per_group = scores.view(n, rule.groups, e // rule.groups)
        group_score = per_group.topk(2, dim=-1).values.sum(-1) if rule.biased else per_group.amax(-1)
        best = group_score.topk(rule.top_groups, dim=-1).indices
        keep = torch.zeros(n, rule.groups, dtype=torch.bool, device=scores.device).scatter_(1, best, True)
        scores = scores.masked_fill(~keep.repeat_interleave(e // rule.groups, dim=1), float("-inf"))
    return scores.topk(rule.top_k, dim=-1).indices


def rule_of(experts: Any, router: Any = None, family: str = "") -> ExpertRule:
    """The :class:`ExpertRule` of vLLM's routed-experts layer ``experts`` (``RoutedExperts``, or the older
    ``FusedMoE``: ``top_k``, ``scoring_func``, ``use_grouped_topk``, ``num_expert_group``, ``topk_group``,
    ``custom_routing_function``, ``e_score_correction_bias``) and its ``router`` object when it has one;
    ``family`` (the model class) names a refusal."""
    top_k = int(experts.top_k)
    scoring = str(getattr(experts, "scoring_func", "softmax"))
    who = f"{family or 'this model'}'s MoE layers"
    custom = getattr(experts, "custom_routing_function", None)
    if custom is not None:
        return ExpertRule(top_k, scoring, refused=f"{who} route with a custom function "
                                                  f"({getattr(custom, '__name__', type(custom).__name__)}) "
                                                  "whose choice the route recorder cannot reproduce")
    if scoring not in SCORING:
        return ExpertRule(top_k, scoring, refused=f"{who} score experts with {scoring!r}, whose choice the route "
                                                  f"recorder does not reproduce (only {', '.join(SCORING)})")
    kind = type(router).__name__ if router is not None else ""
    if router is not None and kind not in KNOWN_ROUTERS:
        return ExpertRule(top_k, scoring, refused=f"{who} choose experts with vLLM's {kind}, whose choice the route "
                                                  "recorder does not reproduce")
    if getattr(router, "hash_indices_table", None) is not None:
        return ExpertRule(top_k, scoring, refused=f"{who} choose experts by a hash of the token, which the route "
                                                  "recorder does not reproduce")
    grouped = bool(getattr(experts, "use_grouped_topk", False))
    groups = int(getattr(experts, "num_expert_group", None) or 1) if grouped else 1
    top_groups = int(getattr(experts, "topk_group", None) or 1) if grouped else 1
    biased = getattr(experts, "e_score_correction_bias", None) is not None
    return ExpertRule(top_k, scoring, groups=groups, top_groups=top_groups, biased=biased)


def moe_layer_settings(model: torch.nn.Module) -> dict[int, tuple[Any, Any]]:
    """``{decoder layer index: (routed-experts layer, its router or None)}`` of a vLLM model: the first module under
    ``layers.<i>.`` that carries the selection settings (``top_k`` and ``scoring_func``), and the ``router`` of
    the module that holds it (vLLM's ``MoERunner``)."""
    found: dict[int, tuple[Any, Any]] = {}
    routers: dict[int, Any] = {}
    for name, module in model.named_modules():
        m = _LAYER.search(name)
        if not m:
            continue
        i = int(m.group(1))
        router = getattr(module, "router", None)
        if router is not None and hasattr(router, "select_experts"):
            routers.setdefault(i, router)
        if i not in found and hasattr(module, "scoring_func") and hasattr(module, "top_k"):
            found[i] = (module, None)
    return {i: (experts, routers.get(i)) for i, (experts, _) in found.items()}
