"""``generate`` under recording: beam search (reorders the KV cache), assisted / prompt-lookup decoding (feed
drafts and crop it) and ``use_cache=False`` (re-feeds everything) give routes that cannot be laid out like
``sequences``, so they are refused before anything runs.  The guard wraps ``model.generate`` as an instance
attribute and tells the open recorders the length of ``sequences``.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from .state import RoutingState

__all__ = ["UnsupportedGenerationError", "check_generate_kwargs", "GenerateGuard"]


class UnsupportedGenerationError(ValueError):
    """A generation mode whose routes cannot be recorded faithfully (beam search, assisted decoding, no cache)."""


def check_generate_kwargs(model: nn.Module, kwargs: dict) -> None:
    """Raise :class:`UnsupportedGenerationError` for generation modes whose routes cannot be recorded (see the module
    docstring); ``kwargs`` override the model's ``generation_config``."""
    gc = kwargs.get("generation_config") or getattr(model, "generation_config", None)

    def get(key, default=None):
        if key in kwargs:
            return kwargs[key]
        return getattr(gc, key, default) if gc is not None else default

    if (get("num_beams", 1) or 1) > 1:
        raise UnsupportedGenerationError(f"beam search (num_beams={get('num_beams')}) reorders the KV cache: "
                                         f"its routes cannot be recorded; use sampling or greedy decoding")
    if (get("num_beam_groups", 1) or 1) > 1:
        raise UnsupportedGenerationError("group beam search cannot be recorded")
    for key in ("assistant_model", "prompt_lookup_num_tokens", "assistant_early_exit"):
        if get(key) is not None:
            raise UnsupportedGenerationError(f"assisted decoding ({key}) feeds draft tokens and crops the cache: "
                                             f"its routes cannot be recorded")
    if get("use_cache", True) is False:
        raise UnsupportedGenerationError("use_cache=False re-feeds the whole sequence at every step; record with "
                                         "the KV cache on")
    if kwargs.get("custom_generate") is not None:
        raise UnsupportedGenerationError("custom_generate cannot be recorded faithfully")


class GenerateGuard:
    """Wraps ``model.generate`` while at least one guarded context is open (nested contexts share one wrapper)."""

    def __init__(self, model: nn.Module, state: RoutingState):
        self.model = model
        self.state = state
        self.users = 0

    @contextlib.contextmanager
    def __call__(self):
        model = self.model
        gen = getattr(model, "generate", None)
        wrap, had = gen is not None and self.users == 0, "generate" in model.__dict__
        if wrap:
            model.generate = self._guarded(gen)
        self.users += 1
        try:
            yield
        finally:
            self.users -= 1
            if wrap and had:
                model.generate = gen
            elif wrap:
                with contextlib.suppress(AttributeError):
                    del model.generate

    def _guarded(self, orig):
        state, model = self.state, self.model

        def guarded_generate(*args, **kwargs):
            check_generate_kwargs(model, kwargs)
            for r in state.recorders:
                if r.num_calls:
                    raise ValueError("this record() block already holds routes: use one record() block per generate")
            out = orig(*args, **kwargs)
            seq = out if isinstance(out, torch.Tensor) else getattr(out, "sequences", None)
            if seq is not None:
                for r in state.recorders:
                    r.final_len = int(seq.shape[1])
            return out
        return guarded_generate
