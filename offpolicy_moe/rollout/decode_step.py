"""One decode forward without transformers' per-call machinery, for the families whose layer code it mirrors.

A decode step feeds one token per row against the KV cache.  At the embedded model's sizes about 70% of such a
forward is Python (docs/benchmarks.md, "Where a decode forward's time goes"): argument merging, output capture and
deprecation wrappers on every module, a 4-D mask built from the 2-D one, output dataclasses.  :class:`DecodeForward`
runs the same arithmetic in the same order, calling the same submodules::

    h = embed(x);  (cos, sin) = rope(h, pos)
    per layer:  a = o_proj(attn(rope(q_norm(q_proj(n1(h)))), rope(k_norm(k_proj(n1(h)))), v_proj(n1(h))))
                h = h + a;  h = h + mlp(n2(h))
    logits = lm_head(norm(h))

with the cache written through ``cache.update`` and attention through the model's own attention function with the
same arguments.  The single-query decode kernel (:mod:`~offpolicy_moe.rollout.decode_attention`) is fed the padding
mask ``m[b, 0, 0, j] = mask2d[b, j]`` (at a decode step the causal part allows every cached column, and the kernel
only masks); any other implementation gets the mask transformers' decoder builds.  Its logits are bit-identical to
``model(...)``'s (tested in float32 and bfloat16, over left padding, dropped rows and the stream's shared cache).

It runs only where that identity is known: the model's causal-LM, decoder, layer and attention classes are those of
:data:`LEAN_FAMILIES` with their own ``forward`` (a subclass that overrides one is not), no sliding window, no hooks
on the modules it bypasses (hooks on the norms, the MoE block, its router and experts fire as usual; the causal LM's
pre-hooks are run with the call's arguments, as ``__call__`` runs them), gradients off, eval mode, one token per
row, and a 2-D mask as wide as the cache after the step.  The classes are checked again whenever a bypassed module
is replaced (an adapter, a patch).  Anything else is ``model(...)`` unchanged.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch.nn.modules import module as nn_module
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from offpolicy_moe.models.layout import cache_kwarg
from offpolicy_moe.rollout.decode_attention import NAME as SINGLE_QUERY

__all__ = ["DecodeForward", "LEAN_FAMILIES", "LeanFamily", "lean_refusal"]


@dataclass(frozen=True)
class LeanFamily:
    """Where a family's classes live and their names: the causal LM, the decoder (``causal_lm.model``), its layers
    and their ``self_attn``; ``rotary`` names the module-level ``apply_rotary_pos_emb`` the attention calls."""
    module: str
    causal_lm: str
    decoder: str
    layer: str
    attention: str
    rotary: str = "apply_rotary_pos_emb"
    mask: str = "create_causal_mask"
    eager: str = "eager_attention_forward"


#: families whose decode forward :class:`DecodeForward` mirrors (module docstring), keyed by ``config.model_type``
LEAN_FAMILIES: dict[str, LeanFamily] = {
    "qwen3_moe": LeanFamily("transformers.models.qwen3_moe.modeling_qwen3_moe", "Qwen3MoeForCausalLM",
                            "Qwen3MoeModel", "Qwen3MoeDecoderLayer", "Qwen3MoeAttention"),
}


def _exactly(obj: Any, cls: type) -> bool:
    """``obj`` is an instance of ``cls`` itself (not of a subclass, whose forward may differ)."""
    return type(obj) is cls


def lean_refusal(model: torch.nn.Module) -> Optional[str]:
    """Why :class:`DecodeForward` cannot run ``model`` lean (one line), or None when it can.  Static conditions
    only; per call it also needs no hooks on the bypassed modules, gradients off, eval mode and one token per row."""
    config = getattr(model, "config", None)
    family = LEAN_FAMILIES.get(getattr(config, "model_type", None))
    if family is None:
        return f"model_type {getattr(config, 'model_type', None)!r} is not one of {sorted(LEAN_FAMILIES)}"
    mod = importlib.import_module(family.module)
    decoder = getattr(model, "model", None)
    layers = list(getattr(decoder, "layers", ()))
    if not _exactly(model, getattr(mod, family.causal_lm)) or not _exactly(decoder, getattr(mod, family.decoder)):
        return f"{type(model).__name__} / {type(decoder).__name__} are not {family.causal_lm} / {family.decoder}"
    if not layers or not all(_exactly(l, getattr(mod, family.layer)) for l in layers) or \
            not all(_exactly(l.self_attn, getattr(mod, family.attention)) for l in layers):
        return f"the layers are not {family.layer} with {family.attention}"
    if getattr(config, "sliding_window", None) is not None:
        return f"sliding_window={config.sliding_window} (a windowed mask)"
    if len(layers) != config.num_hidden_layers:
        return f"{len(layers)} layers against config.num_hidden_layers={config.num_hidden_layers}"
    return None


class DecodeForward:
    """``step(input_ids [B, 1], attention_mask [B, L], position_ids [B, 1], cache) -> logits [B, 1, V]``: the lean
    forward of the module docstring where it applies, else ``model(...)`` (``lean=False``: always the latter)."""

    def __init__(self, model: torch.nn.Module, *, lean: bool = True):
        self.model = model
        self.cache_kwarg = cache_kwarg(model)
        self.wanted = bool(lean)
        self.lean_calls = self.model_calls = 0      # which path each call took (tests, benchmarks)
        self._check()

    def _structure(self) -> tuple:
        """The modules the lean forward bypasses: the decoder, its layers and their attention (empty for a model
        without them)."""
        decoder = getattr(self.model, "model", None)
        layers = tuple(getattr(decoder, "layers", ()))
        return (decoder, *layers, *(getattr(l, "self_attn", None) for l in layers))

    def _check(self) -> None:
        """The static conditions (:func:`lean_refusal`), read again whenever a bypassed module was replaced."""
        self.refusal = lean_refusal(self.model) if self.wanted else "rollout.decode_forward=model"
        self.lean = self.refusal is None
        self._bypassed = self._structure()
        if self.lean:
            family = LEAN_FAMILIES[self.model.config.model_type]
            mod = importlib.import_module(family.module)
            self._rope, self._mask, self._eager = (getattr(mod, family.rotary), getattr(mod, family.mask),
                                                   getattr(mod, family.eager))

    def _runs_lean(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor], cache: Any) -> bool:
        if self.wanted:
            now = self._structure()
            if len(now) != len(self._bypassed) or any(a is not b for a, b in zip(now, self._bypassed)):
                self._check()           # a layer or an attention module was swapped since (an adapter, a patch)
        if not self.lean or torch.is_grad_enabled() or self.model.training or input_ids.shape[1] != 1:
            return False
        if attention_mask is not None and tuple(attention_mask.shape) != (input_ids.shape[0],
                                                                           cache.get_seq_length() + 1):
            return False        # a mask not of the cache's width: transformers' own handling of it, unchanged
        if nn_module._global_forward_pre_hooks or nn_module._global_forward_hooks or self.model._forward_hooks:
            return False
        return not any(m._forward_pre_hooks or m._forward_hooks for m in self._bypassed)

    def __call__(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor],
                 position_ids: torch.Tensor, cache: Any) -> torch.Tensor:
        kw = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
              self.cache_kwarg: cache, "use_cache": True}
        if not self._runs_lean(input_ids, attention_mask, cache):
            self.model_calls += 1
            return self.model(**kw).logits
        for hook_id, hook in self.model._forward_pre_hooks.items():     # as Module.__call__ runs them
            if hook_id in self.model._forward_pre_hooks_with_kwargs:
                out = hook(self.model, (), kw)
                if out is not None:
                    _, kw = out
            elif hook(self.model, ()) is not None:
                raise RuntimeError("a positional pre-hook on the rollout model replaced its (keyword) inputs")
        self.lean_calls += 1
        return self._forward(kw["input_ids"], kw["attention_mask"], kw["position_ids"], kw[self.cache_kwarg])

    def _forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor],
                 position_ids: torch.Tensor, cache: Any) -> torch.Tensor:
        decoder = self.model.model
        h = decoder.embed_tokens(input_ids)
        cos, sin = decoder.rotary_emb(h, position_ids)
        impl = self.model.config._attn_implementation
        if impl == SINGLE_QUERY:
            mask = None if attention_mask is None else attention_mask.bool()[:, None, None, :]
        else:
            mask = self._mask(config=self.model.config, inputs_embeds=h, attention_mask=attention_mask, cache=cache,
                              position_ids=position_ids)
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(impl, self._eager)
        passed = {"position_ids": position_ids, "use_cache": True}    # what a decoder layer hands its attention on
        B = h.shape[0]
        for layer in decoder.layers:
            attn = layer.self_attn
            residual = h
            x = layer.input_layernorm(h)
            shape = (B, 1, -1, attn.head_dim)
            q = attn.q_norm(attn.q_proj(x).view(shape)).transpose(1, 2)
            k = attn.k_norm(attn.k_proj(x).view(shape)).transpose(1, 2)
            v = attn.v_proj(x).view(shape).transpose(1, 2)
            q, k = self._rope(q, k, cos, sin)
            k, v = cache.update(k, v, attn.layer_idx, kwargs=passed)
            a, _ = attention(attn, q, k, v, mask, dropout=0.0, scaling=attn.scaling, sliding_window=attn.sliding_window,
                             **passed)
            h = residual + attn.o_proj(a.reshape(B, 1, -1).contiguous())
            residual = h
            h = residual + layer.mlp(layer.post_attention_layernorm(h))
        return self.model.lm_head(decoder.norm(h))
