"""Plain-autograd reference bodies of every objective: the paper's formula, line by line.

Each ``reference_<name>`` takes the objective's arguments, computes the per-token loss with ordinary torch
operations and lets autograd differentiate it; ``tests/losses/test_loss_reference.py`` asserts that it and the
registered objective agree in value and gradient.  The references check nothing and return only the loss.

Shared conventions: masked positions are replaced by 0 before any arithmetic (never multiplied), log
ratios are clamped to ``+-ratio_bound(dtype)`` before ``exp`` (gradient 0 outside), half inputs are
computed in float32, and ``weights`` multiply the per-token loss before :func:`aggregate`.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from ._validate import as_bool_mask, compute_dtype, ratio_bound
from .aggregation import aggregate

VESPO_LOG_W_MIN = math.log(1e-8)
"""Lower clamp of VESPO's sequence log-weight (TRL's and the VESPO code's ``log(1e-8)``)."""
VESPO_LOG_W_MAX = 20.0


def _inputs(logp, old_logp, advantages, mask, weights):
    """(mask, logp, log r clamped, A [B, T], weights or None), masked, in the compute dtype."""
    m = as_bool_mask(mask)
    dtype = compute_dtype(logp.dtype)
    zero = torch.zeros((), dtype=dtype, device=logp.device)
    lp = torch.where(m, logp.to(dtype), zero)
    old = torch.where(m, old_logp.detach().to(dtype), zero)
    b = ratio_bound(logp.dtype)
    log_r = (lp - old).clamp(-b, b)
    adv = advantages.detach().to(dtype)
    adv = (adv.unsqueeze(-1) if adv.dim() == 1 else adv).expand_as(lp)
    adv = torch.where(m, adv, zero)
    w = None if weights is None else torch.where(m, weights.detach().to(dtype), zero)
    return m, lp, log_r, adv, w


def _finish(loss_tok, m, w, agg, num_tokens, num_seqs, norm_length):
    loss_tok = loss_tok if w is None else loss_tok * w
    return aggregate(loss_tok, m, agg, num_tokens=num_tokens, num_seqs=num_seqs, norm_length=norm_length)


def _seq_mean(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return (torch.where(m, x, torch.zeros_like(x)).sum(-1, keepdim=True)
            / m.sum(-1, keepdim=True).clamp(min=1).to(x.dtype))


def reference_grpo(logp, old_logp, advantages, mask, *, agg=None, weights=None, num_tokens=None, num_seqs=None,
                   norm_length=None, clip_low=None, clip_high=None, dual_clip=None):
    """PPO/GRPO: ``l = max(-A r, -A clip(r, 1 - lo, 1 + hi))``; dual clip ``min(l, -A c)`` where ``A < 0``."""
    m, _, log_r, A, w = _inputs(logp, old_logp, advantages, mask, weights)
    lo, hi = 0.2 if clip_low is None else clip_low, 0.2 if clip_high is None else clip_high
    r = torch.exp(log_r)
    loss = torch.maximum(-A * r, -A * r.clamp(1 - lo, 1 + hi))
    if dual_clip is not None:
        loss = torch.where(A < 0, torch.minimum(loss, -A * dual_clip), loss)
    return _finish(loss, m, w, "token-mean" if agg is None else agg, num_tokens, num_seqs, norm_length)


def reference_gspo(logp, old_logp, advantages, mask, *, agg=None, weights=None, num_tokens=None, num_seqs=None,
                   norm_length=None, clip_low=None, clip_high=None):
    """GSPO-token: ``log s_it = logp_t - sg[logp_t] + sg[log s_i]``, ``log s_i`` the mean log-ratio of row i."""
    m, lp, log_r, A, w = _inputs(logp, old_logp, advantages, mask, weights)
    lo, hi = 3e-4 if clip_low is None else clip_low, 4e-4 if clip_high is None else clip_high
    b = ratio_bound(logp.dtype)
    raw = torch.where(m, lp - old_logp.detach().to(lp.dtype), torch.zeros_like(lp))
    log_s = _seq_mean(raw, m).clamp(-b, b).detach()
    s = torch.exp(lp - lp.detach() + log_s)
    loss = torch.maximum(-A * s, -A * s.clamp(1 - lo, 1 + hi))
    return _finish(loss, m, w, "seq-mean-token-mean" if agg is None else agg, num_tokens, num_seqs, norm_length)


def reference_unclipped(logp, old_logp, advantages, mask, *, agg=None, weights=None, num_tokens=None, num_seqs=None,
                        norm_length=None):
    """No trust region: ``l = -A r``."""
    m, _, log_r, A, w = _inputs(logp, old_logp, advantages, mask, weights)
    return _finish(-A * torch.exp(log_r), m, w, "token-mean" if agg is None else agg, num_tokens, num_seqs,
                   norm_length)


def reference_cispo(logp, old_logp, advantages, mask, *, agg=None, weights=None, num_tokens=None, num_seqs=None,
                    norm_length=None, clip_low=None, clip_high=None):
    """CISPO: ``l = -sg[clip(r, 1 - lo, 1 + hi)] A logp`` (no lower bound when ``clip_low`` is None)."""
    m, lp, log_r, A, w = _inputs(logp, old_logp, advantages, mask, weights)
    hi = 1.0 + (4.0 if clip_high is None else clip_high)
    lo = None if clip_low is None else 1.0 - clip_low
    weight = torch.exp(log_r).detach().clamp(min=lo, max=hi)
    return _finish(-weight * A * lp, m, w, "token-mean" if agg is None else agg, num_tokens, num_seqs, norm_length)


def reference_m2po(logp, old_logp, advantages, mask, *, agg=None, weights=None, num_tokens=None, num_seqs=None,
                   norm_length=None, tau=0.04, variant="mask", scope="global", m2po_keep=None, m2po_cap=None):
    """M2PO given its selection (computed by :func:`m2po_mask` / :func:`m2po_adaptive_cap`, checked separately
    against Algorithm 1).  ``mask``: ``l = -M A r``, dropped tokens stay counted; ``adaptive_clip``: PPO clip of
    ``r`` to ``[exp(-sqrt(c)), exp(sqrt(c))]``."""
    m, _, log_r, A, w = _inputs(logp, old_logp, advantages, mask, weights)
    r = torch.exp(log_r)
    if variant == "adaptive_clip":
        bound = min(math.sqrt(float(m2po_cap)), ratio_bound(logp.dtype))
        loss = torch.maximum(-A * r, -A * r.clamp(math.exp(-bound), math.exp(bound)))
    else:
        keep = as_bool_mask(m2po_keep) & m
        loss = torch.where(keep, -A * r, torch.zeros_like(r))
    return _finish(loss, m, w, "token-mean" if agg is None else agg, num_tokens, num_seqs, norm_length)


def dppo_keep(kind: str, logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
              delta_low: float, delta_high: float) -> torch.Tensor:
    """DPPO's binary trust-region mask (arXiv 2602.04879), True where the token is kept.

    ``p = exp(min(logp, 0))``, ``p_old = exp(min(old_logp, 0))`` (a log-probability above 0 is read as 0).
    ``tv``: masked when ``A > 0 and p - p_old > delta_high`` or ``A <= 0 and p - p_old < -delta_low``.
    ``kl``: ``D = p_old (log p_old - log p) + (1 - p_old)(log(1 - p_old) - log(1 - p))`` with
    ``0 log 0 = 0``; masked when ``A > 0, p > p_old, D > delta_high`` or ``A <= 0, p < p_old, D > delta_low``.
    """
    lp = logp.detach().clamp(max=0.0)
    lq = old_logp.detach().clamp(max=0.0)
    p, q = torch.exp(lp), torch.exp(lq)
    up = advantages > 0
    if kind == "tv":
        return torch.where(up, p - q <= delta_high, p - q >= -delta_low)
    log1m_p = torch.log(-torch.expm1(lp))          # log(1 - p); -inf at p = 1
    log1m_q = torch.log(-torch.expm1(lq))
    zero = torch.zeros((), dtype=p.dtype, device=p.device)
    head = q * (lq - lp)
    tail = torch.where(q < 1, (1 - q) * (log1m_q - log1m_p), zero)
    div = head + tail
    return torch.where(up, (div <= delta_high) | (p <= q), (div <= delta_low) | (p >= q))


def _reference_dppo(kind, logp, old_logp, advantages, mask, agg, weights, counts, delta_low, delta_high, ratio_cap):
    m, lp, log_r, A, w = _inputs(logp, old_logp, advantages, mask, weights)
    lo, hi = 0.2 if delta_low is None else delta_low, 0.2 if delta_high is None else delta_high
    keep = dppo_keep(kind, lp, old_logp.detach().to(lp.dtype), A, lo, hi) & m
    r = torch.exp(log_r)
    if ratio_cap is not None:
        r = r * (r.clamp(max=ratio_cap) / r).detach()
    loss = torch.where(keep, -A * r, torch.zeros_like(r))
    return _finish(loss, m, w, "token-mean" if agg is None else agg, **counts)


def reference_dppo_tv(logp, old_logp, advantages, mask, *, agg=None, weights=None, num_tokens=None, num_seqs=None,
                      norm_length=None, delta_low=None, delta_high=None, ratio_cap=None):
    """DPPO-Binary-TV: ``l = -M A r`` with the TV mask of :func:`dppo_keep`; ``ratio_cap`` truncates ``r``'s weight."""
    counts = dict(num_tokens=num_tokens, num_seqs=num_seqs, norm_length=norm_length)
    return _reference_dppo("tv", logp, old_logp, advantages, mask, agg, weights, counts, delta_low, delta_high,
                           ratio_cap)


def reference_dppo_kl(logp, old_logp, advantages, mask, *, agg=None, weights=None, num_tokens=None, num_seqs=None,
                      norm_length=None, delta_low=None, delta_high=None, ratio_cap=None):
    """DPPO-Binary-KL: ``l = -M A r`` with the binary-KL mask of :func:`dppo_keep`."""
    counts = dict(num_tokens=num_tokens, num_seqs=num_seqs, norm_length=norm_length)
    return _reference_dppo("kl", logp, old_logp, advantages, mask, agg, weights, counts, delta_low, delta_high,
                           ratio_cap)


def reference_sapo(logp, old_logp, advantages, mask, *, agg=None, weights=None, num_tokens=None, num_seqs=None,
                   norm_length=None, tau_pos=1.0, tau_neg=1.05):
    """SAPO: ``l = -A (4 / tau) sigmoid(tau (r - 1))``, ``tau = tau_pos`` where ``A > 0`` else ``tau_neg``."""
    m, _, log_r, A, w = _inputs(logp, old_logp, advantages, mask, weights)
    tau = torch.where(A > 0, torch.full_like(A, tau_pos), torch.full_like(A, tau_neg))
    gate = torch.sigmoid(tau * (torch.exp(log_r) - 1)) * 4 / tau
    return _finish(-A * gate, m, w, "seq-mean-token-mean" if agg is None else agg, num_tokens, num_seqs, norm_length)


def reference_gmpo(logp, old_logp, advantages, mask, *, agg=None, weights=None, num_tokens=None, num_seqs=None,
                   norm_length=None, clip_low=None, clip_high=None):
    """GMPO, token form: every token of row i carries ``-A_i R_i`` where
    ``log R_i = mean_t sgn(A_i) min(sgn(A_i) log r_t, sgn(A_i) clip(log r_t, -lo, hi))`` (the paper's
    sequence objective ``-A_i prod_t clip(r_t)^(1/|o_i|)``); token t's surrogate
    ``log R_it = sg[log R_i] + c_t - sg[c_t]`` has the value ``R_i`` and the gradient ``R_i grad c_t``, so
    ``seq-mean-token-mean`` gives exactly the paper's ``mean_i -A_i R_i`` and its gradient."""
    m, lp, _, A, w = _inputs(logp, old_logp, advantages, mask, weights)
    lo, hi = 0.4 if clip_low is None else clip_low, 0.4 if clip_high is None else clip_high
    b = ratio_bound(logp.dtype)
    raw = torch.where(m, lp - old_logp.detach().to(lp.dtype), torch.zeros_like(lp))
    A_seq = _seq_mean(A, m)                               # [B, 1]: the sequence's advantage
    sgn = torch.sign(A_seq)
    clipped = sgn * torch.minimum(sgn * raw, sgn * raw.clamp(-lo, hi))
    n = m.sum(-1, keepdim=True).clamp(min=1).to(lp.dtype)
    mean_log = torch.where(m, clipped, torch.zeros_like(clipped)).sum(-1, keepdim=True) / n
    mean_log = mean_log.clamp(-b, b)
    # token surrogate (as GSPO-token): log R_it = sg[log R_i] + c_t - sg[c_t]: value R_i, d/d logp_t = R_i dc_t
    inside = (mean_log.abs() < b).to(lp.dtype)
    log_R = mean_log.detach() + inside * (clipped - clipped.detach())
    loss = -A_seq * torch.exp(log_R)
    return _finish(loss, m, w, "seq-mean-token-mean" if agg is None else agg, num_tokens, num_seqs, norm_length)


def vespo_phi(log_w: torch.Tensor, advantages: torch.Tensor, k_pos: float, lambda_pos: float, k_neg: float,
              lambda_neg: float) -> torch.Tensor:
    """VESPO's gamma kernel (arXiv 2602.10693): ``phi(w) = w^k exp(lambda (1 - w))``, ``phi(1) = 1``.

    ``log w`` is clamped to ``[log 1e-8, 20]``; ``(k, lambda) = (k_pos, lambda_pos)`` where ``A >= 0`` else
    ``(k_neg, lambda_neg)``.  Computed in log space: ``log phi = lambda + k log w - lambda w``; detached.
    """
    log_w = log_w.detach().clamp(VESPO_LOG_W_MIN, VESPO_LOG_W_MAX)
    nonneg = advantages >= 0
    k = torch.where(nonneg, torch.full_like(advantages, k_pos), torch.full_like(advantages, k_neg))
    lam = torch.where(nonneg, torch.full_like(advantages, lambda_pos), torch.full_like(advantages, lambda_neg))
    return torch.exp(lam + k * log_w - lam * torch.exp(log_w))


def vespo_log_w(log_r: torch.Tensor, mask: torch.Tensor, weights: Optional[torch.Tensor]) -> torch.Tensor:
    """Sequence log importance weight ``sum_t m log r_t`` [B, 1], plus ``sum_t m log weights_t`` (each
    clamped to ``[log 1e-8, 20]``) when the correction weights are folded in."""
    zero = torch.zeros((), dtype=log_r.dtype, device=log_r.device)
    out = torch.where(mask, log_r, zero).sum(-1, keepdim=True)
    if weights is not None:
        lw = torch.log(weights.clamp(min=0)).clamp(VESPO_LOG_W_MIN, VESPO_LOG_W_MAX)
        out = out + torch.where(mask, lw, zero).sum(-1, keepdim=True)
    return out


def reference_vespo(logp, old_logp, advantages, mask, *, agg=None, weights=None, num_tokens=None, num_seqs=None,
                    norm_length=None, k_pos=2.0, lambda_pos=3.0, k_neg=3.0, lambda_neg=2.0, fold_weights=True):
    """VESPO: ``l = -sg[phi(w_i)] A logp`` with ``w_i = prod_t r_t`` (times the correction weights when
    ``fold_weights``, which then do not multiply the loss)."""
    m, lp, _, A, w = _inputs(logp, old_logp, advantages, mask, weights)
    raw = torch.where(m, lp - old_logp.detach().to(lp.dtype), torch.zeros_like(lp)).clamp(-20.0, 20.0)
    log_w = vespo_log_w(raw.detach(), m, w if fold_weights else None)
    phi = vespo_phi(log_w, A, k_pos, lambda_pos, k_neg, lambda_neg)
    return _finish(-phi * A * lp, m, None if fold_weights else w, "token-mean" if agg is None else agg,
                   num_tokens, num_seqs, norm_length)


__all__ = [
    "reference_grpo", "reference_gspo", "reference_unclipped", "reference_cispo", "reference_m2po",
    "reference_dppo_tv", "reference_dppo_kl", "reference_sapo", "reference_gmpo", "reference_vespo",
    "dppo_keep", "vespo_phi", "vespo_log_w",
]
