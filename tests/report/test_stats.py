"""Paired statistics against hand-computed values: pairing by seed, the Student-t interval, log-scale ratios and
every verdict branch."""
import math

import pytest

from offpolicy_moe.report.stats import (
    MARKER,
    N_TOO_SMALL,
    NO_RUNS,
    NOT_RESOLVED,
    OPPOSITE,
    REPRODUCED,
    compare,
    differences,
    format_comparison,
    pair_by_seed,
    t_interval,
    t_quantile,
    verdict,
)

# two-sided 95% Student-t critical values t_{0.975, df}, from a printed table
T975 = {1: 12.706205, 2: 4.302653, 4: 2.776445, 9: 2.262157, 29: 2.045230}


@pytest.mark.parametrize("df,t", sorted(T975.items()))
def test_t_quantile_matches_the_printed_table(df, t):
    assert t_quantile(df + 1) == pytest.approx(t, abs=1e-6)


def test_t_interval_of_1_2_3_by_hand():
    iv = t_interval([1.0, 2.0, 3.0])
    # mean 2, sample sd 1 (ddof 1), half width 4.302653 * 1 / sqrt(3) = 2.484138
    assert iv.n == 3 and iv.mean == 2.0 and iv.sd == pytest.approx(1.0)
    assert iv.t == pytest.approx(4.302653, abs=1e-6)
    assert iv.lo == pytest.approx(2 - 2.484138, abs=1e-6)
    assert iv.hi == pytest.approx(2 + 2.484138, abs=1e-6)
    assert not iv.excludes_zero


def test_t_interval_two_and_five_values_by_hand():
    iv = t_interval([0.5, 1.5])
    # mean 1, sd sqrt(0.5), half width 12.706205 * sqrt(0.5) / sqrt(2) = 6.3531025
    assert (iv.lo, iv.hi) == (pytest.approx(1 - 6.3531025, abs=1e-6), pytest.approx(1 + 6.3531025, abs=1e-6))
    xs = [0.3, 0.1, 0.4, 0.2, 0.5]
    iv = t_interval(xs)
    sd = math.sqrt(sum((x - 0.3) ** 2 for x in xs) / 4)       # sqrt(0.1 / 4) = 0.158114
    half = 2.776445 * sd / math.sqrt(5)                          # 0.196324
    assert iv.mean == pytest.approx(0.3) and iv.sd == pytest.approx(0.158114, abs=1e-6)
    assert iv.lo == pytest.approx(0.3 - half, abs=1e-6) and iv.hi == pytest.approx(0.3 + half, abs=1e-6)
    assert iv.lo == pytest.approx(0.103676, abs=1e-6) and iv.excludes_zero


def test_t_interval_small_n_and_zero_spread():
    assert t_interval([]) is None
    one = t_interval([0.7])
    assert one.mean == 0.7 and one.n == 1 and one.lo is None and one.hi is None and one.sd is None
    flat = t_interval([0.25, 0.25, 0.25])
    assert flat.sd == 0.0 and flat.lo == flat.hi == 0.25 and flat.excludes_zero
    with pytest.raises(ValueError, match="n >= 2"):
        t_quantile(1)


def test_pairing_drops_unmatched_seeds():
    p = pair_by_seed({"0": 1.0, "1": 2.0, "2": 3.0, "10": 4.0}, {"2": 1.5, "1": 0.5, "10": 1.0, "3": 9.0})
    assert p.seeds == ["1", "2", "10"]                         # numeric order, not "10" < "2"
    assert p.treatment == [2.0, 3.0, 4.0] and p.baseline == [0.5, 1.5, 1.0]
    assert p.only_treatment == ["0"] and p.only_baseline == ["3"] and p.unpaired == 2
    assert differences(p) == [1.5, 1.5, 3.0]
    c = compare({"0": 1.0, "1": 2.0, "2": 3.0, "10": 4.0}, {"2": 1.5, "1": 0.5, "10": 1.0, "3": 9.0})
    assert c.n == 3 and c.estimate == pytest.approx(2.0)        # mean of 1.5, 1.5, 3.0: the dropped seeds do not count
    assert c.treatment_mean == pytest.approx(3.0) and c.baseline_mean == pytest.approx(1.0)
    assert compare({"0": 1.0}, {"1": 1.0}).interval is None


def test_log_scale_reports_a_ratio_interval():
    t = {0: 1e-5, 1: 2e-5, 2: 4e-5}
    b = {0: 1e-3, 1: 1e-3, 2: 2e-3}
    c = compare(t, b, scale="log")
    d = [-2.0, math.log10(2e-2), math.log10(2e-2)]               # log10 of the per-seed ratios
    m = sum(d) / 3
    sd = math.sqrt(sum((x - m) ** 2 for x in d) / 2)
    half = 4.302653 * sd / math.sqrt(3)
    assert c.interval.mean == pytest.approx(m) and c.interval.lo == pytest.approx(m - half, abs=1e-6)
    assert c.estimate == pytest.approx(10 ** m) and c.estimate == pytest.approx(0.0159, abs=1e-4)
    assert c.lo == pytest.approx(10 ** (m - half), rel=1e-5) and c.hi == pytest.approx(10 ** (m + half), rel=1e-5)
    assert c.lo < c.estimate < c.hi < 1 and c.excludes_zero
    assert verdict(c, "lower") == REPRODUCED
    assert format_comparison(c) == f"×{10 ** m:.3g} [×{10 ** (m - half):.3g}, ×{10 ** (m + half):.3g}]{MARKER}"


@pytest.mark.parametrize("bad", [0.0, -1e-4])
def test_log_scale_refuses_non_positive_values(bad):
    with pytest.raises(ValueError, match=r"scale log needs values > 0, but the baseline of seed 1 is"):
        compare({0: 1.0, 1: 1.0}, {0: 1.0, 1: bad}, scale="log")
    with pytest.raises(ValueError, match="scale must be one of"):
        compare({0: 1.0}, {0: 1.0}, scale="ln")


def _cmp(diffs):
    return compare({i: d for i, d in enumerate(diffs)}, {i: 0.0 for i in range(len(diffs))})


def test_every_verdict_branch():
    up, down, unclear = _cmp([1.0, 1.2, 0.9]), _cmp([-1.0, -1.2, -0.9]), _cmp([1.0, -1.0, 0.5])
    assert up.lo > 0 and down.hi < 0 and unclear.lo < 0 < unclear.hi
    assert verdict(up, "higher") == REPRODUCED and verdict(down, "lower") == REPRODUCED
    assert verdict(up, "lower") == OPPOSITE and verdict(down, "higher") == OPPOSITE
    assert verdict(unclear, "higher") == NOT_RESOLVED and verdict(unclear, "lower") == NOT_RESOLVED
    assert verdict(_cmp([0.0, 0.0]), "higher") == NOT_RESOLVED      # a zero-width interval at 0 excludes nothing
    assert verdict(_cmp([5.0]), "higher") == N_TOO_SMALL
    assert verdict(compare({0: 1.0}, {1: 1.0}), "higher") == NO_RUNS
    assert verdict(None, "lower") == NO_RUNS
    with pytest.raises(ValueError, match="expect must be one of"):
        verdict(up, "up")


def test_format_comparison_marks_only_intervals_that_exclude_zero():
    assert format_comparison(_cmp([1.0, 2.0, 3.0])) == "+2 [-0.484, +4.48]"
    assert format_comparison(_cmp([0.3, 0.1, 0.4, 0.2, 0.5]), digits=2) == f"+0.3 [+0.1, +0.5]{MARKER}"
    assert format_comparison(_cmp([0.031])) == "+0.031"
    assert format_comparison(compare({0: 1.0}, {1: 1.0})) == "–"
