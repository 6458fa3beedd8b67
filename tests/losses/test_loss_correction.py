"""TIS / MIS / IcePop weights, mismatch metrics and KL estimators against loops."""
import math

import pytest
import torch

from loss_refs import ref_correction
from offpolicy_moe.losses import correction_weights, kl_penalty, metrics_to_floats, mismatch_metrics


def _data(seed, B=6, T=9, scale=0.6):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 4
    behav = old + scale * torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = torch.rand(B, T, generator=g) < 0.75
    mask[3] = False
    return old, behav, mask


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
@pytest.mark.parametrize("mode", ["truncate", "mask"])
@pytest.mark.parametrize("bounds", [(2.0, None), (5.0, 0.5), (1.2, 0.9)])
def test_correction_matches_loop(level, mode, bounds):
    high, low = bounds
    scale = 0.6 if level == "token" else 0.15
    old, behav, mask = _data(len(level) * 7 + len(mode), scale=scale)
    w, m = correction_weights(old, behav, mask, level=level, mode=mode, high=high, low=low)
    W, rm = ref_correction(old, behav, mask, level, mode, high, low)
    torch.testing.assert_close(w, W.to(w.dtype))
    assert not w.requires_grad
    mf = metrics_to_floats(m)
    key = "mismatch/clipped_frac" if mode == "truncate" else "mismatch/masked_frac"
    assert mf[key] == pytest.approx(rm["changed"])
    for k in ("mismatch/is_mean", "mismatch/is_max", "mismatch/is_min", "mismatch/ess"):
        assert mf[k] == pytest.approx(rm[k], rel=1e-5, abs=1e-7), k


def test_correction_exercises_both_sides():
    old, behav, mask = _data(1)
    _, m = correction_weights(old, behav, mask, mode="mask", high=1.5, low=0.7)
    assert 0 < float(m["mismatch/masked_frac"]) < 1


def test_sequence_level_long_sequences_stay_finite():
    T = 10_000
    old = torch.zeros(2, T)
    behav = torch.full((2, T), -1e4)
    behav[1] = 1e4
    mask = torch.ones(2, T, dtype=torch.bool)
    for level in ("sequence", "geometric", "token"):
        for mode in ("truncate", "mask"):
            w, m = correction_weights(old, behav, mask, level=level, mode=mode, high=2.0, low=0.5)
            assert torch.isfinite(w).all()
            assert all(math.isfinite(v) for v in metrics_to_floats(m).values())
    w, _ = correction_weights(old, behav, mask, level="sequence", mode="truncate", high=2.0)
    assert float(w[0, 0]) == 2.0 and float(w[1, 0]) == pytest.approx(math.exp(-20), rel=1e-5)


def test_mismatch_metrics_match_loop():
    train, infer, mask = _data(2, scale=0.8)
    m = metrics_to_floats(mismatch_metrics(train, infer, mask))
    ds = [float(train[i, t] - infer[i, t]) for i in range(6) for t in range(9) if mask[i, t]]
    n = len(ds)
    assert m["mismatch/k3_kl"] == pytest.approx(sum(math.exp(d) - 1 - d for d in ds) / n, rel=1e-6)
    assert m["mismatch/k1_kl"] == pytest.approx(sum(-d for d in ds) / n, rel=1e-6)
    ext = sum(1 for d in ds if max(math.exp(d), math.exp(-d)) > 2) / n
    assert ext > 0 and m["mismatch/extreme_frac"] == pytest.approx(ext)
    assert m["mismatch/ratio_max"] == pytest.approx(max(math.exp(d) for d in ds), rel=1e-6)
    assert m["mismatch/ratio_min"] == pytest.approx(min(math.exp(d) for d in ds), rel=1e-6)
    assert m["mismatch/ratio_mean"] == pytest.approx(sum(math.exp(d) for d in ds) / n, rel=1e-6)
    empty = metrics_to_floats(mismatch_metrics(train, infer, torch.zeros_like(mask)))
    assert all(v == 0.0 for v in empty.values())


def test_correction_bad_options():
    old, behav, mask = _data(3)
    with pytest.raises(ValueError, match="level"):
        correction_weights(old, behav, mask, level="seq")
    with pytest.raises(ValueError, match="mode"):
        correction_weights(old, behav, mask, mode="clip")
    with pytest.raises(ValueError, match="high"):
        correction_weights(old, behav, mask, high=-1.0)
    with pytest.raises(ValueError, match="low"):
        correction_weights(old, behav, mask, low=-0.1)
    with pytest.raises(ValueError, match="exceed"):
        correction_weights(old, behav, mask, low=3.0, high=2.0)
    with pytest.raises(ValueError, match=r"\(6, 9\).*\(6, 8\)"):
        correction_weights(old, behav[:, :8], mask)


@pytest.mark.parametrize("kind", ["k1", "k2", "k3", "k3+"])
def test_kl_estimators_match_formulas(kind):
    g = torch.Generator().manual_seed(0)
    logp = (-torch.rand(4, 5, generator=g, dtype=torch.float64) * 3).requires_grad_(True)
    ref = logp.detach() + torch.randn(4, 5, generator=g, dtype=torch.float64)
    out = kl_penalty(logp, ref, kind)
    (grad,) = torch.autograd.grad(out.sum(), logp)
    for i in range(4):
        for t in range(5):
            d = float(logp[i, t].detach()) - float(ref[i, t])
            value = {"k1": d, "k2": 0.5 * d * d, "k3": math.exp(-d) + d - 1, "k3+": math.exp(-d) + d - 1}[kind]
            slope = {"k1": 1.0, "k2": d, "k3": 1 - math.exp(-d), "k3+": d}[kind]
            assert float(out[i, t].detach()) == pytest.approx(value, rel=1e-12, abs=1e-14)
            assert float(grad[i, t]) == pytest.approx(slope, rel=1e-12, abs=1e-14)
    masked = kl_penalty(logp, ref, kind, mask=torch.zeros(4, 5, dtype=torch.bool))
    assert bool((masked == 0).all())
    with pytest.raises(ValueError, match="k3\\+"):
        kl_penalty(logp, ref, "low_var")
    big = kl_penalty(torch.full((1, 3), 1e4), torch.full((1, 3), -1e4), kind)
    assert torch.isfinite(big).all()
