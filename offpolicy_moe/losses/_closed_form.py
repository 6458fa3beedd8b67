"""The lean path of the clipped objectives (GRPO, GSPO): closed-form gradient, one fused value check.

The objective computes, without autograd, each token's loss ``l_t`` and its derivative
``d l_t / d logp_t``; :func:`finish_lean` weights, masks and aggregates both and returns a scalar
whose backward is ONE multiplication (:class:`_Linearized`).  The value checks cost one ``aminmax``
of the log-ratio plus the finiteness of the loss value, resolved with ONE host sync.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ._validate import (
    MASK_MESSAGE,
    FusedCheck,
    as_bool_mask,
    check_advantages,
    check_objective_args,
    compute_dtype,
    mask_is_binary,
    ratio_bound,
    value_checks_enabled,
)


@dataclass
class LeanInputs:
    """Checked inputs of a clipped objective, detached, in the compute dtype; nothing materialised twice."""

    mask: torch.Tensor          # bool [B, T]
    raw: torch.Tensor           # logp - old_logp, 0 at masked positions, NOT clamped
    log_ratio: torch.Tensor     # raw clamped to +-bound
    adv: torch.Tensor           # [B, 1] or [B, T], NOT masked (the result is, by a select)
    weights: Optional[torch.Tensor]  # [B, T], NOT masked, or None
    n_valid: torch.Tensor       # number of valid tokens (0-d int64)
    bound: float


def prepare_lean(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    weights: Optional[torch.Tensor],
    agg: str,
    *,
    num_tokens: object = None,
    num_seqs: object = None,
    norm_length: Optional[float] = None,
) -> LeanInputs:
    """The free checks of :func:`prepare` and the masked log-ratio; the value checks run in :func:`finish_lean`."""
    check_objective_args(logp, old_logp, advantages, mask, weights, agg, num_tokens, num_seqs, norm_length)
    m = as_bool_mask(mask)
    dtype = compute_dtype(logp.dtype)
    zero = torch.zeros((), dtype=dtype, device=logp.device)
    with torch.no_grad():
        raw = torch.where(m, logp.detach().to(dtype) - old_logp.detach().to(dtype), zero)
        bound = ratio_bound(logp.dtype)
        adv = advantages.detach().to(dtype)
        adv = adv.unsqueeze(-1) if adv.dim() == 1 else adv
        w = None if weights is None else weights.detach().to(dtype)
        return LeanInputs(m, raw, raw.clamp(-bound, bound), adv, w, m.sum(), bound)


class _Linearized(torch.autograd.Function):
    """A scalar loss whose gradient w.r.t. ``logp`` was computed in closed form with its value.

    ``forward(logp, value, coef, scale)`` returns ``value``; ``backward`` returns
    ``grad_out * scale * coef`` (``coef`` = d loss_t / d logp_t, 0 at masked positions; ``scale``
    the aggregation factor, 0-d or [B, 1]) in ``logp``'s dtype.
    """

    @staticmethod
    def forward(ctx, logp, value, coef, scale):  # noqa: D102 - see the class docstring
        ctx.save_for_backward(coef, scale)
        ctx.out_dtype = logp.dtype
        return value.clone()

    @staticmethod
    def backward(ctx, grad_out):  # noqa: D102
        coef, scale = ctx.saved_tensors
        return (coef * (grad_out * scale)).to(ctx.out_dtype), None, None, None


def aggregation_scale(mask: torch.Tensor, mode: str, num_tokens: object, num_seqs: object,
                      norm_length: Optional[float], dtype: torch.dtype, n_valid: torch.Tensor) -> torch.Tensor:
    """Factor ``s`` (0-d or [B, 1]) with ``aggregate(L, mask, mode, ...) == sum(mask * L * s)``."""
    def denom(count, local):
        if count is None:
            c = local
        elif isinstance(count, torch.Tensor):
            c = count.detach().to(device=mask.device)
        else:
            c = torch.tensor(float(count), device=mask.device)
        return c.to(dtype).clamp(min=1.0)

    if mode == "token-mean":
        return 1.0 / denom(num_tokens, n_valid)
    tok_per_seq = mask.sum(-1, keepdim=True)
    n_seq = denom(num_seqs, (tok_per_seq > 0).sum())
    if mode == "seq-mean-token-mean":
        return 1.0 / (tok_per_seq.clamp(min=1).to(dtype) * n_seq)
    if mode == "seq-mean-token-sum":
        return 1.0 / n_seq
    length = float(norm_length) if norm_length is not None else float(mask.shape[-1])
    return 1.0 / (n_seq * max(length, 1.0))


def finish_lean(
    x: LeanInputs,
    logp: torch.Tensor,
    loss_tok: torch.Tensor,
    coef: torch.Tensor,
    agg: str,
    *,
    inputs: tuple,
    num_tokens: object = None,
    num_seqs: object = None,
    norm_length: Optional[float] = None,
) -> torch.Tensor:
    """Weight, mask and aggregate ``loss_tok`` (and its gradient ``coef``) into a scalar with a gradient.

    The value checks, fused into ONE host sync: the log-ratio's ``aminmax`` (an Inf hides behind the clamp), the loss
    value (NaN/Inf in an advantage or weight at a valid position propagates into it), the mask's values and the tensor
    counts.  Only when that fails are the inputs checked one by one to name the culprit (a finite overflow passes).
    """
    zero = torch.zeros((), dtype=x.raw.dtype, device=x.raw.device)
    with torch.no_grad():
        if x.weights is not None:
            loss_tok = loss_tok * x.weights
            coef = coef * x.weights
        lm = torch.where(x.mask, loss_tok, zero)
        coef = torch.where(x.mask, coef, zero)
        scale = aggregation_scale(x.mask, agg, num_tokens, num_seqs, norm_length, x.raw.dtype, x.n_valid)
        value = (lm.sum(-1, keepdim=True) * scale).sum() if scale.dim() else lm.sum() * scale
        if value_checks_enabled():
            _run_fused_checks(x, value, logp, inputs, num_tokens, num_seqs)
    return _Linearized.apply(logp, value, coef, scale)


def _run_fused_checks(x: LeanInputs, value, logp, inputs, num_tokens, num_seqs) -> None:
    old_logp, advantages, mask, weights = inputs
    lo, hi = torch.aminmax(x.raw) if x.raw.numel() else (value, value)
    oks = [torch.isfinite(lo) & torch.isfinite(hi) & torch.isfinite(value)]
    binary = mask_is_binary(mask)
    if binary is not None:
        oks.append(binary)
    for c in (num_tokens, num_seqs):
        if isinstance(c, torch.Tensor):
            cd = c.detach().to(device=value.device, dtype=torch.float64).reshape(())
            oks.append((cd >= 0) & torch.isfinite(cd))
    if bool(torch.stack(oks).all()):
        return
    check = FusedCheck()
    if binary is not None:
        check.holds(MASK_MESSAGE.format(dtype=mask.dtype), binary)
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    check.finite("logp contains NaN or Inf at a valid (mask=1) position", torch.where(x.mask, logp.detach(), zero))
    check.finite("old_logp contains NaN or Inf at a valid (mask=1) position",
                 torch.where(x.mask, old_logp.detach(), torch.zeros((), dtype=old_logp.dtype, device=logp.device)))
    adv = check_advantages(advantages, x.mask.shape).detach()
    check.finite("advantages contains NaN or Inf at a valid (mask=1) position",
                 torch.where(x.mask, adv, torch.zeros((), dtype=adv.dtype, device=adv.device)))
    if weights is not None:
        check.finite("weights contains NaN or Inf at a valid (mask=1) position",
                     torch.where(x.mask, weights.detach(), torch.zeros((), dtype=weights.dtype, device=logp.device)))
    for name, c in (("num_tokens", num_tokens), ("num_seqs", num_seqs)):
        if isinstance(c, torch.Tensor):
            cd = c.detach().double()
            check.holds(f"{name} must be a finite number >= 0 (got a NaN, Inf or negative tensor)",
                        (cd >= 0).all() & torch.isfinite(cd).all())
    check.run()


def count_valid(cond: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Number of valid tokens where ``cond`` ([B, T] or per-row [B, 1]) holds (0-d int64)."""
    if cond.shape[-1] == 1 and mask.shape[-1] != 1:
        return (cond[:, 0] & mask.any(-1)).to(torch.int64).mul(mask.sum(-1)).sum()
    return (cond & mask).sum()


def share(count: torch.Tensor, n_valid: torch.Tensor) -> torch.Tensor:
    """``count / max(n_valid, 1)`` as a detached float32 0-d tensor."""
    return (count.to(torch.float32) / n_valid.clamp(min=1).to(torch.float32)).detach()
