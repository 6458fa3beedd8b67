"""Every registered objective agrees, in value and gradient, with its plain-autograd reference body
(offpolicy_moe.losses.reference): the fast path (closed-form gradient or checked body) computes the paper's formula."""
import warnings

import pytest
import torch

from loss_refs import AGGS, make_batch
from offpolicy_moe.losses import get_loss_spec, list_policy_losses, m2po_adaptive_cap, m2po_mask

OPTIONS = {
    "grpo": [{}, {"clip_low": 0.1, "clip_high": 0.28, "dual_clip": 1.5}],
    "gspo": [{}, {"clip_low": 0.05, "clip_high": 0.1}],
    "unclipped": [{}],
    "cispo": [{}, {"clip_low": 0.1, "clip_high": 0.2}],
    "m2po": [{"tau": 0.01}, {"tau": 0.01, "variant": "adaptive_clip"}],
    "dppo_tv": [{}, {"delta_low": 0.02, "delta_high": 0.05, "ratio_cap": 1.2}],
    "dppo_kl": [{}, {"delta_low": 0.005, "delta_high": 0.01, "ratio_cap": 1.2}],
    "sapo": [{}, {"tau_pos": 2.0, "tau_neg": 3.0}],
    "gmpo": [{}, {"clip_low": 0.05, "clip_high": 0.1}],
    "vespo": [{}, {"k_pos": 1.0, "lambda_pos": 0.5, "k_neg": 4.0, "lambda_neg": 5.0, "fold_weights": False}],
}


def test_every_registered_loss_has_a_reference_and_test_options():
    for name in list_policy_losses():
        assert get_loss_spec(name).reference is not None, name
        assert name in OPTIONS, name


def _selection(name, opts, logp, old, adv, mask):
    if name != "m2po":
        return {}
    lr = logp.detach() - old
    if opts.get("variant") == "adaptive_clip":
        return {"m2po_cap": m2po_adaptive_cap(lr, adv, mask, tau=opts["tau"])}
    return {"m2po_keep": m2po_mask(lr, adv, mask, tau=opts["tau"])}


@pytest.mark.parametrize("name", sorted(OPTIONS))
@pytest.mark.parametrize("agg", AGGS)
def test_fast_path_equals_reference_body(name, agg):
    spec = get_loss_spec(name)
    for seed, per_token in ((0, False), (1, True)):
        logp, old, adv, mask, w = make_batch(B=6, T=9, seed=seed, scale=0.4, per_token_adv=per_token)
        with torch.no_grad():   # probabilities spread over (0, 1) so that the DPPO masks bite
            logp.copy_(torch.log(torch.rand(6, 9, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)))
            old.copy_(logp + 0.4 * torch.randn(6, 9, generator=torch.Generator().manual_seed(seed + 9),
                                               dtype=torch.float64)).clamp_(max=-1e-3)
        for opts in OPTIONS[name]:
            for weights in (None, w):
                kw = dict(agg=agg, weights=weights, num_tokens=40 if seed else None, num_seqs=7 if seed else None,
                          norm_length=12.0)
                sel = _selection(name, opts, logp, old, adv, mask)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    got, _ = spec.fn(logp, old, adv, mask, **kw, **opts, **sel)
                exp = spec.reference(logp, old, adv, mask, **kw, **opts, **sel)
                (g_got,) = torch.autograd.grad(got, logp)
                (g_exp,) = torch.autograd.grad(exp, logp)
                torch.testing.assert_close(got.detach(), exp.detach(), rtol=1e-12, atol=1e-12)
                torch.testing.assert_close(g_got, g_exp, rtol=1e-12, atol=1e-13)
                assert g_got.abs().sum() > 0, (name, agg, opts)


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_reference_agrees_in_float32(name):
    spec = get_loss_spec(name)
    logp, old, adv, mask, w = make_batch(B=4, T=6, seed=3, scale=0.3)
    logp = logp.detach().float().requires_grad_(True)
    old, adv, w = old.float(), adv.float(), w.float()
    opts = OPTIONS[name][-1]
    sel = _selection(name, opts, logp, old, adv, mask)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got, _ = spec.fn(logp, old, adv, mask, weights=w, **opts, **sel)
    exp = spec.reference(logp, old, adv, mask, weights=w, **opts, **sel)
    (g_got,) = torch.autograd.grad(got, logp)
    (g_exp,) = torch.autograd.grad(exp, logp)
    torch.testing.assert_close(got.detach(), exp.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g_got, g_exp, rtol=1e-5, atol=1e-6)
