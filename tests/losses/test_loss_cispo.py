"""CISPO (MiniMax-M1, arXiv 2506.13585) against its loop reference: values, gradients, metrics."""
import pytest
import torch

from loss_refs import AGGS, make_batch, ref_cispo
from offpolicy_moe.losses import (
    cispo_loss,
    get_loss_spec,
    get_policy_loss,
    grpo_loss,
    metrics_to_floats,
    resolve_loss_options,
)


def _check(logp, old, adv, mask, *, lo=None, hi=None, **kw):
    opts = {k: v for k, v in (("clip_low", lo), ("clip_high", hi)) if v is not None}
    got, metrics = cispo_loss(logp, old, adv, mask, **opts, **kw)
    exp = ref_cispo(logp, old, adv, mask, lo=lo, hi=4.0 if hi is None else hi, **kw)
    (g_got,) = torch.autograd.grad(got, logp)
    (g_exp,) = torch.autograd.grad(exp, logp)
    torch.testing.assert_close(got.detach(), exp.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(g_got, g_exp, rtol=1e-10, atol=1e-12)
    return metrics


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("per_token_adv", [False, True])
@pytest.mark.parametrize("use_weights", [False, True])
def test_cispo_matches_loop(agg, per_token_adv, use_weights):
    logp, old, adv, mask, w = make_batch(seed=11, scale=0.6, per_token_adv=per_token_adv)
    w = w if use_weights else None
    _check(logp, old, adv, mask, agg=agg, weights=w)
    _check(logp, old, adv, mask, agg=agg, weights=w, lo=0.2, hi=0.28)
    _check(logp, old, adv, mask, agg=agg, weights=w, lo=0.0, hi=0.0)


def test_cispo_global_counts():
    logp, old, adv, mask, w = make_batch(seed=12, scale=0.6)
    _check(logp, old, adv, mask, agg="token-mean", num_tokens=50, weights=w)
    _check(logp, old, adv, mask, agg="seq-mean-token-sum-norm", num_seqs=7, norm_length=16)


def test_every_valid_token_keeps_a_gradient_where_ppo_drops_it():
    """Ratios far outside the band: GRPO's clipped tokens get 0 gradient, CISPO's get -w A / N each."""
    logp, old, adv, mask, _ = make_batch(B=6, T=9, seed=13, scale=2.0, empty_row=False)
    adv = adv.sign() * (adv.abs() + 0.5)
    (g_ppo,) = torch.autograd.grad(grpo_loss(logp, old, adv, mask)[0], logp)
    loss, metrics = cispo_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    (g,) = torch.autograd.grad(loss, logp)
    assert bool((g_ppo[mask] == 0).any())               # PPO drops some tokens
    assert bool((g[mask] != 0).all())                   # CISPO keeps all of them
    assert bool((g[~mask] == 0).all())
    r = torch.exp(logp.detach() - old)
    w = r.clamp(0.8, 1.2)
    torch.testing.assert_close(g[mask], (-w * adv[:, None] / mask.sum())[mask])
    m = metrics_to_floats(metrics)
    assert m["actor/clipfrac"] == pytest.approx(float(((r < 0.8) | (r > 1.2))[mask].double().mean()))
    assert m["actor/clipfrac_high"] == pytest.approx(float((r > 1.2)[mask].double().mean()))


def test_registry_entry_and_options():
    spec = get_loss_spec("cispo")
    assert get_policy_loss("cispo") is cispo_loss
    assert spec.clips and not spec.sequence_level and not spec.needs_global_pass
    assert spec.options == ("clip_low", "clip_high")
    assert resolve_loss_options("cispo", {"clip_high": 2.0, "clip_low": None}) == {"clip_high": 2.0}
    with pytest.raises(ValueError, match=r"loss 'cispo' has no option 'clip_hihg' \(did you mean 'clip_high'\?\)"):
        resolve_loss_options("cispo", {"clip_hihg": 2.0})
    with pytest.raises(ValueError, match=r"loss 'cispo': clip_low must be < 1"):
        resolve_loss_options("cispo", {"clip_low": 1.0})
    logp, old, adv, mask, _ = make_batch(seed=14)
    with pytest.raises(ValueError, match="clip_high must be a finite number >= 0"):
        cispo_loss(logp, old, adv, mask, clip_high=-1.0)
