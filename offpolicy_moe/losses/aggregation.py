"""Reduce a per-token loss matrix to a scalar (docs/algorithms.md, "Loss aggregation").

Global counts: pass ``num_tokens`` (valid tokens) and ``num_seqs`` (sequences with at least one
valid token) counted over the WHOLE optimizer mini-batch, i.e. over every gradient-accumulation
micro-batch and every data-parallel rank.  Then each call returns that micro-batch's *share* of the
global loss, and the shares SUM to the whole-batch loss (and gradient).  Under DDP, which averages
gradients over ranks, multiply each rank's loss by the world size (or use a SUM all-reduce).
:func:`global_counts` computes the counts for a list of micro-batch masks, optionally all-reduced.
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from ._validate import (
    AGG_MODES,
    as_bool_mask,
    check_2d,
    check_agg,
    check_count,
    check_positive,
    check_same_shape,
    check_tensor,
)

Count = Union[int, float, torch.Tensor, None]


def _denominator(count: Count, local: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Global count if given, else the local one; never below 1 (an empty batch gives loss 0)."""
    if count is None:
        c = local
    elif isinstance(count, torch.Tensor):
        c = count.detach().to(device=like.device)
    else:
        c = torch.tensor(float(count), device=like.device)
    return c.to(like.dtype).clamp(min=1.0)


def aggregate(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token-mean",
    *,
    num_tokens: Count = None,
    num_seqs: Count = None,
    norm_length: Optional[float] = None,
) -> torch.Tensor:
    """Aggregate a per-token loss ``loss_mat`` [B, T] over the valid tokens of ``mask`` [B, T].

    Modes (m = mask, l = loss_mat, N_tok / N_seq = global counts if given, else local):

    * ``token-mean``: ``sum(m*l) / N_tok`` (DAPO, arXiv 2503.14476)
    * ``seq-mean-token-mean``: ``sum_i [sum_t m*l / sum_t m] / N_seq`` (GRPO, arXiv 2402.03300)
    * ``seq-mean-token-sum``: ``sum_i sum_t m*l / N_seq``
    * ``seq-mean-token-sum-norm``: ``sum(m*l) / (N_seq * L_norm)`` (Dr. GRPO, arXiv 2503.20783);
      ``L_norm = norm_length`` (default: the padded length ``T``; pass the max response length so
      that differently padded micro-batches agree).

    ``N_seq`` counts only sequences with at least one valid token.  Masked positions are replaced
    by 0 (never multiplied), so NaN/Inf there cannot leak; an all-masked batch gives 0 with a zero
    gradient.  A numeric count must be finite and >= 0; 0-d tensor counts are checked by the objectives.
    """
    check_tensor("loss_mat", loss_mat)
    check_tensor("mask", mask)
    check_2d("loss_mat", loss_mat)
    check_same_shape("loss_mat", loss_mat, "mask", mask)
    check_agg(mode)
    check_count("num_tokens", num_tokens)
    check_count("num_seqs", num_seqs)
    if norm_length is not None:
        check_positive("norm_length", norm_length)
    m = as_bool_mask(mask)
    masked = torch.where(m, loss_mat, torch.zeros((), dtype=loss_mat.dtype, device=loss_mat.device))
    if mode == "token-mean":
        denom = _denominator(num_tokens, m.sum(), loss_mat)
        return masked.sum() / denom
    tok_per_seq = m.sum(-1)
    n_seq = _denominator(num_seqs, (tok_per_seq > 0).sum(), loss_mat)
    if mode == "seq-mean-token-mean":
        per_seq = masked.sum(-1) / tok_per_seq.clamp(min=1).to(loss_mat.dtype)
        return per_seq.sum() / n_seq
    if mode == "seq-mean-token-sum":
        return masked.sum() / n_seq
    length = float(norm_length) if norm_length is not None else float(loss_mat.shape[-1])
    return masked.sum() / (n_seq * max(length, 1.0))


def global_counts(
    masks: Union[torch.Tensor, Sequence[torch.Tensor]],
    process_group: object = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(num_tokens, num_seqs)`` over one mask or a list of micro-batch masks, as 0-d int64 tensors; with
    ``process_group`` they are SUM-all-reduced, so every rank gets the global counts."""
    ms = [masks] if isinstance(masks, torch.Tensor) else list(masks)
    if not ms:
        raise ValueError("global_counts needs at least one mask")
    tokens = torch.zeros((), dtype=torch.int64, device=ms[0].device)
    seqs = torch.zeros((), dtype=torch.int64, device=ms[0].device)
    for mk in ms:
        check_2d("mask", mk)
        b = as_bool_mask(mk)
        tokens = tokens + b.sum()
        seqs = seqs + b.any(-1).sum()
    if process_group is not None:
        import torch.distributed as dist

        both = torch.stack([tokens, seqs])
        dist.all_reduce(both, op=dist.ReduceOp.SUM, group=process_group)
        tokens, seqs = both[0], both[1]
    return tokens, seqs


__all__ = ["AGG_MODES", "aggregate", "global_counts"]
