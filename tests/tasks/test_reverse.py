"""The digit-reversal task: answers, lengths, disjoint deterministic splits, config validation."""
import pytest

from offpolicy_moe.config.load import load_config
from offpolicy_moe.config.validate import ConfigError, validate
from offpolicy_moe.tasks import ArithmeticTask, ReverseTask, make_task
from offpolicy_moe.tasks.arithmetic import ArithmeticSpec, generate_splits
from offpolicy_moe.tasks.reverse import reverse_space


PINNED_TRAIN = [('0+2+9=', '11'), ('2+3+7=', '12'), ('8+0+2=', '10'), ('9+5+3=', '17')]
PINNED_EVAL = [('1+7+2=', '10'), ('1+6+0=', '7'), ('7+9+7=', '23')]


def test_answers_are_reversed_prompts_of_the_asked_lengths():
    task = ReverseTask(min_digits=3, max_digits=5, train_size=300, eval_size=50, seed=7)
    for p, a in zip(task.train_prompts + task.eval_prompts, task.train_answers + task.eval_answers):
        assert p.endswith("=") and p[:-1].isdigit() and a == p[:-1][::-1]
        assert 3 <= len(a) <= 5
    assert {len(a) for a in task.train_answers} == {3, 4, 5}
    assert task.max_answer_chars == 5


def test_splits_are_disjoint_distinct_and_deterministic():
    a = ReverseTask(min_digits=4, max_digits=4, train_size=500, eval_size=200, seed=3)
    b = ReverseTask(min_digits=4, max_digits=4, train_size=500, eval_size=200, seed=3)
    c = ReverseTask(min_digits=4, max_digits=4, train_size=500, eval_size=200, seed=4)
    assert a.eval_prompts == b.eval_prompts and a.train_prompts == b.train_prompts
    assert a.eval_prompts != c.eval_prompts
    assert len(set(a.eval_prompts)) == 200
    assert not set(a.eval_prompts) & set(a.train_prompts)
    assert reverse_space(1, 2) == 110


def test_small_space_caps_the_eval_split():
    with pytest.warns(UserWarning, match="only 10 problems"):
        task = ReverseTask(min_digits=1, max_digits=1, train_size=20, eval_size=8, seed=0)
    assert len(task.eval_prompts) == 5


def test_arithmetic_splits_unchanged_by_the_shared_split_function():
    # the default task's first problems, pinned from the generator before the split function was shared
    train, eval_ = generate_splits(ArithmeticSpec(1, 1, 3, "+"), 4, 3, 1234)
    assert (train, eval_) == (PINNED_TRAIN, PINNED_EVAL)
    assert ArithmeticTask(num_terms=3, train_size=4, eval_size=3, seed=1234).eval_prompts == [p for p, _ in eval_]


def test_config_selects_and_validates_the_task():
    cfg = load_config(None, ["task.name=reverse", "task.min_digits=6", "task.max_digits=8"])
    task = make_task(cfg.task)
    assert isinstance(task, ReverseTask) and task.max_answer_chars == 8
    with pytest.raises(ConfigError, match="need min_digits <= max_digits, got 6, 5"):
        validate(load_config(None, ["task.name=reverse", "task.min_digits=6", "task.max_digits=5"]))
    with pytest.raises(ValueError, match="1 <= min <= max <= 32"):
        ReverseTask(min_digits=0, max_digits=3)
