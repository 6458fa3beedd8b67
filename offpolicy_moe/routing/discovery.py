"""Find the router modules of a Hugging Face MoE model, their blocks, decoder layers, E and K.

The router class is the one named by ``model._can_record_outputs["router_logits"]``, else modules named
``gate``/``router`` whose class looks like a router or has an adapter.  Refused classes (``REFUSED_ROUTERS``) are
skipped (a model with only those is refused with their reason); hash-routed layers beside top-k ones are left out.
"""
from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from typing import Sequence

from torch import nn

from .adapters import (NUM_EXPERTS_ATTRS, REFUSED_ROUTERS, ROUTER_ADAPTERS, TOP_K_ATTRS, RouterAdapter,
                       UnsupportedRouterError)

__all__ = ["Slot", "discover_slots", "hidden_size_of", "parse_layer_id"]

_ROUTER_NAME = re.compile(r"(Router|TopK|Topk|Gating|Gate)$|Router|TopkRouter")


@dataclass
class Slot:
    index: int  # MoE-layer index
    name: str
    router: nn.Module
    block: nn.Module
    adapter: RouterAdapter | None  # None: the generic rule (the router's own forward, top-k intercepted)
    layer_id: int
    scope: nn.Module | None = None  # generic rule: the module whose forward holds the top-k (router or block)
    num_experts: int = 0
    top_k: int = 0


def parse_layer_id(name: str) -> int:
    """The decoder-layer index in a module name (``model.layers.3.mlp.gate`` -> 3)."""
    m = re.findall(r"(?:layers|blocks|layer|h)\.(\d+)\.", name + ".")
    if not m:
        raise UnsupportedRouterError(f"cannot find the decoder-layer index in router module name {name!r}")
    return int(m[-1])


def _find_int(router: nn.Module, block: nn.Module, model: nn.Module, attrs: Sequence[str], cls: str,
              what: str) -> int:
    """The first integer attribute among ``attrs`` on the router, its block, then the model config."""
    cfg = getattr(model, "config", None)
    owners = [router, block, cfg, getattr(cfg, "text_config", None), getattr(cfg, "ffn_config", None)]
    for owner in owners:
        for a in attrs:
            v = getattr(owner, a, None) if owner is not None else None
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return int(v)
    raise UnsupportedRouterError(f"router class {cls!r}: cannot find its {what} (looked for {list(attrs)} on the "
                                 f"router, its block and the config)")


def _selects_in_forward(router: nn.Module) -> bool:
    """Whether the router's own forward (or a method it calls) runs the top-k, else its block does."""
    try:
        src = inspect.getsource(type(router))
    except (OSError, TypeError):
        return True
    return "topk" in src


def hidden_size_of(model: nn.Module, router: nn.Module) -> int:
    """Width of the router input: the config's ``hidden_size`` (text config for multimodal models), else the
    router's weight. Never assumes a ``.weight`` or ``.hidden_dim`` attribute."""
    cfg = getattr(model, "config", None)
    for c in (cfg, getattr(cfg, "text_config", None)):
        v = getattr(c, "hidden_size", None) if c is not None else None
        if isinstance(v, int) and v > 0:
            return v
    for p in router.parameters():
        if p.dim() == 2:
            return int(p.shape[1])
    raise UnsupportedRouterError(f"cannot tell the hidden size of router {type(router).__name__}")


def discover_slots(model: nn.Module) -> tuple[list[Slot], tuple[tuple[str, str], ...]]:
    """The replayable router slots of ``model`` (sorted by decoder layer) and the ``(module name, router class)`` of
    the routers skipped as hash-routed (their experts are a function of the token id: nothing to replay)."""
    names = dict(model.named_modules())
    target = None
    rec = getattr(model, "_can_record_outputs", None) or {}
    spec = rec.get("router_logits") if isinstance(rec, dict) else None
    if spec is not None:
        target = getattr(spec, "target_class", spec if isinstance(spec, type) else None)
    found = []
    if target is not None:
        found = [(n, m) for n, m in names.items() if isinstance(m, target)]
    if not found:  # no declared router class, or user code replaced the routers
        found = [(n, m) for n, m in names.items()
                 if type(m) is not nn.Linear and n.rsplit(".", 1)[-1] in ("gate", "router")
                 and _ROUTER_NAME.search(type(m).__name__)]
        found += [(n, m) for n, m in names.items() if type(m).__name__ in ROUTER_ADAPTERS
                  and (n, m) not in found]
    found += [(n, m) for n, m in names.items() if type(m).__name__ in REFUSED_ROUTERS and (n, m) not in found]
    if not found:
        raise ValueError(f"no MoE router found in {type(model).__name__}: a dense model has no routing to record "
                         f"or replay")
    slots = []
    refused = []
    for n, m in found:
        cls = type(m).__name__
        if cls in REFUSED_ROUTERS and cls not in ROUTER_ADAPTERS:
            refused.append((n, cls))
            continue
        parent = names[n.rsplit(".", 1)[0]] if "." in n else model
        adapter = ROUTER_ADAPTERS.get(cls)
        slot = Slot(len(slots), n, m, parent, adapter, parse_layer_id(n))
        if adapter is not None:
            slot.num_experts, slot.top_k = adapter.num_experts(m), adapter.top_k(m)
        else:
            slot.num_experts = _find_int(m, parent, model, NUM_EXPERTS_ATTRS, cls, "number of experts")
            slot.top_k = _find_int(m, parent, model, TOP_K_ATTRS, cls, "top-k")
            slot.scope = m if _selects_in_forward(m) else parent
        slots.append(slot)
    if not slots:
        cls = refused[0][1]
        raise UnsupportedRouterError(f"router class {cls!r} cannot be recorded or replayed: "
                                     f"{REFUSED_ROUTERS[cls]}")
    if any(c != "DeepseekV4HashRouter" for _, c in refused):
        n, cls = next((n, c) for n, c in refused if c != "DeepseekV4HashRouter")
        raise UnsupportedRouterError(f"router class {cls!r} ({n}) cannot be recorded or replayed: "
                                     f"{REFUSED_ROUTERS[cls]}")
    slots.sort(key=lambda s: s.layer_id)
    for i, s in enumerate(slots):
        s.index = i
    return slots, tuple(refused)
