"""Greedy decoding for evaluation, on the sampling loop's machinery.

``y_t = argmax_v z_t[v]`` for each prompt until ``eos`` or ``max_new_tokens``: the same tokens as ``model.generate``
with ``do_sample=False`` (the reference, :func:`offpolicy_moe.tasks.evaluation.greedy_completions`), without its
per-step machinery.  One prefill, then one forward per token over a KV cache allocated once
(:mod:`~offpolicy_moe.rollout.kv_cache`); finished rows leave the decode batch once a quarter of the rows fed have
finished, as in the engine's sampling loop (``generate`` keeps every row to the end, which costs about half of an
evaluation on the long-tailed task: docs/evaluation.md).

``generate`` stays the path for a model whose forward takes no KV cache or ``position_ids``, and for one whose
generation config asks for logits processors that change the argmax (a repetition penalty, banned or forced tokens,
a minimum length): their greedy answer is what ``generate`` computes, and this loop would silently differ.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from offpolicy_moe.models.layout import accepts_kwarg, cache_kwarg
from offpolicy_moe.rollout.decode_step import DecodeForward
from offpolicy_moe.rollout.kv_cache import preallocated_cache
from offpolicy_moe.tasks import decode_completions, encode_prompts
from offpolicy_moe.tasks.evaluation import greedy_completions as generate_greedy_completions

__all__ = ["greedy_completions", "runs_own_loop"]

#: generation-config fields whose non-default values make ``generate`` process the logits before its argmax
_PROCESSOR_FIELDS = {"repetition_penalty": (None, 1.0), "no_repeat_ngram_size": (None, 0), "bad_words_ids": (None,),
                     "min_length": (None, 0), "min_new_tokens": (None, 0), "suppress_tokens": (None,),
                     "begin_suppress_tokens": (None,), "forced_bos_token_id": (None,),
                     "forced_eos_token_id": (None,), "sequence_bias": (None,),
                     "encoder_repetition_penalty": (None, 1.0), "exponential_decay_length_penalty": (None,),
                     "renormalize_logits": (None, False), "logits_processor": (None,)}


def runs_own_loop(model: torch.nn.Module) -> bool:
    """Whether :func:`greedy_completions` decodes ``model`` with its own loop: its forward takes a KV cache and
    ``position_ids``, and its generation config (if any) sets none of the logits processors ``generate`` would
    apply before the argmax (module docstring)."""
    if cache_kwarg(model) is None or not accepts_kwarg(model, "position_ids"):
        return False
    gen_cfg = getattr(model, "generation_config", None)
    return gen_cfg is None or all(getattr(gen_cfg, name, None) in default
                                  for name, default in _PROCESSOR_FIELDS.items())


@torch.no_grad()
def greedy_completions(model: torch.nn.Module, tok: Any, prompts: Sequence[str], *, max_new_tokens: int = 6,
                       batch_size: int = 128, lean: bool = True) -> list[str]:
    """Greedy (argmax) completion of each prompt, decoded and cut at ``eos``: ``generate``'s greedy tokens (tested
    equal), by the loop of the module docstring where :func:`runs_own_loop`, else by ``generate``.  Prompts are
    encoded as ``bos + prompt`` and left-padded, ``batch_size`` at a time; ``lean``: decode steps through
    :class:`~offpolicy_moe.rollout.decode_step.DecodeForward` (``rollout.decode_forward``)."""
    if max_new_tokens < 1 or batch_size < 1:
        raise ValueError(f"max_new_tokens and batch_size must be >= 1, got {max_new_tokens}, {batch_size}")
    if not runs_own_loop(model):
        return generate_greedy_completions(model, tok, prompts, max_new_tokens=max_new_tokens, batch_size=batch_size)
    was_training = model.training
    model.eval()
    out: list[str] = []
    try:
        for start in range(0, len(prompts), batch_size):
            out.extend(_decode_batch(model, tok, list(prompts[start:start + batch_size]), max_new_tokens, lean))
    finally:
        model.train(was_training)
    return out


def _decode_batch(model: torch.nn.Module, tok: Any, prompts: list[str], max_new_tokens: int,
                  lean: bool = True) -> list[str]:
    """One left-padded batch through the greedy loop (module docstring); finished rows are padded."""
    device = next(model.parameters()).device
    ids, am = encode_prompts(tok, prompts)
    ids, am = ids.to(device), am.to(device)
    B, P = ids.shape
    cache = preallocated_cache(model.config, P + max_new_tokens)
    kw: dict[str, Any] = {cache_kwarg(model): cache, "use_cache": True}
    if accepts_kwarg(model, "logits_to_keep"):
        kw["logits_to_keep"] = 1
    pos = (am.long().cumsum(-1) - 1).masked_fill(am == 0, 1)
    logits = model(input_ids=ids, attention_mask=am, position_ids=pos, **kw).logits[:, -1, :]
    decode = DecodeForward(model, lean=lean)
    mask_buf = torch.cat([am, am.new_ones((B, max_new_tokens))], dim=1)      # mask[:, :P+t+1] at step t
    last_pos, fed = pos[:, -1:], torch.arange(B, device=device)               # fed: the rows still decoded
    tokens = torch.full((B, max_new_tokens), tok.pad_token_id, dtype=ids.dtype, device=device)
    unfinished = torch.ones(B, dtype=torch.bool, device=device)
    for t in range(max_new_tokens):
        alive = unfinished.index_select(0, fed)
        nxt = logits.argmax(-1).masked_fill(~alive, tok.pad_token_id)     # finished rows are fed pad, as generate
        tokens[fed, t] = nxt
        still = alive & (nxt != tok.eos_token_id)
        unfinished[fed] = still
        if t == max_new_tokens - 1 or not bool(still.any()):
            break
        if 4 * int(still.sum()) <= 3 * fed.numel():      # >= 1/4 of the fed rows finished: drop them
            keep = still.nonzero().flatten()
            cache.batch_select_indices(keep)
            mask_buf, last_pos, fed, nxt = mask_buf[keep], last_pos[keep], fed[keep], nxt[keep]
        last_pos = last_pos + 1
        logits = decode(nxt.unsqueeze(1), mask_buf[:, :P + t + 1], last_pos, cache)[:, -1, :]
    return decode_completions(tok, tokens)
