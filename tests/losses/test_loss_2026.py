"""DPPO-TV/KL, SAPO, GMPO, VESPO and OPSM against loop references written from the papers' formulas
(values and gradients, every aggregation mode, global counts), and their option errors."""
import math

import pytest
import torch

from loss_refs import AGGS, make_batch, ref_dppo, ref_gmpo_sequence, ref_opsm, ref_sapo, ref_vespo
from offpolicy_moe.losses import (
    correction_weights,
    dppo_kl_loss,
    dppo_tv_loss,
    gmpo_loss,
    metrics_to_floats,
    resolve_loss_options,
    sapo_loss,
    vespo_loss,
)


def _batch(seed, per_token_adv=False, B=6, T=8):
    """Log-probs spread over (0, 1) in probability, old ones near them: DPPO masks and GMPO clips bite."""
    logp, old, adv, mask, w = make_batch(B=B, T=T, seed=seed, per_token_adv=per_token_adv)
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        logp.copy_(torch.log(torch.rand(B, T, generator=g, dtype=torch.float64).clamp(min=1e-3)))
        old.copy_((logp + 0.5 * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(max=-1e-4))
    return logp, old, adv, mask, w


def _check(got, exp, logp, rtol=1e-10, atol=1e-12):
    (g_got,) = torch.autograd.grad(got, logp, retain_graph=True)
    (g_exp,) = torch.autograd.grad(exp, logp)
    torch.testing.assert_close(got.detach(), exp.detach(), rtol=rtol, atol=atol)
    torch.testing.assert_close(g_got, g_exp, rtol=rtol, atol=atol)


@pytest.mark.parametrize("kind", ["tv", "kl"])
@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("per_token_adv", [False, True])
def test_dppo_matches_loop(kind, agg, per_token_adv):
    fn = dppo_tv_loss if kind == "tv" else dppo_kl_loss
    logp, old, adv, mask, w = _batch(1, per_token_adv)
    d = (0.1, 0.15) if kind == "tv" else (0.02, 0.03)
    for weights in (None, w):
        for cap in (None, 1.5):
            got, m = fn(logp, old, adv, mask, agg=agg, weights=weights, delta_low=d[0], delta_high=d[1], ratio_cap=cap)
            exp = ref_dppo(kind, logp, old, adv, mask, agg=agg, weights=weights, lo=d[0], hi=d[1], cap=cap)
            _check(got, exp, logp)
    m = metrics_to_floats(m)
    assert 0 < m["actor/clipfrac"] < 1, m                  # the mask bites on this batch, and not everywhere
    assert m["actor/clipfrac"] == pytest.approx(m["actor/clipfrac_low"] + m["actor/clipfrac_high"])


def test_dppo_global_counts():
    logp, old, adv, mask, _ = _batch(2)
    got, _ = dppo_tv_loss(logp, old, adv, mask, agg="token-mean", num_tokens=100)
    _check(got, ref_dppo("tv", logp, old, adv, mask, agg="token-mean", num_tokens=100), logp)
    got, _ = dppo_kl_loss(logp, old, adv, mask, agg="seq-mean-token-sum-norm", num_seqs=9, norm_length=32)
    _check(got, ref_dppo("kl", logp, old, adv, mask, agg="seq-mean-token-sum-norm", num_seqs=9, norm_length=32), logp)


def test_dppo_masks_by_probability_not_ratio():
    """The paper's point: a rare token may move by a large RATIO inside the TV region, a frequent one may not
    move by a small ratio outside it.  r = 3 at p_old = 0.01 is kept; r = 1.3 at p_old = 0.7 is masked (TV 0.2)."""
    old = torch.log(torch.tensor([[0.01, 0.7]], dtype=torch.float64))
    logp = torch.log(torch.tensor([[0.03, 0.91]], dtype=torch.float64)).requires_grad_(True)
    loss, m = dppo_tv_loss(logp, old, torch.tensor([1.0], dtype=torch.float64), torch.ones(1, 2, dtype=torch.bool))
    (g,) = torch.autograd.grad(loss, logp)
    assert g[0, 0] == pytest.approx(-3.0 / 2) and g[0, 1] == 0.0
    assert metrics_to_floats(m)["actor/clipfrac_high"] == pytest.approx(0.5)


def test_dppo_kl_is_finite_at_probability_one():
    """p = 1 or p_old = 1 (log-prob 0) gives log(1 - p) = -inf inside the binary KL: no NaN, a sane mask."""
    logp = torch.tensor([[0.0, -1e-9, -0.5, 0.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[0.0, 0.0, 0.0, -0.5]], dtype=torch.float64)
    for a in (1.0, -1.0):
        loss, m = dppo_kl_loss(logp, old, torch.tensor([a], dtype=torch.float64), torch.ones(1, 4, dtype=torch.bool))
        (g,) = torch.autograd.grad(loss, logp)
        assert torch.isfinite(loss) and torch.isfinite(g).all()
        assert all(math.isfinite(v) for v in metrics_to_floats(m).values())
    # A < 0 (the last call): p = 1 >= p_old everywhere, so no token is masked even at an infinite KL
    assert g.abs().sum() > 0


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("per_token_adv", [False, True])
def test_sapo_matches_loop(agg, per_token_adv):
    logp, old, adv, mask, w = _batch(3, per_token_adv)
    for weights in (None, w):
        for taus in ({}, {"tau_pos": 2.0, "tau_neg": 0.5}):
            got, _ = sapo_loss(logp, old, adv, mask, agg=agg, weights=weights, num_seqs=11, **taus)
            exp = ref_sapo(logp, old, adv, mask, agg=agg, weights=weights, num_seqs=11, **taus)
            _check(got, exp, logp)


def test_sapo_is_the_policy_gradient_on_policy():
    """At r = 1 the gate's slope is 1: SAPO's gradient equals the unclipped -A grad logp (paper, sec. 3)."""
    logp, _, adv, mask, _ = _batch(4)
    loss, m = sapo_loss(logp, logp.detach(), adv, mask, agg="token-mean")
    (g,) = torch.autograd.grad(loss, logp)
    expected = torch.where(mask, -adv.unsqueeze(-1).expand_as(logp), torch.zeros_like(logp)) / mask.sum()
    torch.testing.assert_close(g, expected)
    assert metrics_to_floats(m)["sapo/grad_scale_mean"] == pytest.approx(1.0)


@pytest.mark.parametrize("clip", [(0.4, 0.4), (0.05, 0.1)])
def test_gmpo_equals_the_papers_sequence_objective(clip):
    """Token form + seq-mean-token-mean == eq. 4's mean over sequences of -A prod clip(r)^(1/|o|), with autograd
    through the product (the reference shares nothing with the token surrogate)."""
    for seed in (5, 6):
        logp, old, adv, mask, _ = _batch(seed)
        got, m = gmpo_loss(logp, old, adv, mask, clip_low=clip[0], clip_high=clip[1])
        _check(got, ref_gmpo_sequence(logp, old, adv, mask, lo=clip[0], hi=clip[1]), logp)
    if clip[1] < 0.2:
        assert metrics_to_floats(m)["actor/clipfrac"] > 0


def test_gmpo_global_seq_count_splits_into_micro_batches():
    logp, old, adv, mask, _ = _batch(7, B=8)
    whole, _ = gmpo_loss(logp, old, adv, mask)
    n_seq = int(mask.any(-1).sum())
    parts = [gmpo_loss(logp[s], old[s], adv[s], mask[s], num_seqs=n_seq)[0] for s in (slice(0, 3), slice(3, 8))]
    torch.testing.assert_close(parts[0] + parts[1], whole)


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("per_token_adv", [False, True])
def test_vespo_matches_loop(agg, per_token_adv):
    logp, old, adv, mask, w = _batch(8, per_token_adv)
    with torch.no_grad():
        old.copy_(logp + 0.1 * (old - logp))        # sequence weights near 1, where phi is not ~0
    w = w.clone()
    w[0, 0] = 0.0                                    # a masked (MIS) weight folds in as log 1e-8
    for weights in (None, w):
        for fold in (True, False):
            got, _ = vespo_loss(logp, old, adv, mask, agg=agg, weights=weights, fold_weights=fold)
            exp = ref_vespo(logp, old, adv, mask, agg=agg, weights=weights, fold=fold)
            _check(got, exp, logp)
    got, _ = vespo_loss(logp, old, adv, mask, agg=agg, k_pos=1.0, lambda_pos=0.5, k_neg=4.0, lambda_neg=5.0)
    _check(got, ref_vespo(logp, old, adv, mask, agg=agg, k_pos=1.0, lam_pos=0.5, k_neg=4.0, lam_neg=5.0), logp)


def test_vespo_kernel_is_one_on_policy_and_vanishes_far_off():
    logp, _, adv, mask, _ = _batch(9)
    _, m = vespo_loss(logp, logp.detach(), adv, mask)
    assert metrics_to_floats(m)["vespo/phi_mean"] == pytest.approx(1.0)
    _, m = vespo_loss(logp, logp.detach() - 5.0, adv, mask)       # w = e^{5 |o|}: phi ~ 0
    assert metrics_to_floats(m)["vespo/phi_mean"] < 1e-12


@pytest.mark.parametrize("mode", ["opsm", "truncate", "mask"])
def test_opsm_matches_loop_and_composes(mode):
    logp, old, adv, mask, _ = _batch(10, B=12, T=6)
    old, behav = logp.detach(), old
    for A in (adv, torch.randn(12, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(3))):
        delta = 0.05
        keep = ref_opsm(old, behav, A, mask, delta)
        assert (~keep & mask).any() and (keep & mask).any()
        kw = dict(mode=mode, advantages=A, opsm_delta=delta)
        w, m = correction_weights(old, behav, mask, high=3.0, **kw)
        base = torch.ones_like(w) if mode == "opsm" else correction_weights(old, behav, mask, mode=mode, high=3.0)[0]
        expected = torch.where(keep & mask, base, torch.zeros_like(base))
        torch.testing.assert_close(w, expected)
        m = metrics_to_floats(m)
        assert m["mismatch/opsm_masked_frac"] == pytest.approx(float((~keep & mask).sum() / mask.sum()))


def test_opsm_default_delta_and_errors():
    logp, old, adv, mask, _ = _batch(11)
    w, _ = correction_weights(logp.detach(), old, mask, mode="opsm", advantages=adv)
    torch.testing.assert_close(w, ref_opsm(logp.detach(), old, adv, mask, 1e-4).to(w.dtype) * mask)
    with pytest.raises(ValueError, match="needs the advantages"):
        correction_weights(logp.detach(), old, mask, mode="opsm")
    with pytest.raises(ValueError, match="opsm_delta must be a finite number >= 0"):
        correction_weights(logp.detach(), old, mask, mode="truncate", advantages=adv, opsm_delta=-1.0)
    with pytest.raises(ValueError, match="advantages"):
        correction_weights(logp.detach(), old, mask, mode="opsm", advantages=adv[:2])


@pytest.mark.parametrize("name, options, message", [
    ("dppo_tv", {"delta_low": -0.1}, "delta_low must be a finite number >= 0"),
    ("dppo_kl", {"ratio_cap": 0.5}, "ratio_cap must be >= 1"),
    ("dppo_tv", {"clip_low": 0.1}, "has no option 'clip_low'"),
    ("sapo", {"tau_neg": 0.0}, "tau_neg must be a finite number > 0"),
    ("sapo", {"tau": 1.0}, "did you mean"),
    ("gmpo", {"clip_high": float("inf")}, "clip_high must be a finite number >= 0"),
    ("vespo", {"lambda_pos": 0}, "lambda_pos must be a finite number > 0"),
    ("vespo", {"fold_weights": "yes"}, "fold_weights must be true or false"),
])
def test_bad_options_raise_one_line_errors(name, options, message):
    with pytest.raises(ValueError, match=message) as err:
        resolve_loss_options(name, options)
    assert "\n" not in str(err.value) and name in str(err.value)


@pytest.mark.parametrize("name", ["dppo_tv", "dppo_kl", "sapo", "gmpo", "vespo"])
@pytest.mark.parametrize("agg", AGGS)
def test_micro_batch_shares_with_global_counts_sum_to_the_whole(name, agg):
    """None of these has a batch statistic: with the mini-batch's global counts, the micro-batch losses (and
    gradients) of a gradient-accumulation split add up to the whole batch's."""
    from offpolicy_moe.losses import get_policy_loss, global_counts

    fn = get_policy_loss(name)
    logp, old, adv, mask, w = _batch(12, B=9)
    whole, _ = fn(logp, old, adv, mask, agg=agg, weights=w, norm_length=8.0)
    (g_whole,) = torch.autograd.grad(whole, logp)
    cuts = (slice(0, 2), slice(2, 5), slice(5, 9))
    n_tok, n_seq = global_counts([mask[c] for c in cuts])
    total = sum(fn(logp[c], old[c], adv[c], mask[c], agg=agg, weights=w[c], num_tokens=n_tok, num_seqs=n_seq,
                   norm_length=8.0)[0] for c in cuts)
    (g_parts,) = torch.autograd.grad(total, logp)
    torch.testing.assert_close(total, whole, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(g_parts, g_whole, rtol=1e-12, atol=1e-14)


EXTREMES = [-65504.0, -30.0, -12.0, -1.0, -1e-6, 0.0, 1e-3, 12.0, 30.0, 65504.0]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("name", ["dppo_tv", "dppo_kl", "sapo", "gmpo", "vespo"])
def test_finite_for_extreme_finite_inputs_in_every_dtype(name, dtype):
    """Every pair of extreme log-probs (including log-probs above 0, which the DPPO masks read as 0), with unit and
    float16-max advantages, weights including 0: finite loss, finite or non-NaN gradient, finite metrics."""
    from offpolicy_moe.losses import AGG_MODES, get_policy_loss

    fn = get_policy_loss(name)
    grid = torch.tensor([(a, b) for a in EXTREMES for b in EXTREMES])
    logp = grid[:, 0].view(10, 10).to(dtype)
    old = grid[:, 1].view(10, 10).to(dtype)
    mask = torch.ones(10, 10, dtype=torch.bool)
    mask[3, 4:] = False
    w = torch.linspace(0, 2, 100).view(10, 10).to(dtype)
    for adv, nan_only in ((torch.linspace(-1, 1, 10), False), (torch.tensor([65504.0, -65504.0] * 5), True)):
        for agg in AGG_MODES:
            leaf = logp.clone().requires_grad_(True)
            loss, m = fn(leaf, old, adv.to(dtype), mask, agg=agg, weights=w)
            (g,) = torch.autograd.grad(loss, leaf)
            assert torch.isfinite(loss), (name, dtype, agg, float(loss))
            assert not torch.isnan(g).any() if nan_only else torch.isfinite(g).all(), (name, dtype, agg)
            assert all(math.isfinite(v) for v in metrics_to_floats(m).values()), (name, dtype, m)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_opsm_finite_for_extreme_inputs_in_every_dtype(dtype):
    grid = torch.tensor([(a, b) for a in EXTREMES for b in EXTREMES])
    old, behav = grid[:, 0].view(10, 10).to(dtype), grid[:, 1].view(10, 10).to(dtype)
    adv = torch.tensor([65504.0, -65504.0, 0.0, -1.0, 1.0] * 2).to(dtype)
    for mode in ("opsm", "truncate", "mask"):
        w, m = correction_weights(old, behav, torch.ones(10, 10, dtype=torch.bool), mode=mode, advantages=adv,
                                  opsm_delta=0.0, high=3.0)
        assert torch.isfinite(w).all() and all(math.isfinite(v) for v in metrics_to_floats(m).values())
        dropped = (w == 0).all(-1)
        assert dropped[1] and not dropped[0]           # A < 0 with a huge KL is dropped, A > 0 never by OPSM
