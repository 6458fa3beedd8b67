"""pass@k, avg@n and maj@k against brute force over every k-subset, pass@k's unbiasedness in simulation, and the
one-line errors."""
from __future__ import annotations

import itertools
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from offpolicy_moe.tasks.sampled_metrics import (SUBSETS, _subsets, avg_at_n, maj_at_k, majority_correct, pass_at_k,
                                                 report_ks)


def _brute_pass(n: int, c: int, k: int) -> Fraction:
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(samples, k))
    return Fraction(sum(any(s) for s in subsets), len(subsets))


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 12).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n), st.integers(1, n))))
def test_pass_at_k_is_the_share_of_k_subsets_holding_a_correct_sample(nck):
    n, c, k = nck
    assert pass_at_k(n, c, k) == pytest.approx(float(_brute_pass(n, c, k)), abs=1e-12)


def test_pass_at_1_is_the_share_correct_and_pass_at_n_is_any_correct():
    assert pass_at_k(16, 5, 1) == pytest.approx(5 / 16)
    assert pass_at_k(16, 1, 16) == 1.0 and pass_at_k(16, 0, 16) == 0.0
    assert pass_at_k(4, 1, 4) == 1.0          # best@k's 1 of 4 scores 1.0 at k = n ...
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)      # ... and half the 2-subsets hold the correct one


@pytest.mark.parametrize("n", [1, 4, 16])
@pytest.mark.parametrize("p", [0.0, 0.02, 0.35, 0.8, 1.0])
def test_pass_at_k_is_unbiased_exactly(n, p):
    """E[pass@k] over c ~ Binomial(n, p) is 1 - (1 - p)^k exactly (the expectation summed over every c)."""
    from math import comb

    for k in report_ks(n):
        mean = sum(comb(n, c) * p ** c * (1 - p) ** (n - c) * pass_at_k(n, c, k) for c in range(n + 1))
        assert mean == pytest.approx(1 - (1 - p) ** k, abs=1e-12)


def test_pass_at_k_is_unbiased_in_simulation():
    """Problems with known rates p, each drawn n times, many times over: the mean estimate is 1 - (1 - p)^k within
    4 standard errors (taken from the estimator's exact variance over the binomial)."""
    from math import comb

    rng = np.random.default_rng(0)
    n, draws = 8, 20000
    for p in (0.02, 0.1, 0.35, 0.8):
        c = rng.binomial(n, p, size=draws)
        for k in (1, 2, 4, 8):
            est = np.array([pass_at_k(n, int(ci), k) for ci in c])
            truth = 1 - (1 - p) ** k
            second = sum(comb(n, j) * p ** j * (1 - p) ** (n - j) * pass_at_k(n, j, k) ** 2 for j in range(n + 1))
            se = np.sqrt(max(second - truth ** 2, 0.0) / draws)
            assert abs(est.mean() - truth) <= 4 * se + 1e-12, (p, k, est.mean(), truth)


@pytest.mark.parametrize("args, match", [((4, 1, 5), r"1 <= k <= n, got k=5 with n=4"),
                                         ((4, 5, 2), r"0 <= c <= n"), ((0, 0, 1), r"n >= 1"),
                                         ((4, 1, 0), r"1 <= k <= n")])
def test_bad_counts_are_one_line(args, match):
    with pytest.raises(ValueError, match=match) as err:
        pass_at_k(*args)
    assert "\n" not in str(err.value)


def test_avg_at_n():
    assert avg_at_n([True, False, False, True]) == 0.5
    with pytest.raises(ValueError):
        avg_at_n([])


def test_majority_vote_counts_answers_not_samples_and_ignores_no_answer():
    assert majority_correct(["7", "7", "8"], [True, True, False])
    assert not majority_correct(["8", "8", "7", None, None], [False, False, True, False, False])
    assert majority_correct([None, None, "7"], [False, False, True])          # no answer casts no vote
    assert not majority_correct([None, None], [False, False])                # no vote at all: wrong
    assert majority_correct(["7", "8"], [True, False]) and not majority_correct(["8", "7"], [False, True])  # tie: first
    with pytest.raises(ValueError, match="scored both right and wrong"):
        majority_correct(["7", "7"], [True, False])


def _brute_maj(answers, correct, k) -> float:
    subsets = list(itertools.combinations(range(len(answers)), k))
    return sum(majority_correct([answers[i] for i in s], [correct[i] for i in s]) for s in subsets) / len(subsets)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.sampled_from(["1", "2", "3", None]), min_size=1, max_size=9), st.data())
def test_maj_at_k_is_the_mean_vote_over_k_subsets(answers, data):
    correct = [a == "2" for a in answers]
    k = data.draw(st.integers(1, len(answers)))
    assert maj_at_k(answers, correct, k) == pytest.approx(_brute_maj(answers, correct, k), abs=1e-12)
    assert maj_at_k(answers, correct, len(answers)) == float(majority_correct(answers, correct))


def test_maj_at_k_over_many_subsets_is_a_seeded_sample_near_the_exact_value():
    rng = np.random.default_rng(1)
    answers = [str(x) for x in rng.integers(0, 3, size=24)]
    correct = [a == "0" for a in answers]
    exact = _brute_maj(answers, correct, 5)                 # C(24, 5) = 42504 > SUBSETS
    got = maj_at_k(answers, correct, 5, seed=3)
    assert got == maj_at_k(answers, correct, 5, seed=3)
    assert abs(got - exact) < 4 * 0.5 / np.sqrt(SUBSETS)


def test_report_ks():
    assert report_ks(16) == [1, 2, 4, 8, 16]
    assert report_ks(12) == [1, 2, 4, 8, 12]
    assert report_ks(1) == [1]


def test_maj_at_k_refuses_answers_and_flags_of_different_lengths():
    with pytest.raises(ValueError, match="2 answers but 1 correctness flags"):
        maj_at_k(["1", "2"], [True], 1)


def test_check_ks_defaults_to_report_ks_and_refuses_k_above_n_in_one_line():
    from offpolicy_moe.tasks.sampled_metrics import check_ks

    assert check_ks(8) == [1, 2, 4, 8] and check_ks(6) == [1, 2, 4, 6]
    assert check_ks(6, [4, 1, 4]) == [1, 4]
    for n, ks, match in ((4, [2, 8], r"k=8 with n=4"), (4, [0], r"k=0 with n=4"), (0, None, r"n >= 1")):
        with pytest.raises(ValueError, match=match) as err:
            check_ks(n, ks)
        assert "\n" not in str(err.value)


@settings(max_examples=60, deadline=None)
@given(answers=st.lists(st.sampled_from([None, "1", "2", "3", "4"]), min_size=12, max_size=20),
       data=st.data())
def test_vectorised_maj_at_k_equals_the_vote_subset_by_subset(answers, data):
    """Where the subsets are a seeded sample (C(n, k) > SUBSETS) as where they are all enumerated: the same value as
    :func:`majority_correct` over each of the subsets, one by one."""
    k = data.draw(st.integers(1, len(answers)))
    right = {"1": True, "2": False, "3": False, "4": data.draw(st.booleans())}
    correct = [a is not None and right[a] for a in answers]
    subsets = _subsets(len(answers), k, 0)
    want = sum(majority_correct([answers[i] for i in s], [correct[i] for i in s]) for s in subsets) / len(subsets)
    assert maj_at_k(answers, correct, k) == want
