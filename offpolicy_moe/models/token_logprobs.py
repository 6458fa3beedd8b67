"""Per-token log-probs from logits, ``log softmax(z / τ)[x] = z[x] / τ - logsumexp(z / τ)``, without a
whole-vocabulary float32 copy: over blocks of positions, and under autograd with a backward that recomputes each
block's softmax from the logits as they came (:func:`token_logprobs`).  With the engine's kept sets ``K``
(top-k / top-p, :class:`~offpolicy_moe.models.kept_tokens.KeptTokens`) the softmax is restricted to them and
renormalised: ``z[x] / τ - logsumexp_{j in K}(z_j / τ)``."""
from __future__ import annotations

import math
from typing import Optional

import torch

from offpolicy_moe.models.kept_tokens import KeptTokens

__all__ = ["token_logprobs", "CPU_LOGPROB_BLOCK", "ACCELERATOR_LOGPROB_BLOCK"]

# logits handled per block of token_logprobs: the float32 copy, the temperature division and logsumexp's exp
# temporary exist for one block at a time, never for the whole [B, T, V] tensor.  CPU: 2^20 float32 (4 MiB) was
# the fastest block on the 2-core machine (32 x 257 x 32k logits without gradient: 0.26 s at 2^20, 0.27-0.29 s at
# 2^18 and 2^22, 0.68 s at 2^24 and above or in one piece; experiments/bench/bench_no_grad_pass.py --blocks,
# docs/benchmarks.md); on an accelerator, 2^26 (256 MiB) keeps the number of kernel launches small (not measured).
CPU_LOGPROB_BLOCK = 1 << 20
ACCELERATOR_LOGPROB_BLOCK = 1 << 26


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, *,
                   block_elements: Optional[int] = None, kept: Optional[KeptTokens] = None) -> torch.Tensor:
    """``[B, T]`` float32 (float64 for float64 logits) ``z[x] / τ - logsumexp(z / τ)`` of logits
    ``z [B, T, V]`` at ``targets [B, T]``, over blocks of at most ``block_elements`` logits (default
    :data:`CPU_LOGPROB_BLOCK` on the CPU, :data:`ACCELERATOR_LOGPROB_BLOCK` elsewhere): a whole-tensor float32 copy
    would be as large as the logits (128 x 256 positions, V = 32k: 4.3 GB).  The backward recomputes each block's
    softmax from the logits, ``d/dz_j = g (1[j = x] - softmax(z / τ)_j) / τ``, into one gradient tensor: nothing but
    the logits and one float per position is kept.

    ``kept``: the engine's kept set ``K_{b,t}`` of every position (count 0: the whole vocabulary); the log-prob is then
    the truncated, renormalised one, ``z[x] / τ - logsumexp_{j in K}(z_j / τ)`` (Holtzman et al. 2019, arXiv
    1904.09751), gradient ``g (1[j = x] - softmax_K(z / τ)_j) / τ`` on ``K`` and 0 outside (the choice of ``K`` is not
    differentiated); finite in any dtype, since ``x`` is always in ``K``.

    Refuses (``ValueError``) logits that are not ``[B, T, V]`` floats, targets of another shape or out of ``[0, V)``,
    a temperature that is not finite and positive, kept sets that do not fit, a target outside its kept set."""
    if logits.dim() != 3 or not logits.is_floating_point():
        raise ValueError(f"token_logprobs: logits must be a float [B, T, V] tensor, got {logits.dtype} "
                         f"{tuple(logits.shape)}")
    if tuple(targets.shape) != tuple(logits.shape[:2]) or targets.is_floating_point() or targets.is_complex():
        raise ValueError(f"token_logprobs: targets must be integer ids shaped [B, T] = {tuple(logits.shape[:2])}, "
                         f"got {targets.dtype} {tuple(targets.shape)}")
    if not (temperature > 0 and math.isfinite(temperature)):
        raise ValueError(f"token_logprobs: temperature must be finite and > 0, got {temperature}")
    if block_elements is None:
        block_elements = CPU_LOGPROB_BLOCK if logits.device.type == "cpu" else ACCELERATOR_LOGPROB_BLOCK
    if block_elements < 1:
        raise ValueError(f"token_logprobs: block_elements must be >= 1, got {block_elements}")
    if targets.numel():
        lo, hi = torch.stack([targets.min(), targets.max()]).tolist()     # one host sync
        if lo < 0 or hi >= logits.shape[-1]:
            raise ValueError(f"token_logprobs: target ids must be in [0, {logits.shape[-1]}) (the logits' "
                             f"vocabulary), got ids from {lo} to {hi}")
    if kept is not None:
        kept = kept.to(logits.device) if kept.counts.device != logits.device else kept
        _check_kept(kept, logits, targets)
    if logits.requires_grad and torch.is_grad_enabled():
        return _BlockedLogprob.apply(logits, targets, float(temperature), int(block_elements), kept)
    return _forward(logits, targets, float(temperature), int(block_elements), kept)[0]


def _check_kept(kept: KeptTokens, logits: torch.Tensor, targets: torch.Tensor) -> None:
    """One-line ``ValueError`` when ``kept`` does not fit the logits or a target lies outside its kept set."""
    if kept.shape != tuple(targets.shape) or kept.vocab_size != logits.shape[-1]:
        raise ValueError(f"token_logprobs: kept sets {kept.shape} over {kept.vocab_size} tokens do not fit logits "
                         f"{tuple(logits.shape)}")
    inside = kept.contains(targets)
    if not bool(inside.all()):
        b, t = (~inside).nonzero()[0].tolist()
        raise ValueError(f"token_logprobs: token {int(targets[b, t])} at (row {b}, position {t}) is outside its "
                         f"kept set of {int(kept.counts[b, t])} ids: the kept sets do not belong to these tokens")


def _blocks(shape: torch.Size, block_elements: int) -> list[tuple[slice, slice]]:
    """``(rows, positions)`` slices covering ``[B, T, V]`` in blocks of at most ``block_elements`` logits (whole
    rows when a row fits, else runs of one row's positions; at least one position)."""
    B, T, V = shape
    per_row = max(1, T * V)
    if per_row <= block_elements:
        step = max(1, block_elements // per_row)
        return [(slice(b, b + step), slice(0, T)) for b in range(0, B, step)]
    step = max(1, block_elements // max(1, V))
    return [(slice(b, b + 1), slice(t, t + step)) for b in range(B) for t in range(0, T, step)]


def _compute_dtype(logits: torch.Tensor) -> torch.dtype:
    return torch.promote_types(logits.dtype, torch.float32)


def _forward(logits: torch.Tensor, targets: torch.Tensor, temperature: float, block_elements: int,
             kept: Optional[KeptTokens] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log-probs, lse)`` ``[B, T]`` in the compute dtype, ``lse = logsumexp(z / τ)`` (over each position's kept
    set when ``kept`` is given, :func:`_kept_logsumexp`), block by block."""
    B, T, _ = logits.shape
    dtype = _compute_dtype(logits)
    out = torch.empty(B, T, dtype=dtype, device=logits.device)
    lse = torch.empty(B, T, dtype=dtype, device=logits.device)
    for rows, pos in _blocks(logits.shape, block_elements):
        z = logits[rows, pos]
        z = z.to(dtype) / temperature if temperature != 1.0 else z.to(dtype)
        if kept is None:
            l_blk = torch.logsumexp(z, dim=-1)
        else:
            l_blk = _kept_logsumexp(z, kept.indicator(rows, pos, dtype))
        lse[rows, pos] = l_blk
        out[rows, pos] = z.gather(-1, targets[rows, pos].unsqueeze(-1)).squeeze(-1) - l_blk
    return out, lse


def _kept_logsumexp(z: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``logsumexp`` over the kept tokens (``keep``: 1 kept, 0 not) of one block: ``c + log sum_j keep_j exp(z_j -
    c)`` with ``c`` the row maximum, so every exponent is at most 0 (no overflow, and no slow CPU ``exp`` of huge
    negative mask values).  Positions whose kept sum falls below ``tiny ** 0.5`` (underflow or lost digits) are redone
    exactly, ``logsumexp`` of ``z`` with the others at ``-inf``."""
    c = z.amax(dim=-1, keepdim=True)
    s = torch.exp(z - c).mul_(keep).sum(dim=-1)
    out = torch.log(s).add_(c.squeeze(-1))
    low = ~(s >= torch.finfo(z.dtype).tiny ** 0.5)
    if bool(low.any()):
        out[low] = torch.logsumexp(torch.where(keep[low] > 0, z[low], float("-inf")), dim=-1)
    return out


class _BlockedLogprob(torch.autograd.Function):
    """:func:`token_logprobs` under autograd (see there); saves the logits, the targets and ``lse``."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, temperature: float, block_elements: int,
                kept: Optional[KeptTokens] = None):
        out, lse = _forward(logits, targets, temperature, block_elements, kept)
        ctx.save_for_backward(logits, targets, lse)
        ctx.temperature, ctx.block_elements, ctx.kept = temperature, block_elements, kept
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        logits, targets, lse = ctx.saved_tensors
        tau = ctx.temperature
        grad = torch.empty_like(logits)
        dtype = lse.dtype
        for rows, pos in _blocks(logits.shape, ctx.block_elements):
            z, l_blk = logits[rows, pos].to(dtype), lse[rows, pos].unsqueeze(-1)
            blk = (z / tau).sub_(l_blk) if tau != 1.0 else z - l_blk          # a new tensor either way
            if ctx.kept is not None:       # softmax over K: every kept z / τ <= lse_K, so clamping at 0 changes
                blk.clamp_(max=0.0)        # only tokens outside K (no overflow there), which the indicator zeroes
                blk.exp_().mul_(ctx.kept.indicator(rows, pos, dtype))
            else:
                blk.exp_()                                                    # softmax(z / τ)
            g = grad_out[rows, pos].to(dtype).unsqueeze(-1)
            blk.mul_(-g)                                                      # -g softmax(z / τ)
            blk.scatter_add_(-1, targets[rows, pos].unsqueeze(-1), g)
            if tau != 1.0:
                blk.div_(tau)
            grad[rows, pos] = blk
        return grad, None, None, None, None
