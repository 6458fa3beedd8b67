"""Rewards against hand-computed cases."""
import pytest

from offpolicy_moe.tasks import clean_completion, compute_rewards, exact_match_reward, partial_credit_reward


@pytest.mark.parametrize("completion,answer,exact,partial", [
    ("19", "19", 1.0, 1.0),
    ("19<eos>", "19", 1.0, 1.0),
    ("19<eos>42<pad><pad>", "19", 1.0, 1.0),   # cut at eos
    ("1942", "19", 0.0, 0.0),                   # no eos: right-aligned "42" vs "19" → 0 hits of 4
    ("18", "19", 0.0, 0.5),                     # tens digit right
    ("119", "19", 0.0, 2 / 3),                  # two right-aligned hits, length 3
    ("9", "19", 0.0, 0.5),                      # units right, tens missing
    ("", "19", 0.0, 0.0),                       # empty completion
    ("<eos>19", "19", 0.0, 0.0),                # eos first → empty
    ("+=*(", "19", 0.0, 0.0),                   # garbage
    (" 19 ", "19", 1.0, 1.0),                   # surrounding whitespace stripped
    ("-6", "-6", 1.0, 1.0),
    ("6", "-6", 0.0, 0.5),                      # sign missing
    ("<bos>7<eos>", "7", 0.0, 1 / 6),           # a special token inside the answer is wrong
    ("7<pad>", "7", 0.0, 0.0),                  # pad emitted before eos: wrong
    ("7<eos><pad><pad>", "7", 1.0, 1.0),        # filler after eos is cut
])
def test_hand_computed(completion, answer, exact, partial):
    assert exact_match_reward(completion, answer) == exact
    assert partial_credit_reward(completion, answer) == pytest.approx(partial)


def test_clean_completion():
    assert clean_completion("12<pad><eos>9") == "12<pad>"
    assert clean_completion(" 1<pad>2<eos><pad> ") == "1<pad>2"
    assert exact_match_reward("1<pad>9", "19") == 0.0


def test_compute_rewards_batch_and_errors():
    assert compute_rewards(["3", "4<eos>", "x"], ["3", "4", "5"], "exact") == [1.0, 1.0, 0.0]
    assert compute_rewards(["13", "2"], ["12", "2"], "partial") == [0.5, 1.0]
    with pytest.raises(ValueError, match="2 completions but 1 answers"):
        compute_rewards(["1", "2"], ["1"])
    with pytest.raises(ValueError, match="unknown reward"):
        compute_rewards(["1"], ["1"], "fuzzy")
    with pytest.raises(TypeError):
        compute_rewards("1", ["1"])
