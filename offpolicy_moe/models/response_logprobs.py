"""Per-token log-probs of the response under a policy forward (with whatever routing context is open).

Logits are divided by the sampling temperature, and restricted to the engine's kept sets when it truncated
(:class:`~offpolicy_moe.models.kept_tokens.KeptTokens`), so the trainer describes the distribution the engine sampled
from.  Only the last ``T + 1`` positions' logits are produced (``logits_to_keep``).  A GRPO group's shared prompt is
computed once per distinct prompt, by packing (:mod:`offpolicy_moe.models.prompt_packing`) or by a prompt pass whose
KV cache the response pass reuses; a cost model (:mod:`offpolicy_moe.models.forward_plan`) picks per batch
(:func:`plan_shared_forward`).
"""
from __future__ import annotations

from typing import Optional

import torch

from transformers import DynamicCache

from offpolicy_moe.models.forward_plan import MODES, ForwardPlan, plan_forward
from offpolicy_moe.models.kept_tokens import KeptTokens
from offpolicy_moe.models.layout import accepts_kwarg, cache_kwarg, position_ids_from_mask, prompt_groups
from offpolicy_moe.models.prompt_packing import (DEFAULT_MAX_MASK_ELEMENTS, GroupPacking, plan_group_packing,
                                          takes_4d_mask)
from offpolicy_moe.models.token_logprobs import token_logprobs

__all__ = ["position_ids_from_mask", "prompt_groups", "response_logprobs", "plan_shared_forward", "token_logprobs"]

_SHARE_MODES = (False, True, "auto", "pack", "cache")


def _checkpointing(model: torch.nn.Module) -> bool:
    """Activation (gradient) checkpointing on?  (``is_activation_checkpointing`` in newer transformers.)"""
    name = "is_activation_checkpointing" if hasattr(type(model), "is_activation_checkpointing") \
        else "is_gradient_checkpointing"
    return bool(getattr(model, name, False))


def _can_share(model: torch.nn.Module) -> bool:
    return cache_kwarg(model) is not None and accepts_kwarg(model, "position_ids") \
        and not _checkpointing(model)


def _shared_prompt_logprobs(model: torch.nn.Module, base: torch.nn.Module, input_ids: torch.Tensor,
                            attention_mask: torch.Tensor, prompt_len: int, first: torch.Tensor,
                            inverse: torch.Tensor, temperature: float,
                            kept: Optional[KeptTokens] = None) -> torch.Tensor:
    """``[B, T]`` response log-probs: prompt pass on the distinct prompts (its last logits predict the first
    response token), cache repeated to the rows, response pass on tokens ``P .. P+T-2`` against it (the rest).  The
    two passes' logits go to :func:`token_logprobs` separately (never joined into one ``[B, T, V]`` copy), each with
    its columns of the kept sets ``kept``."""
    P = prompt_len
    pos = position_ids_from_mask(attention_mask)
    targets = input_ids[:, P:]
    cache = DynamicCache(config=getattr(base, "config", None))
    keep = {"logits_to_keep": 1} if accepts_kwarg(base, "logits_to_keep") else {}
    cache_arg = {cache_kwarg(base): cache}
    # the prompt pass goes to the unwrapped module (a DDP wrapper takes ONE forward per backward; the response pass
    # below is that forward, and its graph reaches the prompt pass's parameters through the cache)
    out = base(input_ids=input_ids[first, :P], attention_mask=attention_mask[first, :P], position_ids=pos[first, :P],
               use_cache=True, **cache_arg, **keep)
    T = input_ids.shape[1] - P
    first_lp = token_logprobs(out.logits[:, -1:].index_select(0, inverse), targets[:, :1], temperature,
                              kept=kept.narrow(0, 1) if kept is not None else None)
    if T == 1:
        return first_lp
    cache.batch_select_indices(inverse)
    out = model(input_ids=input_ids[:, P:-1], attention_mask=attention_mask[:, :-1], position_ids=pos[:, P:-1],
                use_cache=True, **cache_arg)
    rest = token_logprobs(out.logits, targets[:, 1:], temperature,
                          kept=kept.narrow(1, T) if kept is not None else None)
    return torch.cat([first_lp, rest], dim=1)


def plan_shared_forward(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                        prompt_len: int, share_prompt: bool | str = True, *, allowed: tuple = MODES,
                        max_mask_elements: int = DEFAULT_MAX_MASK_ELEMENTS, group_size: Optional[int] = None
                        ) -> tuple[ForwardPlan, Optional[GroupPacking]]:
    """Which forward runs this batch, ``(plan, packing)`` (``packing`` set when ``plan.mode == "pack"``).

    ``share_prompt``: False → plain; ``"pack"``/``"cache"`` → that way whenever it applies; True/``"auto"`` → the
    cost model's pick among the ways that apply: at least half of the rows repeat a prompt, the way is in ``allowed``
    and the model supports it (packing: a 4-D mask; the cache: a KV cache and no activation checkpointing).

    ``group_size``: decide from the shape of whole groups and pack rows of that many slots, so that a micro-batch
    holding part of a group runs as the whole batch does, with rows of the same width: its log-probs are then bit for
    bit those of the uncut batch (the width changes attention's float rounding)."""
    if share_prompt not in _SHARE_MODES:
        raise ValueError(f"share_prompt must be one of {_SHARE_MODES}, got {share_prompt!r}")
    base = model.module if hasattr(model, "module") else model   # DDP wrapper
    B, S = input_ids.shape
    if share_prompt is False or B == 0 or not 0 < prompt_len < S:
        return ForwardPlan("plain"), None
    ways = [m for m in ("pack", "cache") if m in allowed and share_prompt in (True, "auto", m)]
    if "pack" in ways and not takes_4d_mask(base):
        ways.remove("pack")
    if "cache" in ways and not _can_share(base):
        ways.remove("cache")
    first, inverse = prompt_groups(input_ids, attention_mask, prompt_len)
    if group_size is not None:     # the decision depends on (prompt, response, group) shapes only
        inverse = torch.arange(first.numel(), device=inverse.device).repeat_interleave(int(group_size))
        B = int(inverse.numel())
    if not ways or 2 * first.numel() > B:
        return ForwardPlan("plain"), None
    if share_prompt in ("pack", "cache"):
        plan, per_row = ForwardPlan(share_prompt), group_size
    else:
        plan = plan_forward(base.config, prompt_len, S - prompt_len - 1, inverse, ["plain", *ways],
                            max_mask_elements=max_mask_elements)
        per_row = plan.samples_per_row
    if plan.mode != "pack":
        return plan, None
    packing = plan_group_packing(input_ids, attention_mask, prompt_len, max_mask_elements=max_mask_elements,
                                 samples_per_row=per_row)
    return (plan, packing) if packing is not None else (ForwardPlan("plain", plan.costs), None)


def response_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      prompt_len: int, *, temperature: float = 1.0,
                      response_mask: Optional[torch.Tensor] = None, share_prompt: bool | str = False,
                      packing: Optional["GroupPacking"] = None, kept: Optional[KeptTokens] = None) -> torch.Tensor:
    """``[B, T]`` float32 log-probs of ``input_ids[:, prompt_len:]`` (0 where ``response_mask`` is 0):
    ``log π(x_{P+t} | x_{<P+t}) = z_{P-1+t}[x_{P+t}] / τ - logsumexp(z_{P-1+t} / τ)``.

    ``share_prompt``: see :func:`plan_shared_forward`; ``packing``: a layout planned by the caller (who re-laid out
    a replay trace the same way).  The values are the plain forward's up to float rounding.

    ``kept`` (``[B, T]``): the log-probs are those of the engine's truncated distribution,
    ``z_x / τ - logsumexp_{j in K_t}(z_j / τ)``, gradients through the renormalisation.  Refused in one line when its
    shape is not ``[B, T]`` or a token of ``response_mask`` has no kept set."""
    if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
        raise ValueError(f"input_ids {tuple(input_ids.shape)} and attention_mask {tuple(attention_mask.shape)} "
                         "must both be [B, S]")
    S = input_ids.shape[1]
    T = S - prompt_len
    if not 0 < prompt_len < S:
        raise ValueError(f"prompt_len must be in (0, {S}), got {prompt_len}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if share_prompt not in _SHARE_MODES:
        raise ValueError(f"share_prompt must be one of {_SHARE_MODES}, got {share_prompt!r}")
    if kept is not None:
        if kept.shape != (input_ids.shape[0], T):
            raise ValueError(f"kept sets {kept.shape} do not fit the batch's responses {(input_ids.shape[0], T)}")
        if response_mask is not None and bool(((kept.counts == 0) & response_mask.to(kept.counts.device).bool()).any()):
            raise ValueError("a response token has no kept set recorded although the batch carries kept sets "
                             "(the engine truncated its sampling distribution): the batch is inconsistent")
    base = model.module if hasattr(model, "module") else model   # DDP wrapper
    mode = "pack"
    if packing is None:
        plan, packing = plan_shared_forward(model, input_ids, attention_mask, prompt_len, share_prompt)
        mode = plan.mode
    if packing is not None:
        if packing.inverse.shape[0] != input_ids.shape[0] or packing.prompt_len != prompt_len \
                or packing.fed != T - 1:
            raise ValueError(f"packing was planned for {packing.inverse.shape[0]} rows, prompt_len "
                             f"{packing.prompt_len}, {packing.fed + 1} response positions; the batch has "
                             f"{input_ids.shape[0]}, {prompt_len}, {T}")
        dtype = next(base.parameters()).dtype
        out = model(input_ids=packing.input_ids, attention_mask=packing.attention_mask(dtype),
                    position_ids=packing.position_ids, use_cache=False)
        logp = packing.response_logprobs(out.logits, input_ids[:, prompt_len:], temperature, kept=kept)
    elif mode == "cache":
        first, inverse = prompt_groups(input_ids, attention_mask, prompt_len)
        logp = _shared_prompt_logprobs(model, base, input_ids, attention_mask, prompt_len, first, inverse,
                                       temperature, kept)
    else:
        kwargs = dict(input_ids=input_ids, attention_mask=attention_mask,
                      position_ids=position_ids_from_mask(attention_mask), use_cache=False)
        if accepts_kwarg(base, "logits_to_keep"):
            logits = model(**kwargs, logits_to_keep=T + 1).logits[:, :-1]
        else:
            logits = model(**kwargs).logits[:, prompt_len - 1:-1]
        logp = token_logprobs(logits, input_ids[:, prompt_len:], temperature, kept=kept)
    if response_mask is not None:
        logp = logp * response_mask.to(logp.dtype)
    return logp
