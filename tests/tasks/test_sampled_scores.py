"""Sampled scoring with a task's answer check: unscorable references are excluded and counted, answerless responses
counted apart and wrong, equivalent answers vote together, and neither changes the metrics of the other problems;
the math reward never pays for a reference math-verify cannot read."""
from __future__ import annotations

import math

import pytest

from offpolicy_moe.tasks.answer_check import ExactCheck, MathCheck, answer_check
from offpolicy_moe.tasks.custom_rewards import RewardSet
from offpolicy_moe.tasks.math_answer import MathVerifier
from offpolicy_moe.tasks.reward_specs import RewardSpec
from offpolicy_moe.tasks.sampled_metrics import pass_at_k
from offpolicy_moe.tasks.sampled_scores import sampled_metrics, score_samples

N = 4
# problem 0: 2 of 4 right, one without an answer; problem 1: 0 right; problem 2: 4 right
SCORABLE = (["12", "12", "<eos>", "13"], ["5", "6", "6", "  "], ["7", "7", "7", "7<eos><pad>"])
REFS = ["12", "4", "7"]


def test_exact_scoring_counts_and_metrics():
    scores = score_samples(ExactCheck(), [c for p in SCORABLE for c in p], REFS, N)
    assert scores.correct == [[True, True, False, False], [False] * 4, [True] * 4]
    assert scores.no_answer == 2 and scores.unscorable == []
    m = sampled_metrics(scores)
    assert m["eval/avg@4"] == pytest.approx((0.5 + 0 + 1) / 3)
    assert m["eval/pass@2"] == pytest.approx((pass_at_k(4, 2, 2) + 0 + 1) / 3)
    assert m["eval/maj@4"] == pytest.approx((1 + 0 + 1) / 3)        # "12" twice beats "13"; "6" twice is wrong
    assert m["eval/no_answer"] == 2 and m["eval/unscorable_refs"] == 0 and m["eval/scored_problems"] == 3


def test_unscorable_references_are_excluded_and_counted_and_change_nothing_else():
    with_bad = list(SCORABLE[:1]) + [["1", "", "2", "3"]] + list(SCORABLE[1:]) + [["9"] * 4]
    refs = ["12", "   ", "4", "7", ""]
    scores = score_samples(ExactCheck(), [c for p in with_bad for c in p], refs, N)
    assert scores.unscorable == [1, 4]
    clean = sampled_metrics(score_samples(ExactCheck(), [c for p in SCORABLE for c in p], REFS, N))
    got = sampled_metrics(scores)
    assert got["eval/unscorable_refs"] == 2
    assert {k: v for k, v in got.items() if "unscorable" not in k} == {k: v for k, v in clean.items()
                                                                       if "unscorable" not in k}


def test_no_scorable_problem_gives_nan_not_zero():
    m = sampled_metrics(score_samples(ExactCheck(), ["1"] * 4, [""], N))
    assert math.isnan(m["eval/avg@4"]) and math.isnan(m["eval/pass@1"]) and m["eval/unscorable_refs"] == 1


def test_bad_shapes_are_one_line():
    with pytest.raises(ValueError, match="3 completions for 1 problems x 4 samples"):
        score_samples(ExactCheck(), ["1"] * 3, ["1"], 4)
    with pytest.raises(ValueError, match="n >= 1 samples per problem, got n=0"):
        score_samples(ExactCheck(), ["1"], ["1"], 0)


@pytest.fixture(scope="module")
def verifier():
    v = MathVerifier(timeout_s=20.0)
    yield v
    v.close()


def test_math_scoring_through_math_verify(verifier):
    check = MathCheck(verifier)
    completions = ["so \\boxed{\\frac{1}{2}}", "#### 0.5", "I think it is 1/3", "no idea",      # ref 1/2
                   "\\boxed{3}", "\\boxed{3}", "\\boxed{4}", "\\boxed{4}",                      # ref: unparsable
                   "\\boxed{10}", "the answer is 10", "\\boxed{}", "\\boxed{11}"]               # ref 10
    scores = score_samples(check, completions, ["\\frac{1}{2}", "\\frac{", "10"], N)
    assert scores.unscorable == [1]                   # math-verify cannot read "\frac{": excluded, not scored
    assert scores.correct == [[True, True, False, False], [True, True, False, False]]
    assert scores.no_answer == 2                      # "no idea" and an empty \boxed{}
    assert scores.votes[0][:2] == ["\\frac{1}{2}", "\\frac{1}{2}"]     # 1/2 and 0.5 vote together
    m = sampled_metrics(scores)
    assert m["eval/maj@4"] == 1.0 and m["eval/unscorable_refs"] == 1


def test_the_check_follows_the_tasks_rewards(verifier):
    class Task:
        rewards = RewardSet([RewardSpec(name="exact", fn="exact")])

    assert isinstance(answer_check(Task()), ExactCheck)
    Task.rewards = RewardSet([RewardSpec(name="math", fn="math")])
    try:
        assert isinstance(answer_check(Task()), MathCheck)
    finally:
        Task.rewards.close()


def test_an_unparsable_math_reference_is_never_rewarded(verifier):
    """math-verify reads no expression in "\\frac{" or "???" (only the raw string comes back): the reward used to
    be 1.0 for a completion with the same string."""
    assert verifier.parses("\\frac{1}{2}") and verifier.parses("12") and verifier.parses("x+1")
    assert not verifier.parses("\\frac{") and not verifier.parses("???") and not verifier.parses("")
    assert verifier(["\\boxed{\\frac{}", "\\boxed{???}"], ["\\frac{", "???"]) == [0.0, 0.0]
    assert verifier(["\\boxed{\\frac{1}{2}}"], ["0.5"]) == [1.0]
