"""The longtail task (chain sums with a long-tailed number of terms, issue 44): the law of the number of terms, the
reference lengths of each tail setting in the embedded tokenizer's tokens, determinism, disjoint splits, the
final-answer reward, the config's one-line errors."""
from __future__ import annotations

import math

import numpy as np
import pytest

from offpolicy_moe.config.load import ConfigError, load_config
from offpolicy_moe.config.validate import validate
from offpolicy_moe.tasks import LongTailTask, build_char_tokenizer, make_task
from offpolicy_moe.tasks.longtail import (MAX_TERMS, MIN_TERMS, POSITIONS, TAIL_SETTINGS, num_terms, reference_lengths,
                                          estimate_answer, estimate_rows, terms_law)


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def test_the_number_of_terms_follows_the_truncated_zipf_law():
    terms, p = terms_law(15, 2.0)
    assert terms.tolist() == list(range(4, 16))
    norm = sum(k ** -2.0 for k in range(1, 13))
    assert np.allclose(p, [(n - 3) ** -2.0 / norm for n in range(4, 16)]) and math.isclose(p.sum(), 1.0)
    assert math.isclose(p[0], 0.6390, abs_tol=1e-4)                         # the head: 4 terms
    assert np.allclose(terms_law(8, 0.0)[1], 0.2)                          # alpha 0: uniform over 4..8
    task = LongTailTask(train_size=4096, eval_size=16)
    counts = np.bincount([num_terms(q) for q in task.train_prompts], minlength=16)[4:]
    assert abs(counts[0] / 4096 - p[0]) < 0.03 and counts[-1] >= 5         # the head and the tail are both drawn
    assert all(c > 0 for c in counts)


@pytest.mark.parametrize("max_terms, stats", [
    (6, (11, 14, 34)), (8, (11, 14, 62)), (11, (11, 14, 119)), (15, (11, 14, 224))])
def test_reference_lengths_of_each_tail_setting(tok, max_terms, stats):
    """Measured on the 4096-problem train split (tokens of the embedded tokenizer, no eos): the module docstring's
    table.  The median stays at the 4-term head while task.max_terms moves the longest reference."""
    task = LongTailTask(max_terms=max_terms)
    lengths = np.array(reference_lengths(task, tok))
    assert len(lengths) == 4096
    lo, med, hi = int(lengths.min()), float(np.median(lengths)), int(lengths.max())
    assert (lo, med, hi) == stats
    nominal = {v: k for k, v in TAIL_SETTINGS.items()}.get(max_terms)
    if nominal is not None:                    # within a quarter of 2, 4, 8 (lengths move in whole steps)
        assert 0.75 * nominal <= hi / med <= 1.25 * nominal, hi / med


def test_the_defaults_run_from_about_ten_to_over_two_hundred_tokens(tok):
    task = LongTailTask()
    lengths = np.array(reference_lengths(task, tok))
    assert lengths.min() <= 12 and lengths.max() >= 200 and lengths.max() / np.median(lengths) >= 4
    # every problem fits the embedded model's positions: bos + prompt + answer + eos
    from offpolicy_moe.models.presets import MAX_POSITIONS
    assert POSITIONS == MAX_POSITIONS
    longest = max(len(p) + len(a) + 2 for p, a in zip(task.train_prompts + task.eval_prompts,
                                                        task.train_answers + task.eval_answers))
    assert longest <= POSITIONS and task.max_answer_chars == 224


def test_every_reference_is_the_prompt_worked_out():
    task = LongTailTask(train_size=300, eval_size=50, seed=5)
    for prompt, answer in zip(task.train_prompts + task.eval_prompts, task.train_answers + task.eval_answers):
        terms = [int(x) for x in prompt.rstrip("=").split("+")]
        assert MIN_TERMS <= len(terms) <= MAX_TERMS and all(0 <= t <= 9 for t in terms)
        steps = answer.split("=")
        assert len(steps) == len(terms) - 1 and int(steps[-1]) == sum(terms)


def test_splits_are_deterministic_and_disjoint():
    a = LongTailTask(train_size=2000, eval_size=256, seed=7)
    b = LongTailTask(train_size=2000, eval_size=256, seed=7)
    c = LongTailTask(train_size=2000, eval_size=256, seed=8)
    assert (a.train_prompts, a.train_answers, a.eval_prompts) == (b.train_prompts, b.train_answers, b.eval_prompts)
    assert a.eval_prompts != c.eval_prompts
    assert len(set(a.eval_prompts)) == 256 and not set(a.train_prompts) & set(a.eval_prompts)
    assert a.alphabet <= set(build_char_tokenizer().get_vocab())


def test_the_reward_is_the_final_answer():
    task = LongTailTask(train_size=50, eval_size=8)
    long = max(task.train_answers, key=len)
    final = long.rsplit("=", 1)[-1]
    wrong = str(int(final) + 1)
    assert task.reward([long, "9=" + final, long[:-len(final)] + wrong, final, "", long.rsplit("=", 1)[0]],
                       [long] * 6) == [1.0, 1.0, 0.0, 1.0, 0.0, 0.0]
    assert set(task.last_scores.parts) == {"final_answer"}


def test_config_selects_the_task_and_refuses_bad_values_on_one_line():
    cfg = load_config(None, ["task.name=longtail", "task.max_terms=8", "task.length_tail=1.5", "task.eval_size=16",
                             "task.train_size=64"])
    assert not [w for w in validate(cfg) if "no effect" in w]
    task = make_task(cfg.task)
    assert isinstance(task, LongTailTask) and (task.max_terms, task.length_tail) == (8, 1.5)
    assert max(num_terms(p) for p in task.train_prompts) <= 8
    for override, message in [
            ("task.max_terms=16", "task.max_terms: must be in [5, 15], got 16"),
            ("task.max_terms=4", "task.max_terms: must be in [5, 15], got 4"),
            ("task.length_tail=-0.5", "task.length_tail: must be >= 0, got -0.5"),
            ("task.max_digits=2", "task.min_digits/task.max_digits: the longtail task's operands are one digit")]:
        with pytest.raises(ConfigError) as err:
            validate(load_config(None, ["task.name=longtail", override]))
        assert message in str(err.value) and len([ln for ln in str(err.value).splitlines() if message in ln]) == 1
    warnings = validate(load_config(None, ["task.name=chain", "task.max_terms=8"]))
    assert any(w.startswith("task.max_terms=8 has no effect with task.name=chain") for w in warnings)
    with pytest.raises(ValueError, match=r"^task.max_terms must be in 5..15 for the longtail task, got 16$"):
        LongTailTask(max_terms=16)
    with pytest.raises(ValueError, match="task.length_tail must be a finite number >= 0"):
        LongTailTask(length_tail=float("nan"))
    with pytest.raises(ValueError, match="task.min_digits/max_digits must be 1 for the longtail task"):
        LongTailTask(max_digits=2)
    with pytest.raises(ValueError, match="longtail task scores the final answer"):
        LongTailTask(reward="partial")
    with pytest.raises(TypeError, match="num_terms"):
        LongTailTask(num_terms=5)


def test_estimated_demonstrations_replace_a_seeded_share_of_the_warm_starts_answers():
    plain = LongTailTask(train_size=2000, eval_size=16)
    task = LongTailTask(train_size=2000, eval_size=16, estimate_share=0.6)
    assert plain.demonstrations == plain.rows("train")
    # the split, the RL prompts and the references are the plain task's: only the warm start's answers change
    assert (task.train_prompts, task.train_answers, task.eval_prompts, task.eval_answers) == (
        plain.train_prompts, plain.train_answers, plain.eval_prompts, plain.eval_answers)
    demos = task.demonstrations
    assert list(demos["prompt"]) == task.train_prompts
    rows = estimate_rows(2000, 0.6, task.seed)
    for answer, demo, estimated in zip(task.train_answers, demos["answer"], rows):
        total = int(answer.rsplit("=", 1)[-1])
        assert demo == (f"={10 * round(total / 10 + 1e-9)}" if estimated else answer)
    # an estimate earns the final-answer reward exactly when the sum is a multiple of ten
    right = task.reward(list(demos["answer"]), task.train_answers)
    assert right == [1.0 if not estimated or int(a.rsplit("=", 1)[-1]) % 10 == 0 else 0.0
                     for a, estimated in zip(task.train_answers, rows)]
    assert abs(rows.mean() - 0.6) < 4 * math.sqrt(0.6 * 0.4 / 2000)
    assert [estimate_answer(a) for a in ("11+5+2=16+2=18", "9+6=15", "7+7=14", "2+2=4", "60+0=60")] == [
        "=20", "=20", "=10", "=0", "=60"]
    assert np.array_equal(rows, estimate_rows(2000, 0.6, task.seed))
    assert not np.array_equal(rows, estimate_rows(2000, 0.6, task.seed + 1))
    assert not estimate_rows(50, 0.0, 0).any()


def test_estimate_share_is_checked_on_one_line():
    cfg = load_config(None, ["task.name=longtail", "task.estimate_share=0.5", "task.train_size=64",
                             "task.eval_size=8"])
    assert not [w for w in validate(cfg) if "no effect" in w]
    assert make_task(cfg.task).estimate_share == 0.5
    for value, message in [("1.0", "task.estimate_share: must be in [0, 1), got 1.0"),
                           ("-0.1", "task.estimate_share: must be in [0, 1), got -0.1")]:
        with pytest.raises(ConfigError) as err:
            validate(load_config(None, ["task.name=longtail", f"task.estimate_share={value}"]))
        assert message in str(err.value)
    warnings = validate(load_config(None, ["task.name=chain", "task.estimate_share=0.5"]))
    assert any(w.startswith("task.estimate_share=0.5 has no effect with task.name=chain") for w in warnings)
    for bad in (1.0, -0.1, float("nan")):
        with pytest.raises(ValueError, match=r"^task.estimate_share must be a number in \[0, 1\) for the longtail"):
            LongTailTask(estimate_share=bad)
