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

from transformers.models.auto.configuration_auto import model_type_to_module_name
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

__all__ = ["MoEFamily", "scan_moe_families"]

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
    return tuple(sorted(out))


def scan_moe_families() -> list[MoEFamily]:
    """Every causal-LM ``model_type`` of the installed transformers whose modeling code defines a router class.

    Model types that share router classes (a multimodal type and its text type) are listed once, under the
    text type when there is one."""
    by_cls: dict[tuple[str, ...], MoEFamily] = {}
    for mt, cls in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()):
        sub = model_type_to_module_name(mt)
        try:
            mod = importlib.import_module(f"transformers.models.{sub}.modeling_{sub}")
        except Exception:  # a modeling module that needs an optional dependency: not scannable here
            continue
        routers = _router_classes(mod)
        if not routers:
            continue
        fam = MoEFamily(mt, cls, routers)
        prev = by_cls.get(routers)
        if prev is None or mt.endswith("_text"):
            by_cls[routers] = fam
    return sorted(by_cls.values(), key=lambda f: f.model_type)
