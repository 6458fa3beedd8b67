"""GRPO / GSPO / unclipped / M2PO against loop references (values and gradients)."""
import pytest
import torch

from loss_refs import (
    AGGS,
    greedy_m2po,
    make_batch,
    ref_grpo,
    ref_gspo_sequence,
    ref_gspo_token,
    ref_m2po,
    ref_unclipped,
)
from offpolicy_moe.losses import grpo_loss, gspo_loss, m2po_loss, metrics_to_floats, unclipped_loss


def _grads(loss, logp):
    (g,) = torch.autograd.grad(loss, logp)
    return g


def _compare(fn, ref, logp, *args, rtol=1e-10, atol=1e-12, **kw):
    got, metrics = fn(logp, *args, **kw)
    g_got = _grads(got, logp)
    exp = ref(logp, *args, **{k.replace("clip_low", "lo").replace("clip_high", "hi").replace("dual_clip", "dual"): v for k, v in kw.items()})
    g_exp = _grads(exp, logp)
    torch.testing.assert_close(got.detach(), exp.detach(), rtol=rtol, atol=atol)
    torch.testing.assert_close(g_got, g_exp, rtol=rtol, atol=atol)
    return metrics


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("per_token_adv", [False, True])
@pytest.mark.parametrize("use_weights", [False, True])
def test_grpo_matches_loop(agg, per_token_adv, use_weights):
    logp, old, adv, mask, w = make_batch(seed=1, per_token_adv=per_token_adv)
    w = w if use_weights else None
    _compare(grpo_loss, ref_grpo, logp, old, adv, mask, agg=agg, weights=w)
    _compare(grpo_loss, ref_grpo, logp, old, adv, mask, agg=agg, weights=w, clip_low=0.1, clip_high=0.28)
    _compare(grpo_loss, ref_grpo, logp, old, adv, mask, agg=agg, weights=w, dual_clip=1.5)


def test_grpo_global_counts_and_norm_length():
    logp, old, adv, mask, w = make_batch(seed=2)
    _compare(grpo_loss, ref_grpo, logp, old, adv, mask, agg="token-mean", num_tokens=100)
    _compare(grpo_loss, ref_grpo, logp, old, adv, mask, agg="seq-mean-token-mean", num_seqs=9)
    _compare(grpo_loss, ref_grpo, logp, old, adv, mask, agg="seq-mean-token-sum-norm", num_seqs=9, norm_length=32)


def test_grpo_clip_metrics_count_branches():
    logp, old, adv, mask, _ = make_batch(B=8, T=9, seed=3, scale=0.5)
    _, m = grpo_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.3, dual_clip=2.0)
    m = metrics_to_floats(m)
    low = high = dual = kl = n = 0
    for i in range(8):
        for t in range(9):
            if not mask[i, t]:
                continue
            n += 1
            r = float(torch.exp(logp[i, t].detach() - old[i, t]))
            a = float(adv[i])
            low += a < 0 and r < 0.8
            high += a > 0 and r > 1.3
            dual += a < 0 and -a * r > -a * 2.0 and -a * max(r, 0.8) > -a * 2.0
            kl += float(old[i, t] - logp[i, t].detach())
    assert m["actor/clipfrac_low"] == pytest.approx(low / n)
    assert m["actor/clipfrac_high"] == pytest.approx(high / n)
    assert m["actor/clipfrac"] == pytest.approx((low + high) / n)
    assert m["actor/dual_clipfrac"] == pytest.approx(dual / n)
    assert m["actor/ppo_kl"] == pytest.approx(kl / n, rel=1e-5)
    assert high > 0 and low > 0  # the test exercises both branches


def test_dual_clip_bounds_negative_advantage_loss():
    logp = torch.tensor([[3.0]], dtype=torch.float64, requires_grad=True)
    old = torch.zeros(1, 1, dtype=torch.float64)
    mask = torch.ones(1, 1, dtype=torch.bool)
    loss, m = grpo_loss(logp, old, torch.tensor([-1.0], dtype=torch.float64), mask, dual_clip=3.0)
    assert float(loss.detach()) == pytest.approx(3.0)  # min(e^3, 3) = 3
    assert float(_grads(loss, logp)) == 0.0
    assert float(m["actor/dual_clipfrac"]) == 1.0
    loss2, _ = grpo_loss(logp, old, torch.tensor([-1.0], dtype=torch.float64), mask)
    assert float(loss2.detach()) == pytest.approx(torch.e ** 3)


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("per_token_adv", [False, True])
def test_unclipped_matches_loop(agg, per_token_adv):
    logp, old, adv, mask, w = make_batch(seed=4, per_token_adv=per_token_adv)
    _compare(unclipped_loss, ref_unclipped, logp, old, adv, mask, agg=agg, weights=w)


@pytest.mark.filterwarnings("ignore:gspo_loss")
@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("per_token_adv", [False, True])
@pytest.mark.parametrize("scale", [0.0, 1e-4, 0.3])
def test_gspo_token_matches_loop(agg, per_token_adv, scale):
    logp, old, adv, mask, w = make_batch(seed=5, per_token_adv=per_token_adv, scale=scale)
    _compare(gspo_loss, ref_gspo_token, logp, old, adv, mask, agg=agg, weights=w)
    _compare(gspo_loss, ref_gspo_token, logp, old, adv, mask, agg=agg, clip_low=0.05, clip_high=0.1)


def test_gspo_warns_on_token_sum_modes():
    logp, old, adv, mask, _ = make_batch(seed=6)
    with pytest.warns(UserWarning, match="length"):
        gspo_loss(logp, old, adv, mask, agg="seq-mean-token-sum")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gspo_loss(logp, old, adv, mask)  # default mode: no warning


@pytest.mark.parametrize("scale", [1e-4, 0.02, 0.5])
def test_gspo_token_gradient_equals_sequence_gspo(scale):
    logp, old, adv, mask, _ = make_batch(B=6, T=8, seed=7, scale=scale)
    loss, _ = gspo_loss(logp, old, adv, mask, clip_low=0.01, clip_high=0.02)
    seq = ref_gspo_sequence(logp, old, adv, mask, lo=0.01, hi=0.02)
    torch.testing.assert_close(loss.detach(), seq.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(_grads(loss, logp), _grads(seq, logp), rtol=1e-10, atol=1e-12)


def test_on_policy_grpo_gradient_is_reinforce():
    logp, _, adv, mask, w = make_batch(B=6, T=8, seed=8)
    for agg in AGGS:
        for weights in (None, w):
            loss, m = grpo_loss(logp, logp.detach(), adv, mask, agg=agg, weights=weights)
            wt = weights if weights is not None else torch.ones_like(logp)
            # REINFORCE: per-token -A * w * logp, aggregated the same way (written out per mode)
            per_tok = -(adv[:, None] * wt * logp) * mask
            n_i = mask.sum(-1)
            if agg == "token-mean":
                reinforce = per_tok.sum() / mask.sum()
            elif agg == "seq-mean-token-mean":
                reinforce = (per_tok.sum(-1)[n_i > 0] / n_i[n_i > 0]).sum() / (n_i > 0).sum()
            elif agg == "seq-mean-token-sum":
                reinforce = per_tok.sum() / (n_i > 0).sum()
            else:
                reinforce = per_tok.sum() / ((n_i > 0).sum() * logp.shape[1])
            torch.testing.assert_close(_grads(loss, logp), _grads(reinforce, logp), rtol=1e-12, atol=1e-14)
            assert float(m["actor/clipfrac"]) == 0.0


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("tau", [1e-3, 0.04, 10.0])
def test_m2po_matches_loop(agg, tau):
    logp, old, adv, mask, w = make_batch(B=6, T=8, seed=9, scale=0.4)
    keep = greedy_m2po(logp.detach() - old, adv, mask, tau)
    loss, m = m2po_loss(logp, old, adv, mask, agg=agg, weights=w, tau=tau)
    exp = ref_m2po(logp, old, adv, mask, keep, agg=agg, weights=w)
    torch.testing.assert_close(loss.detach(), exp.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(_grads(loss, logp), _grads(exp, logp), rtol=1e-10, atol=1e-12)
    n_valid = int(mask.sum())
    assert float(m["m2po/masked_frac"]) == pytest.approx(int((mask & ~keep).sum()) / n_valid)
    if tau == 1e-3:
        assert int((mask & ~keep).sum()) > 0  # the test exercises masking


def test_m2po_masked_tokens_stay_in_denominator():
    # two valid tokens; the one with huge M2 is dropped; token-mean still divides by 2
    logp = torch.tensor([[0.1, 2.0]], dtype=torch.float64, requires_grad=True)
    old = torch.zeros(1, 2, dtype=torch.float64)
    mask = torch.ones(1, 2, dtype=torch.bool)
    adv = torch.tensor([1.0], dtype=torch.float64)
    loss, m = m2po_loss(logp, old, adv, mask, tau=0.04)
    assert float(loss.detach()) == pytest.approx(-torch.exp(torch.tensor(0.1)).item() / 2)
    assert float(m["m2po/masked_frac"]) == 0.5
    assert float(m["m2po/m2_after"]) == pytest.approx(0.01)
    assert float(m["m2po/m2_before"]) == pytest.approx((0.01 + 4.0) / 2)
    g = _grads(loss, logp)
    assert float(g[0, 1]) == 0.0 and float(g[0, 0]) == pytest.approx(-torch.exp(torch.tensor(0.1)).item() / 2)


def test_m2po_precomputed_keep_is_used():
    logp, old, adv, mask, _ = make_batch(seed=10, scale=0.5)
    keep = torch.rand(mask.shape, generator=torch.Generator().manual_seed(0)) < 0.5
    loss, _ = m2po_loss(logp, old, adv, mask, m2po_keep=keep)
    exp = ref_m2po(logp, old, adv, mask, keep & mask)
    torch.testing.assert_close(loss.detach(), exp.detach())


def test_m2po_adaptive_clip_matches_ppo_with_cap_bounds():
    from offpolicy_moe.losses import m2po_adaptive_cap

    logp, old, adv, mask, w = make_batch(B=6, T=8, seed=11, scale=0.5)
    cap = float(m2po_adaptive_cap(logp.detach() - old, adv, mask, tau=0.04))
    b = cap ** 0.5
    loss, m = m2po_loss(logp, old, adv, mask, variant="adaptive_clip", weights=w)
    exp = ref_grpo(logp, old, adv, mask, weights=w, lo=1 - torch.exp(torch.tensor(-b)).item(), hi=torch.exp(torch.tensor(b)).item() - 1)
    torch.testing.assert_close(loss.detach(), exp.detach(), rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(_grads(loss, logp), _grads(exp, logp), rtol=1e-6, atol=1e-9)
    assert float(m["actor/clipfrac"]) > 0
