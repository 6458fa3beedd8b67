"""Per-token log-probs of the response under a policy forward (with whatever routing context is open).

For a sequence ``x`` of prompt length ``P`` and response length ``T`` the log-prob of response token ``t`` is
``log softmax(z_{P-1+t} / temperature)[x_{P+t}]`` where ``z_j`` are the logits at position ``j``.  Dividing by the
sampling temperature makes the trainer's distribution the same one the engine sampled from (top-p truncation is
not applied on the trainer side, as in verl/TRL; keep ``top_p = 1`` for an exact match).

Memory: only the ``T + 1`` last positions' logits are produced (``logits_to_keep``), and the log-prob is
``z[x] - logsumexp(z)``, which never materialises a second ``[B, T, V]`` log-softmax tensor.
"""
from __future__ import annotations

import inspect
from typing import Optional

import torch

__all__ = ["position_ids_from_mask", "response_logprobs"]


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position of each token counting only real tokens (left padding gets position 0), as ``generate`` does."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def _accepts_logits_to_keep(model: torch.nn.Module) -> bool:
    fwd = getattr(model, "forward", None)
    try:
        return "logits_to_keep" in inspect.signature(fwd).parameters
    except (TypeError, ValueError):
        return False


def response_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      prompt_len: int, *, temperature: float = 1.0,
                      response_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``[B, T]`` float32 log-probs of ``input_ids[:, prompt_len:]`` (0 where ``response_mask`` is 0)."""
    if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
        raise ValueError(f"input_ids {tuple(input_ids.shape)} and attention_mask {tuple(attention_mask.shape)} "
                         "must both be [B, S]")
    S = input_ids.shape[1]
    T = S - prompt_len
    if not 0 < prompt_len < S:
        raise ValueError(f"prompt_len must be in (0, {S}), got {prompt_len}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    kwargs = dict(input_ids=input_ids, attention_mask=attention_mask,
                  position_ids=position_ids_from_mask(attention_mask), use_cache=False)
    base = model.module if hasattr(model, "module") else model   # DDP wrapper
    if _accepts_logits_to_keep(base):
        logits = model(**kwargs, logits_to_keep=T + 1).logits[:, :-1]
    else:
        logits = model(**kwargs).logits[:, prompt_len - 1:-1]
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    targets = input_ids[:, prompt_len:]
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    if response_mask is not None:
        logp = logp * response_mask.to(logp.dtype)
    return logp
