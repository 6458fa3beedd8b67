"""m2po_mask vs the literal greedy Algorithm 1; global selection over micro-batches; adaptive cap."""
import math

import pytest
import torch

from loss_refs import greedy_m2po, m2_value
from offpolicy_moe.losses import m2po_adaptive_cap, m2po_mask


def _batch(seed, B=6, T=9, grid=False, p_valid=0.8, per_token_adv=False):
    g = torch.Generator().manual_seed(seed)
    if grid:  # log-ratios on a k/8 grid: many exact ties, M2 values exact dyadic numbers
        lr = torch.randint(-6, 7, (B, T), generator=g).to(torch.float32) / 8
    else:
        lr = torch.randn(B, T, generator=g) * 0.3
    adv = torch.randn(B, T, generator=g) if per_token_adv else torch.randn(B, generator=g)
    adv[torch.rand(adv.shape, generator=g) < 0.15] = 0.0  # zero advantages: never trust-region
    mask = torch.rand(B, T, generator=g) < p_valid
    return lr, adv, mask


def _kept_tr_mean(lr, adv, mask, keep):
    a = adv if adv.dim() == 2 else adv[:, None].expand_as(lr)
    tr = mask & (((a > 0) & (lr > 0)) | ((a < 0) & (lr < 0)))
    vals = [m2_value(lr[i, t]) for i, t in zip(*torch.nonzero(tr & keep, as_tuple=True))]
    return (math.fsum(vals) / len(vals)) if vals else 0.0, int(tr.sum())


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("tau", [0.04, 0.015625, 0.003])
def test_mask_equals_greedy(seed, tau):
    grid = seed % 2 == 0
    lr, adv, mask = _batch(seed, grid=grid, per_token_adv=seed % 3 == 0)
    keep = m2po_mask(lr, adv, mask, tau=tau)
    expected = greedy_m2po(lr, adv, mask, tau)
    assert keep.dtype == torch.bool
    assert torch.equal(keep, expected)
    kept_mean, n_tr = _kept_tr_mean(lr, adv, mask, keep)
    assert kept_mean <= tau
    assert not bool((keep & ~mask).any())  # invalid positions never kept


def test_ties_remove_larger_flat_position_first():
    # four equal M2 = 1/16 values, tau = 1/32: no non-empty subset fits, all four are dropped
    lr = torch.tensor([[0.25, -0.25, 0.25, 0.25]])
    adv = torch.tensor([[1.0, -1.0, 1.0, 1.0]])
    mask = torch.ones(1, 4, dtype=torch.bool)
    assert m2po_mask(lr, adv, mask, tau=1 / 32).tolist() == [[False, False, False, False]]
    # M2 = 1/16, 1/256, 1/16, 1/16, 1/256 with tau = 3/128 (exact): exactly one 1/16 fits; the greedy
    # loop drops positions 3 then 2, so position 0 survives
    lr3 = torch.tensor([[0.25, 0.0625, 0.25, 0.25, 0.0625]])
    adv3 = torch.ones(1, 5)
    m3 = torch.ones(1, 5, dtype=torch.bool)
    keep3 = m2po_mask(lr3, adv3, m3, tau=3 / 128)
    assert keep3.tolist() == [[True, True, False, False, True]]
    assert torch.equal(keep3, greedy_m2po(lr3, adv3, m3, 3 / 128))
    # the running mean exactly equal to tau is kept (mean <= tau)
    assert m2po_mask(lr, adv, mask, tau=1 / 16).tolist() == [[True] * 4]


def test_no_trust_region_tokens_keeps_everything_valid():
    lr, adv, mask = _batch(3)
    a = adv[:, None].expand_as(lr)
    lr = torch.where(a > 0, -lr.abs(), lr.abs())  # ratio always moves against the advantage
    keep = m2po_mask(lr, adv, mask, tau=1e-9)
    assert torch.equal(keep, mask)
    assert float(m2po_adaptive_cap(lr, adv, mask, tau=1e-9)) == math.inf


def test_everything_in_budget_keeps_everything():
    lr, adv, mask = _batch(4)
    keep = m2po_mask(lr * 1e-3, adv, mask, tau=0.04)
    assert torch.equal(keep, mask)


def test_all_masked_and_empty():
    lr, adv, mask = _batch(5)
    assert not bool(m2po_mask(lr, adv, torch.zeros_like(mask), tau=0.04).any())
    e = torch.zeros(0, 4)
    assert m2po_mask(e, torch.zeros(0), torch.zeros(0, 4, dtype=torch.bool)).shape == (0, 4)


def test_float_mask_and_huge_log_ratios():
    lr, adv, mask = _batch(6)
    lr[0, :] = 1e4
    lr[2, :] = -1e4
    keep = m2po_mask(lr, adv, mask.double(), tau=0.04)
    assert torch.equal(keep, greedy_m2po(lr, adv, mask, 0.04))


@pytest.mark.parametrize("seed", range(6))
def test_micro_batch_list_selection_is_global(seed):
    lr, adv, mask = _batch(seed, B=10, T=7, grid=seed % 2 == 0)
    whole = m2po_mask(lr, adv, mask, tau=0.02)
    cuts = [0, 3, 4, 10]
    parts = m2po_mask(
        [lr[a:b] for a, b in zip(cuts, cuts[1:])],
        [adv[a:b] for a, b in zip(cuts, cuts[1:])],
        [mask[a:b] for a, b in zip(cuts, cuts[1:])],
        tau=0.02,
    )
    assert isinstance(parts, list) and len(parts) == 3
    assert torch.equal(torch.cat(parts), whole)
    assert torch.equal(whole, greedy_m2po(lr, adv, mask, 0.02))
    # micro-batches may be padded to different lengths: selection uses only valid tokens
    padded = [torch.nn.functional.pad(x, (0, 3)) for x in (lr[:5], lr[5:])]
    pm = [torch.nn.functional.pad(x, (0, 3)) for x in (mask[:5], mask[5:])]
    out = m2po_mask(padded, [adv[:5], adv[5:]], pm, tau=0.02)
    assert torch.equal(torch.cat([o[:, :7] for o in out]), whole)
    # a local (per micro-batch) selection generally differs; make sure the global one is tested
    local = torch.cat([m2po_mask(lr[a:b], adv[a:b], mask[a:b], tau=0.02) for a, b in zip(cuts, cuts[1:])])
    assert local.shape == whole.shape


def _brute_cap(lr, adv, mask, tau):
    a = adv if adv.dim() == 2 else adv[:, None].expand_as(lr)
    vals = [m2_value(lr[i, t]) for i in range(lr.shape[0]) for t in range(lr.shape[1])
            if mask[i, t] and ((a[i, t] > 0 and lr[i, t] > 0) or (a[i, t] < 0 and lr[i, t] < 0))]
    n = len(vals)
    if n == 0 or math.fsum(vals) <= tau * n:
        return math.inf
    lo, hi = 0.0, max(vals)
    for _ in range(200):  # bisection on the monotone f(c) = sum min(v, c)
        mid = (lo + hi) / 2
        if math.fsum(min(v, mid) for v in vals) <= tau * n:
            lo = mid
        else:
            hi = mid
    return lo


@pytest.mark.parametrize("seed", range(6))
def test_adaptive_cap_matches_bisection(seed):
    lr, adv, mask = _batch(seed, grid=seed % 2 == 1)
    for tau in (0.04, 0.005):
        got = float(m2po_adaptive_cap(lr, adv, mask, tau=tau))
        exp = _brute_cap(lr, adv, mask, tau)
        if math.isinf(exp):
            assert math.isinf(got)
        else:
            assert got == pytest.approx(exp, rel=1e-9, abs=1e-12)
    cuts = [0, 2, 6]
    parts = m2po_adaptive_cap([lr[a:b] for a, b in zip(cuts, cuts[1:])],
                              [adv[a:b] for a, b in zip(cuts, cuts[1:])],
                              [mask[a:b] for a, b in zip(cuts, cuts[1:])], tau=0.005)
    assert float(parts) == float(m2po_adaptive_cap(lr, adv, mask, tau=0.005))
