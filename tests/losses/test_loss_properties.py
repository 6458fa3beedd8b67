"""Property tests (hypothesis): no finite input gives NaN/Inf in a loss, gradient, weight or metric."""
import math
import warnings

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from offpolicy_moe.losses import (
    AGG_MODES,
    correction_weights,
    grpo_loss,
    gspo_loss,
    kl_penalty,
    m2po_loss,
    m2po_mask,
    metrics_to_floats,
    mismatch_metrics,
    unclipped_loss,
)

LOGP = st.floats(min_value=-1e4, max_value=1e4, allow_nan=False, allow_infinity=False, width=32)
ADV = st.floats(min_value=-100, max_value=100, allow_nan=False, allow_infinity=False, width=32)


@st.composite
def batches(draw):
    B = draw(st.integers(1, 4))
    T = draw(st.integers(1, 6))
    n = B * T
    logp = torch.tensor(draw(st.lists(LOGP, min_size=n, max_size=n)), dtype=torch.float32).view(B, T)
    old = torch.tensor(draw(st.lists(LOGP, min_size=n, max_size=n)), dtype=torch.float32).view(B, T)
    per_token = draw(st.booleans())
    k = n if per_token else B
    adv = torch.tensor(draw(st.lists(ADV, min_size=k, max_size=k)), dtype=torch.float32)
    adv = adv.view(B, T) if per_token else adv
    mask = torch.tensor(draw(st.lists(st.booleans(), min_size=n, max_size=n))).view(B, T)
    w = torch.tensor(draw(st.lists(st.floats(0, 10, width=32), min_size=n, max_size=n)), dtype=torch.float32).view(B, T)
    return logp, old, adv, mask, w


def _finite_metrics(m):
    return all(math.isfinite(v) for v in metrics_to_floats(m).values())


@settings(max_examples=60, deadline=None)
@given(batches(), st.sampled_from(AGG_MODES), st.sampled_from(["grpo", "gspo", "m2po", "m2po_clip", "unclipped"]),
       st.booleans())
def test_objectives_never_nan(batch, agg, name, use_w):
    logp, old, adv, mask, w = batch
    fn, opts = {
        "grpo": (grpo_loss, {"dual_clip": 3.0}),
        "gspo": (gspo_loss, {}),
        "m2po": (m2po_loss, {}),
        "m2po_clip": (m2po_loss, {"variant": "adaptive_clip"}),
        "unclipped": (unclipped_loss, {}),
    }[name]
    leaf = logp.clone().requires_grad_(True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss, metrics = fn(leaf, old, adv, mask, agg=agg, weights=w if use_w else None, **opts)
    (g,) = torch.autograd.grad(loss, leaf)
    assert torch.isfinite(loss) and torch.isfinite(g).all() and _finite_metrics(metrics)
    if not mask.any():
        assert float(loss.detach()) == 0.0 and bool((g == 0).all())


@settings(max_examples=60, deadline=None)
@given(batches(), st.sampled_from(["token", "sequence", "geometric"]), st.sampled_from(["truncate", "mask"]),
       st.sampled_from([(2.0, None), (5.0, 0.5), (1.0, 1.0)]))
def test_corrections_and_metrics_never_nan(batch, level, mode, bounds):
    logp, old, _, mask, _ = batch
    w, m = correction_weights(logp, old, mask, level=level, mode=mode, high=bounds[0], low=bounds[1])
    assert torch.isfinite(w).all() and bool((w >= 0).all()) and _finite_metrics(m)
    assert bool((w[~mask] == 0).all())
    assert _finite_metrics(mismatch_metrics(logp, old, mask))


@settings(max_examples=40, deadline=None)
@given(batches(), st.sampled_from(["k1", "k2", "k3", "k3+"]))
def test_kl_never_nan(batch, kind):
    logp, ref, _, mask, _ = batch
    leaf = logp.clone().requires_grad_(True)
    out = kl_penalty(leaf, ref, kind, mask=mask)
    (g,) = torch.autograd.grad(out.sum(), leaf)
    assert torch.isfinite(out).all() and torch.isfinite(g).all()


@settings(max_examples=60, deadline=None)
@given(batches(), st.floats(1e-6, 10.0))
def test_m2po_mask_invariants(batch, tau):
    logp, old, adv, mask, _ = batch
    lr = logp - old
    keep = m2po_mask(lr, adv, mask, tau=tau)
    a = adv if adv.dim() == 2 else adv[:, None].expand_as(lr)
    tr = mask & (((a > 0) & (lr > 0)) | ((a < 0) & (lr < 0)))
    assert torch.equal(keep & ~tr, mask & ~tr)  # non-trust-region valid tokens always kept
    assert not bool((keep & ~mask).any())
    m2 = lr.clamp(-20, 20).double() ** 2
    kept = m2[tr & keep]
    if kept.numel():
        assert float(kept.sum()) <= tau * kept.numel() * (1 + 1e-9)
    dropped = m2[tr & ~keep]
    if dropped.numel() and kept.numel():
        assert float(dropped.min()) >= float(kept.max())  # the largest values go first


def test_long_sequences_extreme_log_ratios():
    T = 10_000
    logp = torch.full((2, T), 1e4)
    old = torch.full((2, T), -1e4)
    old[1] = 3e4
    mask = torch.ones(2, T, dtype=torch.bool)
    adv = torch.tensor([1.0, -1.0])
    for fn, opts in ((gspo_loss, {}), (grpo_loss, {}), (m2po_loss, {}), (unclipped_loss, {}),
                     (m2po_loss, {"variant": "adaptive_clip"})):
        for agg in AGG_MODES:
            leaf = logp.clone().requires_grad_(True)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                loss, m = fn(leaf, old, adv, mask, agg=agg, **opts)
            (g,) = torch.autograd.grad(loss, leaf)
            assert torch.isfinite(loss) and torch.isfinite(g).all() and _finite_metrics(m), (fn.__name__, agg)
