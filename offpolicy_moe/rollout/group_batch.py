"""Rollout batches from streamed samples: one group's finished samples as a :class:`RolloutBatch`
(:func:`group_batch`), and the groups a step trains as one batch (:func:`cat_batches`).

A streamed sample is sampled row by row (:mod:`~offpolicy_moe.rollout.slots`), so its tokens carry their own
versions, and its routes cover the positions it fed to the model.  Here they take the batch layout of
:mod:`~offpolicy_moe.rollout.batch`: prompts left-padded, responses right-padded after the end-of-sequence token.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F

from offpolicy_moe.rollout.batch import RolloutBatch
from offpolicy_moe.routing import RouteTrace, cat_traces
from offpolicy_moe.tasks import decode_completions

__all__ = ["group_batch", "cat_batches"]


def group_batch(samples: Sequence[Any], *, answer: str, group: int, tokenizer: Any,
                route_shape: Optional[Any] = None) -> RolloutBatch:
    """One group's finished samples (:class:`~offpolicy_moe.rollout.slots.FinishedSample`, in sample order) as a
    batch of ``G`` rows with ``group_ids = group``; ``version`` is the oldest token's version and ``generated_at``
    too (the version the group started from).  ``route_shape``: the engine's
    :class:`~offpolicy_moe.routing.state.ModelShape` when the samples carry routes."""
    if not samples:
        raise ValueError("group_batch needs at least one sample")
    pad = tokenizer.pad_token_id
    prompt = samples[0].prompt_ids
    for s in samples[1:]:
        if not torch.equal(s.prompt_ids, prompt):
            raise ValueError(f"group {group}: its samples answer different prompts")
    P = int(prompt.numel())
    T = max(int(s.response_ids.numel()) for s in samples)
    resp = torch.stack([F.pad(s.response_ids, (0, T - s.response_ids.numel()), value=pad) for s in samples])
    lengths = torch.tensor([int(s.response_ids.numel()) for s in samples])
    response_mask = (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)).long()
    behav = torch.stack([F.pad(s.behav_logp.float(), (0, T - s.behav_logp.numel())) for s in samples])
    versions = torch.stack([F.pad(s.versions.long(), (0, T - s.versions.numel()), value=int(s.versions[-1]))
                            for s in samples])
    ids = torch.cat([prompt.unsqueeze(0).expand(len(samples), P), resp], 1)
    attention_mask = torch.cat([torch.ones(len(samples), P, dtype=torch.long), response_mask], 1)
    routes = None
    if route_shape is not None and samples[0].routes is not None:
        raw = torch.stack([F.pad(s.routes.long(), (0, 0, 0, 0, 0, P + T - s.routes.shape[0]), value=-1)
                           for s in samples])
        recorded = (raw >= 0).all(-1).all(-1)
        routes = RouteTrace.from_ids(raw.clamp_min(0), route_shape.num_experts, route_shape.top_k,
                                     route_shape.layer_ids, recorded=recorded)
        routes = routes.with_tokens(torch.where(recorded, ids, torch.full_like(ids, -1)))
    oldest = int(versions[response_mask.bool()].min()) if bool(response_mask.any()) else int(versions.min())
    return RolloutBatch(input_ids=ids, attention_mask=attention_mask, response_mask=response_mask, behav_logp=behav,
                        group_ids=torch.full((len(samples),), int(group), dtype=torch.long),
                        answers=[answer] * len(samples), completions=decode_completions(tokenizer, resp),
                        prompt_len=P, version=oldest, generated_at=oldest, routes=routes, token_versions=versions)


def _widen(batch: RolloutBatch, prompt_len: int, response_len: int, pad: int) -> RolloutBatch:
    """``batch`` with its prompts left-padded to ``prompt_len`` and responses right-padded to ``response_len``."""
    left, right = prompt_len - batch.prompt_len, response_len - batch.response_len
    if left == 0 and right == 0:
        return batch
    routes = batch.routes
    if routes is not None:
        routes = routes.pad_to(routes.seq_len + left, "left").pad_to(routes.seq_len + left + right, "right")
    last_version = batch.token_versions[:, -1:] if batch.token_versions is not None else None
    return replace(batch,
                   input_ids=F.pad(batch.input_ids, (left, right), value=pad),
                   attention_mask=F.pad(batch.attention_mask, (left, right)),
                   response_mask=F.pad(batch.response_mask, (0, right)),
                   behav_logp=F.pad(batch.behav_logp, (0, right)),
                   token_versions=None if last_version is None else torch.cat(
                       [batch.token_versions, last_version.expand(-1, right)], 1),
                   routes=routes, prompt_len=prompt_len)


def cat_batches(batches: Sequence[RolloutBatch], pad: int) -> RolloutBatch:
    """The rows of ``batches`` as one batch (prompts left-padded and responses right-padded to the longest);
    ``version`` and ``generated_at`` are the oldest.  Batches are joined before preparation (no old log-probs).  Kept sets and PR2 features are not carried (a stream samples the
    full distribution and refuses PR2)."""
    if not batches:
        raise ValueError("cat_batches needs at least one batch")
    if any(b.old_logp is not None for b in batches):
        raise ValueError("cat_batches joins generated batches before their preparation (old log-probs present)")
    P = max(b.prompt_len for b in batches)
    T = max(b.response_len for b in batches)
    wide = [_widen(b, P, T, pad) for b in batches]
    routes = None
    if all(b.routes is not None for b in wide):
        routes = cat_traces([b.routes for b in wide])
    versions = None
    if all(b.token_versions is not None for b in wide):
        versions = torch.cat([b.token_versions for b in wide])
    return RolloutBatch(input_ids=torch.cat([b.input_ids for b in wide]),
                        attention_mask=torch.cat([b.attention_mask for b in wide]),
                        response_mask=torch.cat([b.response_mask for b in wide]),
                        behav_logp=torch.cat([b.behav_logp for b in wide]),
                        group_ids=torch.cat([b.group_ids for b in wide]),
                        answers=[a for b in wide for a in b.answers],
                        completions=[c for b in wide for c in b.completions], prompt_len=P,
                        version=min(b.version for b in wide), generated_at=min(b.generated_at for b in wide),
                        routes=routes, token_versions=versions)
