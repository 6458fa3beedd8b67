"""Every loss is finite for every finite input of every float dtype (float16 included)."""
import math
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from offpolicy_moe.losses import (
    AGG_MODES,
    correction_weights,
    get_policy_loss,
    grpo_loss,
    kl_penalty,
    list_policy_losses,
    metrics_to_floats,
    ratio_bound,
)

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
F16_MAX = 65504.0
VALUES = st.floats(min_value=-F16_MAX, max_value=F16_MAX, allow_nan=False, allow_infinity=False, width=32)
SMALL = st.floats(min_value=-30.0, max_value=30.0, allow_nan=False, allow_infinity=False, width=32)


@st.composite
def batches(draw):
    """A batch whose values are finite in EVERY dtype (all lie within float16's range)."""
    B, T = draw(st.integers(1, 3)), draw(st.integers(1, 5))
    n = B * T
    pick = st.one_of(VALUES, SMALL)
    logp = torch.tensor(draw(st.lists(pick, min_size=n, max_size=n))).view(B, T)
    old = torch.tensor(draw(st.lists(pick, min_size=n, max_size=n))).view(B, T)
    adv = torch.tensor(draw(st.lists(st.floats(-1.0, 1.0, width=32), min_size=B, max_size=B)))
    big_adv = torch.tensor(draw(st.lists(VALUES, min_size=B, max_size=B)))
    mask = torch.tensor(draw(st.lists(st.booleans(), min_size=n, max_size=n))).view(B, T)
    w = torch.tensor(draw(st.lists(st.floats(0.0, 2.0, width=32), min_size=n, max_size=n))).view(B, T)
    return logp, old, adv, big_adv, mask, w


def _run(name, logp, old, adv, mask, w, agg):
    leaf = logp.clone().requires_grad_(True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss, metrics = get_policy_loss(name)(leaf, old, adv, mask, agg=agg, weights=w)
    (g,) = torch.autograd.grad(loss, leaf)
    return loss, g, metrics_to_floats(metrics)


@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=20, deadline=None)
@given(batch=batches(), agg=st.sampled_from(AGG_MODES), name=st.sampled_from(sorted(list_policy_losses())),
       use_w=st.booleans())
def test_losses_finite_for_finite_input_in_every_dtype(dtype, batch, agg, name, use_w):
    logp, old, adv, big_adv, mask, w = (t.to(dtype) if t.is_floating_point() else t for t in batch)
    w = w if use_w else None
    # |A| <= 1, weights <= 2: loss, gradient and metrics are finite
    loss, g, m = _run(name, logp, old, adv, mask, w, agg)
    assert torch.isfinite(loss), (name, dtype, float(loss))
    assert torch.isfinite(g).all(), (name, dtype, g)
    assert all(math.isfinite(v) for v in m.values()), (name, dtype, m)
    # any finite advantage of the dtype: the loss is finite and no gradient is NaN (an overflow to
    # inf of a float16 gradient is what loss scaling detects)
    loss, g, _ = _run(name, logp, old, big_adv, mask, w, agg)
    assert torch.isfinite(loss), (name, dtype, float(loss))
    assert not torch.isnan(g).any(), (name, dtype, g)


@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=15, deadline=None)
@given(batch=batches(), kind=st.sampled_from(["k1", "k2", "k3", "k3+"]),
       level=st.sampled_from(["token", "sequence", "geometric"]), mode=st.sampled_from(["truncate", "mask"]))
def test_kl_and_correction_weights_finite_in_every_dtype(dtype, batch, kind, level, mode):
    logp, old, _, _, mask, _ = (t.to(dtype) if t.is_floating_point() else t for t in batch)
    kl = kl_penalty(logp, old, kind, mask=mask)
    assert torch.isfinite(kl).all(), (kind, dtype, kl)
    w, m = correction_weights(old, logp, mask, level=level, mode=mode, high=1e30 if mode == "mask" else 2.0)
    assert torch.isfinite(w).all(), (level, mode, dtype, w)
    assert all(math.isfinite(v) for v in metrics_to_floats(m).values())


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_float16_log_ratio_of_12_is_finite(sign):
    """The reported case: a log-ratio of 12 in float16 gave loss inf (A<0) and a NaN gradient (A>0)."""
    logp = torch.tensor([[0.0, -1.0]], dtype=torch.float16, requires_grad=True)
    old = torch.tensor([[-12.0, -1.0]], dtype=torch.float16)
    loss, _ = grpo_loss(logp, old, torch.tensor([sign], dtype=torch.float16), torch.ones(1, 2, dtype=torch.bool))
    (g,) = torch.autograd.grad(loss, logp)
    assert torch.isfinite(loss) and torch.isfinite(g).all()
    assert ratio_bound(torch.float16) == pytest.approx(math.log(F16_MAX) - 1)
    assert ratio_bound(torch.float32) == ratio_bound(torch.bfloat16) == ratio_bound(torch.float64) == 20.0
