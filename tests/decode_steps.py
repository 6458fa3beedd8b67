"""Shared test helper: next-token logits of a prefill and a few greedy one-token decode steps against a KV cache."""
from __future__ import annotations

import torch


def decode_logits(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, steps: int = 2) -> torch.Tensor:
    """``[B, 1 + steps, V]``: the last position's logits after the prefill of ``ids`` (left padding in ``mask``), then
    after each of ``steps`` greedy tokens fed one at a time with the model's own cache."""
    pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
    outs = []
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)   # the family's own cache
        outs.append(out.logits[:, -1])
        for _ in range(steps):
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], 1)
            pos = pos[:, -1:] + 1
            out = model(input_ids=nxt, attention_mask=mask, position_ids=pos, past_key_values=out.past_key_values,
                        use_cache=True)
            outs.append(out.logits[:, -1])
    return torch.stack(outs, 1)
