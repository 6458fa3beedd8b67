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
    compare_to_value,
    differences,
    format_comparison,
    margin_band,
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


# ------------------------------------------------------------------------------ equivalence (expect same, margin)
def test_same_within_a_margin_every_branch_by_hand():
    # diffs 0.01, 0.02, 0.03: mean 0.02, sd 0.01, half 4.302653 * 0.01 / sqrt(3) = 0.024841 -> [-0.004841, 0.044841]
    near = _cmp([0.01, 0.02, 0.03])
    assert near.lo == pytest.approx(-0.004841, abs=1e-6) and near.hi == pytest.approx(0.044841, abs=1e-6)
    assert verdict(near, "same", margin=0.05) == REPRODUCED        # inside [-0.05, 0.05]
    assert verdict(near, "same", margin=0.04) == NOT_RESOLVED      # hi 0.0448 pokes out of [-0.04, 0.04]
    # diffs 1.0, 1.2, 0.9: mean 1.033333, sd 0.152753, half 4.302653 * 0.152753 / sqrt(3) = 0.379458
    far = _cmp([1.0, 1.2, 0.9])
    assert far.lo == pytest.approx(0.653875, abs=1e-5) and far.hi == pytest.approx(1.412792, abs=1e-5)
    assert verdict(far, "same", margin=0.5) == OPPOSITE             # wholly above +0.5
    assert verdict(far, "same", margin=0.7) == NOT_RESOLVED         # straddles +0.7
    assert verdict(far, "same", margin=1.5) == REPRODUCED
    assert verdict(_cmp([-1.0, -1.2, -0.9]), "same", margin=0.5) == OPPOSITE   # wholly below -0.5
    flat = _cmp([0.25, 0.25, 0.25])                                 # a point interval at 0.25
    assert verdict(flat, "same", margin=0.25) == REPRODUCED        # the band is closed
    assert verdict(flat, "same", margin=0.2) == OPPOSITE
    assert verdict(_cmp([5.0]), "same", margin=1.0) == N_TOO_SMALL
    assert verdict(None, "same", margin=1.0) == NO_RUNS


def test_same_on_the_log_scale_takes_the_margin_as_a_ratio_factor():
    d = [0.01, 0.02, 0.03]                                           # log10 ratios, as above: [-0.004841, 0.044841]
    c = compare({i: 2.0 * 10 ** x for i, x in enumerate(d)}, {i: 2.0 for i in range(3)}, scale="log")
    assert c.lo == pytest.approx(10 ** -0.004841, rel=1e-5) and c.hi == pytest.approx(1.108769, rel=1e-5)
    assert margin_band(1.12, "log") == pytest.approx(0.049218, abs=1e-6)
    assert verdict(c, "same", margin=1.12) == REPRODUCED            # ratios [0.989, 1.109] inside [1/1.12, 1.12]
    assert verdict(c, "same", margin=1.1) == NOT_RESOLVED           # 1.109 > 1.1
    with pytest.raises(ValueError, match=r"margin on scale log is a ratio factor and must be > 1"):
        verdict(c, "same", margin=0.05)


def test_margin_is_required_for_same_and_refused_otherwise():
    up = _cmp([1.0, 1.2, 0.9])
    with pytest.raises(ValueError, match="expect same needs a margin"):
        verdict(up, "same")
    with pytest.raises(ValueError, match="a margin is only for expect same, not higher"):
        verdict(up, "higher", margin=0.1)
    for bad in (0, -0.1, float("nan"), "0.1", True):
        with pytest.raises(ValueError, match="margin must be a number > 0"):
            margin_band(bad)


# ------------------------------------------------------------------------------ one sample (baseline_value)
def test_one_sample_interval_by_hand():
    # skill ratios 0.7, 0.9, 0.8, 0.6, 0.5 vs 1: diffs -0.3, -0.1, -0.2, -0.4, -0.5, mean -0.3, sd 0.158114,
    # half 2.776445 * 0.158114 / sqrt(5) = 0.196324 -> [-0.496324, -0.103676]
    c = compare_to_value({0: 0.7, 1: 0.9, 2: 0.8, 3: 0.6, 4: 0.5}, 1.0)
    assert c.n == 5 and c.pairing.unpaired == 0 and c.baseline_value == 1.0
    assert c.estimate == pytest.approx(-0.3) and c.interval.sd == pytest.approx(0.158114, abs=1e-6)
    assert c.lo == pytest.approx(-0.496324, abs=1e-6) and c.hi == pytest.approx(-0.103676, abs=1e-6)
    assert c.treatment_mean == pytest.approx(0.7) and c.baseline_mean == 1.0
    assert verdict(c, "lower") == REPRODUCED and verdict(c, "higher") == OPPOSITE
    # 0.8, 0.9, 0.7 vs 1: diffs mean -0.2, sd 0.1, half 4.302653 * 0.1 / sqrt(3) = 0.248414 -> contains 0
    c3 = compare_to_value({"0": 0.8, "1": 0.9, "2": 0.7}, 1.0)
    assert c3.hi == pytest.approx(0.048414, abs=1e-6) and verdict(c3, "lower") == NOT_RESOLVED
    assert format_comparison(c3) == "-0.2 [-0.448, +0.0484]"
    assert verdict(compare_to_value({0: 0.5}, 1.0), "lower") == N_TOO_SMALL
    assert verdict(compare_to_value({}, 1.0), "lower") == NO_RUNS


def test_one_sample_on_the_log_scale_is_a_ratio_to_the_value():
    # 0.1, 0.01, 0.001 vs 1: log10 ratios -1, -2, -3: mean -2, sd 1, half 2.484138 -> ratios 10^-4.484138, 10^0.484138
    c = compare_to_value({0: 0.1, 1: 0.01, 2: 0.001}, 1.0, scale="log")
    assert c.estimate == pytest.approx(0.01) and c.lo == pytest.approx(3.27991e-5, rel=1e-4)
    assert c.hi == pytest.approx(3.048864, rel=1e-5) and verdict(c, "lower") == NOT_RESOLVED
    assert verdict(c, "same", margin=1e4) == NOT_RESOLVED           # log10 band ±4: lo -4.48 is below it
    assert verdict(c, "same", margin=1e5) == REPRODUCED             # ±5 holds [-4.48, +0.48]
    with pytest.raises(ValueError, match=r"baseline_value must be a finite number > 0 on scale log, got 0"):
        compare_to_value({0: 1.0, 1: 2.0}, 0, scale="log")
    with pytest.raises(ValueError, match=r"scale log needs values > 0, but the treatment of seed 1 is 0"):
        compare_to_value({0: 1.0, 1: 0.0}, 1.0, scale="log")
    with pytest.raises(ValueError, match=r"baseline_value must be a finite number, got nan"):
        compare_to_value({0: 1.0, 1: 2.0}, float("nan"))
