"""Find the MoE causal-LM families of the installed transformers by scanning their modeling code for router modules.

A family is a ``model_type`` with a causal-LM class whose modeling module defines a router/gating class: a class
whose name ends in ``Router``/``Gate``/``Gating`` or contains ``TopK``/``Topk`` (forget gates, gated norms and
gated MLPs excluded) and whose forward (or a method it calls) selects experts.
"""
from __future__ import annotations

import importlib
import inspect
import re
from dataclasses import dataclass

import transformers

from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from .adapters import REFUSED_ROUTERS, ROUTER_ADAPTERS

__all__ = ["MoEFamily", "scan_moe_families", "describe_rule", "render_table"]

_ROUTER_CLASS = re.compile(r"(TopK|Topk|Router$|Gating$|Gate$)")
_NOT_ROUTER = re.compile(r"(Forget|Norm|MLP|Vision|Residual|DeltaNet|ACT)")


@dataclass(frozen=True)
class MoEFamily:
    """One MoE causal-LM family: its ``model_type``, causal-LM class name and router class names."""

    model_type: str
    causal_lm: str
    routers: tuple[str, ...]


def _router_classes(module) -> tuple[str, ...]:
    out = []
    for name, obj in vars(module).items():
        if not (isinstance(obj, type) and obj.__module__ == module.__name__):
            continue
        if not _ROUTER_CLASS.search(name) or _NOT_ROUTER.search(name):
            continue
        try:
            src = inspect.getsource(obj)
        except (OSError, TypeError):
            continue
        if name.endswith("Router") or re.search(r"topk|sparsemixer|tid2eid|top_k", src):
            out.append(name)
    if not out:  # an MoE block that routes with a plain linear gate (no router class): the block is the router
        out = [name for name, obj in vars(module).items() if isinstance(obj, type) and obj.__module__ ==
               module.__name__ and name in REFUSED_ROUTERS]
    return tuple(sorted(out))


def _modeling_module(causal_lm: str):
    """The modeling module of a causal-LM class name (aliases such as ``sarvam_moe -> Glm4MoeForCausalLM`` resolve
    to the class's own module); None when it cannot be imported here (an optional dependency)."""
    try:
        return importlib.import_module(getattr(transformers, causal_lm).__module__)
    except Exception:
        return None


def scan_moe_families() -> list[MoEFamily]:
    """Every causal-LM ``model_type`` of the installed transformers whose modeling code defines a router class (or
    an MoE block known to route without one).  A multimodal ``X`` with the same routers as its ``X_text`` is listed
    once, under ``X_text``; a type reusing another family's code under its own config class (``sarvam_moe``) is its
    own family (its config defaults differ)."""
    found: dict[str, MoEFamily] = {}
    for mt, cls in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()):
        mod = _modeling_module(cls)
        routers = _router_classes(mod) if mod is not None else ()
        if routers:
            found[mt] = MoEFamily(mt, cls, routers)
    return sorted((f for mt, f in found.items()
                   if not (f"{mt}_text" in found and found[f"{mt}_text"].routers == f.routers)),
                  key=lambda f: f.model_type)


_BIAS = re.compile(r"e_score_correction_bias|expert_bias|balancing_biases")
_GROUP = re.compile(r"topk_group|num_group|n_group|group_limited")


def describe_rule(router_cls: str, module) -> str:
    """How the controller handles ``router_cls`` of modeling ``module``: a registered adapter, a refusal, or the
    generic rule with the router's own steps read from its code (score function, selection bias, group limit...)."""
    if router_cls in ROUTER_ADAPTERS:
        return f"adapter `{ROUTER_ADAPTERS[router_cls].family}`"
    if router_cls in REFUSED_ROUTERS:
        return "refused: " + REFUSED_ROUTERS[router_cls].split(":")[0]
    src = inspect.getsource(getattr(module, router_cls))
    score = "sigmoid" if "sigmoid" in src else "softmax" if "softmax" in src else "logits"
    steps = [score]
    if _BIAS.search(src) or re.search(r"def forward\(self, hidden_states[^)]*bias", src):
        steps.append("selection bias")
    if _GROUP.search(src):
        steps.append("group-limited")
    if "moe_statics" in src:
        steps.append("moe_statics")
    if "norm_topk_prob" in src or "renormalize" in src or re.search(r"sum\(dim=-1, keepdim=True\)", src):
        steps.append("renormalised")
    if "routed_scaling_factor" in src:
        steps.append("scaled")
    if "topk" not in src:
        steps.append("top-k in the block")
    return "generic: " + ", ".join(steps)


def render_table() -> str:
    """The markdown table ``family -> router class -> rule`` of the installed transformers (docs/routing.md)."""
    lines = ["| family (`model_type`) | router class | rule |", "|---|---|---|"]
    for fam in scan_moe_families():
        mod = _modeling_module(fam.causal_lm)
        for cls in fam.routers:
            lines.append(f"| {fam.model_type} | `{cls}` | {describe_rule(cls, mod)} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(render_table(), end="")
