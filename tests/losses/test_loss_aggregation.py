"""aggregate() and group_advantages() against loops; split batches with global counts."""
import math

import pytest
import torch

from loss_refs import AGGS, agg_loop
from offpolicy_moe.losses import aggregate, global_counts, group_advantages


def _data(seed, B=6, T=8):
    g = torch.Generator().manual_seed(seed)
    L = torch.randn(B, T, generator=g, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(B, T, generator=g) < 0.6
    mask[2] = False
    return L, mask


@pytest.mark.parametrize("mode", AGGS)
def test_aggregate_matches_loop(mode):
    L, mask = _data(0)
    lists = [[L[i, t] for t in range(L.shape[1])] for i in range(L.shape[0])]
    for kw in ({}, {"num_tokens": 50, "num_seqs": 11, "norm_length": 20}):
        got = aggregate(L, mask, mode, **kw)
        exp = agg_loop(lists, mask, mode, **kw)
        torch.testing.assert_close(got, exp)
        torch.testing.assert_close(torch.autograd.grad(got, L)[0], torch.autograd.grad(exp, L)[0])


def test_masked_positions_with_nan_do_not_leak():
    L, mask = _data(1)
    bad = L.detach().clone()
    bad[~mask] = math.nan
    bad.requires_grad_(True)
    for mode in AGGS:
        out = aggregate(bad, mask, mode)
        (g,) = torch.autograd.grad(out, bad)
        assert torch.isfinite(out) and torch.isfinite(g).all()


@pytest.mark.parametrize("mode", AGGS)
def test_split_micro_batches_with_global_counts_sum_to_whole(mode):
    L, mask = _data(2, B=9, T=8)
    whole = aggregate(L, mask, mode, norm_length=8)
    (g_whole,) = torch.autograd.grad(whole, L)
    cuts = [0, 2, 3, 7, 9]
    mbs = [mask[a:b] for a, b in zip(cuts, cuts[1:])]
    n_tok, n_seq = global_counts(mbs)
    assert int(n_tok) == int(mask.sum()) and int(n_seq) == int(mask.any(-1).sum())
    total = sum(aggregate(L[a:b], mask[a:b], mode, num_tokens=n_tok, num_seqs=n_seq, norm_length=8)
                for a, b in zip(cuts, cuts[1:]))
    (g_split,) = torch.autograd.grad(total, L)
    torch.testing.assert_close(total, whole)
    torch.testing.assert_close(g_split, g_whole)
    # local counts give a different (biased) answer: the global counts matter in this test
    local = sum(aggregate(L[a:b], mask[a:b], mode, norm_length=8) for a, b in zip(cuts, cuts[1:]))
    assert not torch.allclose(local, whole)


def test_all_masked_gives_zero_loss_and_zero_grad():
    L, mask = _data(3)
    for mode in AGGS:
        out = aggregate(L, torch.zeros_like(mask), mode)
        (g,) = torch.autograd.grad(out, L)
        assert float(out.detach()) == 0.0 and bool((g == 0).all())


def test_unknown_mode_lists_valid_modes():
    L, mask = _data(4)
    with pytest.raises(ValueError, match="seq-mean-token-mean"):
        aggregate(L, mask, "token-sum")


def _ref_adv(rewards, groups, norm, eps):
    out = []
    for i, r in enumerate(rewards):
        grp = [rewards[j] for j in range(len(rewards)) if groups[j] == groups[i]]
        n = len(grp)
        mean = math.fsum(grp) / n
        if n < 2 or max(grp) == min(grp):
            out.append(0.0)
            continue
        std = math.sqrt(math.fsum((x - mean) ** 2 for x in grp) / (n - 1))
        out.append((r - mean) / (std + eps) if norm == "std" else r - mean)
    return out


@pytest.mark.parametrize("norm", ["std", "none"])
def test_group_advantages_match_loop(norm):
    g = torch.Generator().manual_seed(0)
    groups = torch.tensor([7, 7, 7, 3, 3, 3, 3, 11, 5, 5, 9, 9, 9])  # size-1 group 11; unsorted ids
    rewards = torch.rand(len(groups), generator=g)
    rewards[10:13] = 0.1  # all-equal group (0.1 is not exact in binary: the mean is not exactly 0.1)
    adv, m = group_advantages(rewards, groups, norm=norm, return_metrics=True)
    exp = _ref_adv(rewards.tolist(), groups.tolist(), norm, 1e-6)
    torch.testing.assert_close(adv, torch.tensor(exp, dtype=adv.dtype))
    assert adv[7] == 0 and bool((adv[10:13] == 0).all())
    assert float(m["reward/frac_zero_std"]) == pytest.approx(2 / 5)
    assert group_advantages(rewards, groups, norm=norm).shape == rewards.shape


def test_group_advantages_bad_input():
    with pytest.raises(ValueError, match=r"\(3,\).*\(4,\)"):
        group_advantages(torch.zeros(3), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="norm"):
        group_advantages(torch.zeros(3), torch.zeros(3, dtype=torch.long), norm="batch")
    with pytest.raises(TypeError, match="integer"):
        group_advantages(torch.zeros(3), torch.zeros(3))
    with pytest.raises(ValueError, match="NaN"):
        group_advantages(torch.tensor([1.0, math.nan]), torch.zeros(2, dtype=torch.long))
