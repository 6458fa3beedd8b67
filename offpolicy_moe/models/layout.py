"""Batch-layout helpers shared by the trainer's log-prob forwards, group packing and the rollout engine."""
from __future__ import annotations

import functools
import inspect

import torch

__all__ = ["accepts_kwarg", "cache_kwarg", "position_ids_from_mask", "prompt_groups"]


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position of each token counting only real tokens (left padding gets position 0), as ``generate`` does:
    ``pos[b, j] = max(0, sum_{i <= j} mask[b, i] - 1)``."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def prompt_groups(input_ids: torch.Tensor, attention_mask: torch.Tensor,
                  prompt_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows with the same prompt: ``(first [U], inverse [B])`` with ``first[u]`` the first row holding distinct
    prompt ``u`` and ``inverse[b]`` the distinct prompt of row ``b``, so ``prompt[first][inverse] == prompt``.
    Two prompts are the same when their masks and their ids on unmasked positions are equal (pad ids ignored)."""
    am = attention_mask[:, :prompt_len].long()
    key = torch.cat([input_ids[:, :prompt_len].long() * am, am], dim=1)
    _, inverse = torch.unique(key, dim=0, return_inverse=True)
    B = input_ids.shape[0]
    U = int(inverse.max()) + 1 if B else 0
    rows = torch.arange(B, device=inverse.device)
    first = torch.full((U,), B, dtype=torch.long, device=inverse.device).scatter_reduce(
        0, inverse, rows, reduce="amin", include_self=True)
    return first, inverse


@functools.lru_cache(maxsize=64)
def forward_params(cls: type) -> frozenset:
    """The parameter names of ``cls.forward`` (empty when it has no readable signature), read once per class."""
    try:
        return frozenset(inspect.signature(cls.forward).parameters)
    except (TypeError, ValueError, AttributeError):
        return frozenset()


def accepts_kwarg(model: torch.nn.Module, name: str) -> bool:
    """True when ``type(model).forward`` has a parameter ``name`` (the signature is read once per class:
    ``inspect.signature`` costs ~0.3 ms a call, too much for a per-forward check)."""
    return name in forward_params(type(model))


CACHE_KWARGS = ("cache", "past_key_values")     # transformers >= 5.24 names it ``cache``; earlier 5.x ``past_key_values``


def cache_kwarg(model: torch.nn.Module) -> str | None:
    """The name under which ``type(model).forward`` takes a KV cache (``cache`` from transformers 5.24,
    ``past_key_values`` before, no longer in the newer signatures), or None when it takes none."""
    params = forward_params(type(model))
    return next((name for name in CACHE_KWARGS if name in params), None)
