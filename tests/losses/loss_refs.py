"""Loop-based reference implementations written from the formulas in docs/algorithms.md.

They work token by token on Python floats / 0-d tensors (with autograd where a gradient is
needed), deliberately sharing no code with ``offpolicy_moe.losses``.
"""
from __future__ import annotations

import math

import torch

BOUND = 20.0


def clampf(x, lo, hi):
    return max(lo, min(hi, x))


def val(x) -> float:
    return float(x.detach()) if isinstance(x, torch.Tensor) else float(x)


def clamp_t(x: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
    """Scalar clamp of a 0-d tensor, gradient 1 inside, 0 outside (like min/max of a constant)."""
    if val(x) < lo:
        return x * 0 + lo
    if val(x) > hi:
        return x * 0 + hi
    return x


def adv_at(A: torch.Tensor, i: int, t: int) -> float:
    return float(A[i]) if A.dim() == 1 else float(A[i, t])


def agg_loop(L, mask, mode, *, num_tokens=None, num_seqs=None, norm_length=None):
    """L[i][t]: per-token loss (0-d tensor or float) at valid positions."""
    B, T = mask.shape
    valid = [[bool(mask[i, t]) for t in range(T)] for i in range(B)]
    n_valid = sum(sum(row) for row in valid)
    n_seq = sum(1 for row in valid if any(row))
    n_tok = max(num_tokens if num_tokens is not None else n_valid, 1)
    n_sq = max(num_seqs if num_seqs is not None else n_seq, 1)
    total = 0.0
    if mode == "token-mean":
        for i in range(B):
            for t in range(T):
                if valid[i][t]:
                    total = total + L[i][t]
        return total / n_tok
    if mode == "seq-mean-token-mean":
        for i in range(B):
            cnt = sum(valid[i])
            if cnt == 0:
                continue
            s = 0.0
            for t in range(T):
                if valid[i][t]:
                    s = s + L[i][t]
            total = total + s / cnt
        return total / n_sq
    if mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
        for i in range(B):
            for t in range(T):
                if valid[i][t]:
                    total = total + L[i][t]
        if mode == "seq-mean-token-sum":
            return total / n_sq
        length = norm_length if norm_length is not None else T
        return total / (n_sq * length)
    raise AssertionError(mode)


def _ratio(lp: torch.Tensor, old: float) -> torch.Tensor:
    return torch.exp(clamp_t(lp - old, -BOUND, BOUND))


def grpo_token(lp, old, a, lo, hi, dual=None):
    r = _ratio(lp, old)
    unc = -a * r
    clp = -a * clamp_t(r, 1 - lo, 1 + hi)
    loss = clp if val(clp) > val(unc) else unc
    if dual is not None and a < 0 and val(-a * dual) < val(loss):
        loss = lp * 0 + (-a * dual)
    return loss


def ref_grpo(logp, old_logp, A, mask, *, agg="token-mean", weights=None, lo=0.2, hi=0.2, dual=None, **kw):
    B, T = logp.shape
    L = [[None] * T for _ in range(B)]
    for i in range(B):
        for t in range(T):
            if mask[i, t]:
                x = grpo_token(logp[i, t], float(old_logp[i, t]), adv_at(A, i, t), lo, hi, dual)
                L[i][t] = x * (float(weights[i, t]) if weights is not None else 1.0)
    return agg_loop(L, mask, agg, **kw)


def ref_unclipped(logp, old_logp, A, mask, *, agg="token-mean", weights=None, **kw):
    B, T = logp.shape
    L = [[None] * T for _ in range(B)]
    for i in range(B):
        for t in range(T):
            if mask[i, t]:
                x = -adv_at(A, i, t) * _ratio(logp[i, t], float(old_logp[i, t]))
                L[i][t] = x * (float(weights[i, t]) if weights is not None else 1.0)
    return agg_loop(L, mask, agg, **kw)


def ref_gspo_token(logp, old_logp, A, mask, *, agg="seq-mean-token-mean", weights=None, lo=3e-4, hi=4e-4, **kw):
    """GSPO-token: log s_it = logp_t - sg[logp_t] + sg[log s_i]."""
    B, T = logp.shape
    L = [[None] * T for _ in range(B)]
    for i in range(B):
        toks = [t for t in range(T) if mask[i, t]]
        if not toks:
            continue
        log_si = sum(val(logp[i, t]) - val(old_logp[i, t]) for t in toks) / len(toks)
        log_si = clampf(log_si, -BOUND, BOUND)
        for t in toks:
            s = torch.exp(logp[i, t] - logp[i, t].detach() + log_si)
            a = adv_at(A, i, t)
            unc = -a * s
            clp = -a * clamp_t(s, 1 - lo, 1 + hi)
            x = clp if val(clp) > val(unc) else unc
            L[i][t] = x * (float(weights[i, t]) if weights is not None else 1.0)
    return agg_loop(L, mask, agg, **kw)


def ref_gspo_sequence(logp, old_logp, A, mask, *, lo=3e-4, hi=4e-4):
    """Sequence-level GSPO (arXiv 2507.18071, eq. 5): mean_i max(-A s_i, -A clip(s_i)), full autograd."""
    B, T = logp.shape
    total, n = 0.0, 0
    for i in range(B):
        toks = [t for t in range(T) if mask[i, t]]
        if not toks:
            continue
        log_si = sum(logp[i, t] - float(old_logp[i, t]) for t in toks) / len(toks)
        s = torch.exp(log_si)
        a = float(A[i])
        unc = -a * s
        clp = -a * clamp_t(s, 1 - lo, 1 + hi)
        total = total + (clp if val(clp) > val(unc) else unc)
        n += 1
    return total / max(n, 1)


def m2_value(lr: torch.Tensor) -> float:
    """M2 of one token as documented: the clamped log-ratio squared in float32."""
    x = lr.detach().to(torch.float32).clamp(-BOUND, BOUND)
    return float(x * x)


def greedy_m2po(log_ratio, A, mask, tau):
    """Literal Algorithm 1: while the mean M2 over kept trust-region tokens > tau, drop the largest
    (ties: the larger flat position first).  Returns a bool tensor (True = contributes)."""
    B, T = log_ratio.shape
    keep = torch.zeros(B, T, dtype=torch.bool)
    tr = []
    for i in range(B):
        for t in range(T):
            if not mask[i, t]:
                continue
            a = adv_at(A, i, t)
            lr = float(log_ratio[i, t])
            if (a > 0 and lr > 0) or (a < 0 and lr < 0):
                tr.append((i * T + t, m2_value(log_ratio[i, t])))
            else:
                keep[i, t] = True
    remaining = list(tr)
    while remaining and math.fsum(v for _, v in remaining) / len(remaining) > tau:
        worst = max(remaining, key=lambda pv: (pv[1], pv[0]))
        remaining.remove(worst)
    for pos, _ in remaining:
        keep[pos // T, pos % T] = True
    return keep


def ref_m2po(logp, old_logp, A, mask, keep, *, agg="token-mean", weights=None, **kw):
    B, T = logp.shape
    L = [[None] * T for _ in range(B)]
    for i in range(B):
        for t in range(T):
            if mask[i, t]:
                if keep[i, t]:
                    x = -adv_at(A, i, t) * _ratio(logp[i, t], float(old_logp[i, t]))
                else:
                    x = logp[i, t] * 0.0
                L[i][t] = x * (float(weights[i, t]) if weights is not None else 1.0)
    return agg_loop(L, mask, agg, **kw)


def ref_correction(old, behav, mask, level, mode, high, low):
    B, T = old.shape
    W = torch.zeros(B, T, dtype=torch.float64)
    changed = 0
    for i in range(B):
        toks = [t for t in range(T) if mask[i, t]]
        lrs = {t: float(old[i, t]) - float(behav[i, t]) for t in toks}
        for t in toks:
            if level == "token":
                lw = lrs[t]
            elif level == "sequence":
                lw = sum(lrs.values())
            else:
                lw = sum(lrs.values()) / len(toks)
            rho = math.exp(clampf(lw, -BOUND, BOUND))
            out = rho > high or (low is not None and rho < low)
            changed += out
            if mode == "truncate":
                w = min(rho, high)
                if low is not None:
                    w = max(w, low)
            else:
                w = 0.0 if out else rho
            W[i, t] = w
    n = int(mask.sum())
    ws = [float(W[i, t]) for i in range(B) for t in range(T) if mask[i, t]]
    s1, s2 = sum(ws), sum(w * w for w in ws)
    metrics = {
        "mismatch/is_mean": s1 / max(n, 1),
        "mismatch/is_max": max(ws) if ws else 0.0,
        "mismatch/is_min": min(ws) if ws else 0.0,
        "changed": changed / max(n, 1),
        "mismatch/ess": (s1 * s1 / (n * s2)) if s2 > 0 else 0.0,
    }
    return W, metrics


AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def ref_cispo(logp, old_logp, A, mask, *, agg="token-mean", weights=None, lo=None, hi=4.0, **kw):
    """CISPO token by token: l = -w A logp with w = clip(r, 1 - lo, 1 + hi) a plain float (no gradient)."""
    B, T = logp.shape
    L = [[None] * T for _ in range(B)]
    for i in range(B):
        for t in range(T):
            if mask[i, t]:
                r = math.exp(clampf(val(logp[i, t]) - float(old_logp[i, t]), -BOUND, BOUND))
                w = min(r, 1 + hi)
                if lo is not None:
                    w = max(w, 1 - lo)
                x = -w * adv_at(A, i, t) * logp[i, t]
                L[i][t] = x * (float(weights[i, t]) if weights is not None else 1.0)
    return agg_loop(L, mask, agg, **kw)


def make_batch(B=5, T=7, seed=0, scale=0.3, p_valid=0.75, per_token_adv=False, empty_row=True):
    """Random (logp leaf, old_logp, advantages, mask, weights) in float64 for tight comparisons."""
    g = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(B, T, generator=g, dtype=torch.float64) * 3).requires_grad_(True)
    old = logp.detach() + scale * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, T, generator=g, dtype=torch.float64) if per_token_adv else torch.randn(B, generator=g, dtype=torch.float64)
    mask = torch.rand(B, T, generator=g) < p_valid
    mask[:, 0] = True
    if empty_row and B > 2:
        mask[1] = False
    weights = torch.rand(B, T, generator=g, dtype=torch.float64) * 2
    return logp, old, adv, mask, weights


# ------------------------------------------------------------------------------------------------
# 2026 objectives, token by token from the papers' formulas (arXiv 2602.04879, 2511.20347, 2507.20673,
# 2602.10693) and DeepSeek-V3.2's OPSM (arXiv 2512.02556, eq. 9)

def _w(weights, i, t):
    return float(weights[i, t]) if weights is not None else 1.0


def dppo_kept(kind, lp: float, old: float, a: float, lo: float, hi: float) -> bool:
    """DPPO binary trust region of one token (math on floats)."""
    p, q = math.exp(min(lp, 0.0)), math.exp(min(old, 0.0))
    if kind == "tv":
        return (p - q <= hi) if a > 0 else (p - q >= -lo)
    kl = q * (math.log(q) - math.log(p)) if q > 0 else 0.0
    if q < 1:
        kl += (1 - q) * (math.log1p(-q) - (math.log1p(-p) if p < 1 else -math.inf))
    return (kl <= hi or p <= q) if a > 0 else (kl <= lo or p >= q)


def ref_dppo(kind, logp, old_logp, A, mask, *, agg="token-mean", weights=None, lo=0.2, hi=0.2, cap=None, **kw):
    B, T = logp.shape
    L = [[None] * T for _ in range(B)]
    for i in range(B):
        for t in range(T):
            if mask[i, t]:
                a = adv_at(A, i, t)
                if dppo_kept(kind, val(logp[i, t]), float(old_logp[i, t]), a, lo, hi):
                    r = _ratio(logp[i, t], float(old_logp[i, t]))
                    if cap is not None and val(r) > cap:
                        r = r * (cap / val(r))          # weight truncated, gradient direction kept
                    x = -a * r
                else:
                    x = logp[i, t] * 0.0
                L[i][t] = x * _w(weights, i, t)
    return agg_loop(L, mask, agg, **kw)


def ref_sapo(logp, old_logp, A, mask, *, agg="seq-mean-token-mean", weights=None, tau_pos=1.0, tau_neg=1.05, **kw):
    B, T = logp.shape
    L = [[None] * T for _ in range(B)]
    for i in range(B):
        for t in range(T):
            if mask[i, t]:
                a = adv_at(A, i, t)
                tau = tau_pos if a > 0 else tau_neg
                r = _ratio(logp[i, t], float(old_logp[i, t]))
                L[i][t] = -a * torch.sigmoid(tau * (r - 1)) * (4.0 / tau) * _w(weights, i, t)
    return agg_loop(L, mask, agg, **kw)


def ref_gmpo_sequence(logp, old_logp, A, mask, *, lo=0.4, hi=0.4):
    """GMPO as the paper states it (eq. 4): mean over non-empty sequences of
    -A_i * prod_t (sign-aware clipped r_t)^(1/|o_i|), full autograd through the product."""
    B, T = logp.shape
    total, n = 0.0, 0
    for i in range(B):
        toks = [t for t in range(T) if mask[i, t]]
        if not toks:
            continue
        a = sum(adv_at(A, i, t) for t in toks) / len(toks)
        prod = 1.0
        for t in toks:
            lr = logp[i, t] - float(old_logp[i, t])
            if a > 0:
                c = lr if val(lr) <= hi else lr * 0 + hi
            elif a < 0:
                c = lr if val(lr) >= -lo else lr * 0 - lo
            else:
                c = lr * 0
            prod = prod * torch.exp(c) ** (1.0 / len(toks))
        total = total + (-a * prod)
        n += 1
    return total / max(n, 1)


def ref_vespo(logp, old_logp, A, mask, *, agg="token-mean", weights=None, k_pos=2.0, lam_pos=3.0, k_neg=3.0,
              lam_neg=2.0, fold=True, **kw):
    """VESPO: phi(w) = w^k e^{lambda (1 - w)} on w = prod_t r_t (times the weights when folded); l = -phi A logp."""
    B, T = logp.shape
    L = [[None] * T for _ in range(B)]
    lmin = math.log(1e-8)
    for i in range(B):
        toks = [t for t in range(T) if mask[i, t]]
        log_w = sum(clampf(val(logp[i, t]) - float(old_logp[i, t]), -20.0, 20.0) for t in toks)
        if fold and weights is not None:
            log_w += sum(clampf(math.log(float(weights[i, t])) if float(weights[i, t]) > 0 else -math.inf, lmin, 20.0)
                         for t in toks)
        log_w = clampf(log_w, lmin, 20.0)
        for t in toks:
            a = adv_at(A, i, t)
            k, lam = (k_pos, lam_pos) if a >= 0 else (k_neg, lam_neg)
            phi = math.exp(lam + k * log_w - lam * math.exp(log_w))
            x = -phi * a * logp[i, t]
            L[i][t] = x * (1.0 if fold else _w(weights, i, t))
    return agg_loop(L, mask, agg, **kw)


def ref_opsm(old, behav, A, mask, delta):
    """OPSM keep mask: drop a sequence (its tokens) when A < 0 and mean_t (behav - old) > delta."""
    B, T = old.shape
    keep = torch.ones(B, T, dtype=torch.bool)
    for i in range(B):
        toks = [t for t in range(T) if mask[i, t]]
        kl = sum(float(behav[i, t]) - float(old[i, t]) for t in toks) / max(len(toks), 1)
        for t in range(T):
            a = adv_at(A, i, t)
            keep[i, t] = a >= 0 or kl <= delta
    return keep
