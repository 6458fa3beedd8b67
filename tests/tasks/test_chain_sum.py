"""The chain task (sums with worked steps): the reference steps, the final-answer reward, the splits, the config."""
from __future__ import annotations

import pytest

from offpolicy_moe.config.load import ConfigError, load_config
from offpolicy_moe.config.validate import validate
from offpolicy_moe.tasks import ChainSumTask, build_char_tokenizer, make_task
from offpolicy_moe.tasks.chain_sum import chain_space, final_answer_reward, final_number, worked_steps


def test_worked_steps_fold_the_first_two_terms_each_step():
    assert worked_steps([3, 8, 5]) == "11+5=16"
    assert worked_steps([3, 8, 5, 2]) == "11+5+2=16+2=18"
    assert worked_steps([0, 0]) == "0"
    with pytest.raises(ValueError):
        worked_steps([4])


def test_every_reference_is_the_prompt_worked_out():
    task = ChainSumTask(num_terms=7, train_size=200, eval_size=50, seed=3)
    for prompt, answer in zip(task.train_prompts + task.eval_prompts, task.train_answers + task.eval_answers):
        terms = [int(x) for x in prompt.rstrip("=").split("+")]
        assert len(terms) == 7 and all(0 <= t <= 9 for t in terms)
        steps = answer.split("=")
        assert len(steps) == 6 and int(steps[-1]) == sum(terms)
        assert all(sum(int(x) for x in s.split("+")) == sum(terms) for s in steps)   # every step keeps the sum


def test_the_reward_checks_only_the_final_answer():
    ref = "11+5+2=16+2=18"
    got = final_answer_reward(["11+5+2=16+2=18<eos><pad>", "12+5+2=17+2=18", "18", "11+5+2=16+2=19", "11+5+2=",
                               "", " 18 "], [ref] * 7)
    assert got == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0]
    assert final_number("1+2=3<eos>9") == "3"
    with pytest.raises(ValueError):
        final_answer_reward(["1"], [])


def test_the_task_scores_with_the_final_answer_reward_and_metrics_name_it():
    task = ChainSumTask(num_terms=3, train_size=20, eval_size=5)
    ans = task.train_answers[0]
    wrong_steps = "0+0=" + ans.rsplit("=", 1)[-1]
    assert task.reward([ans, wrong_steps, "0"], [ans] * 3) == [1.0, 1.0, 0.0]
    assert set(task.last_scores.parts) == {"final_answer"}


def test_splits_are_disjoint_deterministic_and_over_the_tokenizer_alphabet():
    a = ChainSumTask(num_terms=7, train_size=300, eval_size=64, seed=1)
    b = ChainSumTask(num_terms=7, train_size=300, eval_size=64, seed=1)
    assert (a.train_prompts, a.eval_prompts) == (b.train_prompts, b.eval_prompts)
    assert not set(a.train_prompts) & set(a.eval_prompts) and len(set(a.eval_prompts)) == 64
    assert a.alphabet <= set(build_char_tokenizer().get_vocab())
    assert chain_space(1, 1, 7) == 10 ** 7 and chain_space(2, 2, 2) == 90 ** 2


def test_responses_are_long():
    """9 one-digit terms: every response is at least 32 characters (generation-heavy, issue 35)."""
    task = ChainSumTask(num_terms=9, train_size=500, eval_size=64)
    lengths = [len(a) for a in task.train_answers + task.eval_answers]
    assert min(lengths) >= 32 and task.max_answer_chars <= 80


def test_config_selects_and_validates_the_task():
    cfg = load_config(None, ["task.name=chain", "task.num_terms=5", "task.eval_size=16", "task.train_size=64"])
    validate(cfg)
    task = make_task(cfg.task)
    assert isinstance(task, ChainSumTask) and task.num_terms == 5 and len(task.eval_prompts) == 16
    with pytest.raises(ConfigError, match="need min_digits <= max_digits"):
        validate(load_config(None, ["task.name=chain", "task.min_digits=2", "task.max_digits=1"]))
    with pytest.raises(ValueError, match="num_terms must be in 2..16"):
        ChainSumTask(num_terms=17)
    with pytest.raises(ValueError, match="final answer"):
        ChainSumTask(num_terms=3, reward="partial")
