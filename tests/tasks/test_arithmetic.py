"""Arithmetic task: determinism, disjoint splits, difficulty knobs, correct answers, prompt stream, jsonl."""
import json
import re

import pytest

from offpolicy_moe.config.schema import TaskConfig
from offpolicy_moe.tasks import ArithmeticTask, JsonlTask, evaluate_expression, make_task


def small(**kw):
    base = dict(train_size=300, eval_size=40, seed=7)
    base.update(kw)
    return ArithmeticTask(TaskConfig(**base))


def test_deterministic_per_seed_and_seed_matters():
    a, b, c = small(max_digits=2), small(max_digits=2), small(max_digits=2, seed=8)
    assert list(a.train_dataset["prompt"]) == list(b.train_dataset["prompt"])
    assert list(a.eval_dataset["answer"]) == list(b.eval_dataset["answer"])
    assert list(a.train_dataset["prompt"]) != list(c.train_dataset["prompt"])


@pytest.mark.parametrize("kw", [dict(max_digits=1), dict(max_digits=2, num_terms=3, operators="+-*"),
                                dict(max_digits=1, operators="+-")])
def test_train_eval_disjoint_and_eval_distinct(kw):
    t = small(**kw)
    train, ev = set(t.train_dataset["prompt"]), list(t.eval_dataset["prompt"])
    assert len(ev) == len(set(ev)) > 0
    assert not train & set(ev)
    assert len(t.train_dataset) == 300


def test_small_space_caps_eval_with_warning():
    with pytest.warns(UserWarning, match="capped at 50"):
        t = small(eval_size=128, num_terms=2)
    assert len(t.eval_dataset) == 50  # 1-digit a+b: 100 problems, half held out
    assert not set(t.train_dataset["prompt"]) & set(t.eval_dataset["prompt"])


def _parse(prompt):
    assert prompt.endswith("=")
    nums = re.findall(r"\d+", prompt[:-1])
    ops = re.findall(r"[+\-*]", prompt[:-1])
    return [int(n) for n in nums], ops, re.findall(r"\d+", prompt[:-1])


@pytest.mark.parametrize("mind,maxd,terms,ops", [(1, 1, 2, "+"), (2, 3, 3, "+-"), (1, 2, 4, "*"), (1, 2, 3, "+-*")])
def test_knobs_respected_and_answers_correct(mind, maxd, terms, ops):
    t = small(min_digits=mind, max_digits=maxd, num_terms=terms, operators=ops)
    seen_lengths, seen_ops = set(), set()
    for p, a in zip(list(t.train_dataset["prompt"]) + list(t.eval_dataset["prompt"]),
                    list(t.train_dataset["answer"]) + list(t.eval_dataset["answer"])):
        nums, used, raw = _parse(p)
        assert len(nums) == terms and len(used) == terms - 1
        assert all(mind <= len(r) <= maxd for r in raw)
        assert all(r == str(int(r)) for r in raw)  # no leading zeros
        assert set(used) <= set(ops)
        seen_lengths.update(len(r) for r in raw)
        seen_ops.update(used)
        assert int(a) == eval(p[:-1])  # python's precedence is the reference
    assert seen_lengths == set(range(mind, maxd + 1))
    assert seen_ops == set(ops)


def test_evaluate_expression_precedence():
    assert evaluate_expression([2, 3, 4], ["+", "*"]) == 14
    assert evaluate_expression([2, 3, 4, 5], ["*", "-", "*"]) == -14
    assert evaluate_expression([3, 9], ["-"]) == -6
    with pytest.raises(ValueError):
        evaluate_expression([1, 2], [])


@pytest.mark.parametrize("kw,match", [(dict(min_digits=0), "min_digits"), (dict(min_digits=3, max_digits=2), "max_digits"),
                                      (dict(num_terms=1), "num_terms"), (dict(operators="/"), "operators"),
                                      (dict(operators="++"), "operators"), (dict(reward="close"), "reward"),
                                      (dict(train_size=0), "train_size")])
def test_bad_knobs(kw, match):
    with pytest.raises(ValueError, match=match):
        small(**kw)


def test_sample_prompts_deterministic_and_resumable():
    t = small(max_digits=2)
    first = [t.sample_prompts(s, 8) for s in range(5)]
    again = small(max_digits=2)
    assert [again.sample_prompts(s, 8) for s in (3, 4)] == first[3:5]  # resume at step 3
    assert first[0] != first[1]
    train = set(t.train_dataset["prompt"])
    for rows in first:
        for r in rows:
            assert r["prompt"] in train and t.train_dataset[r["index"]]["prompt"] == r["prompt"]
    with pytest.raises(ValueError):
        t.sample_prompts(0, 0)


def test_reward_uses_configured_kind():
    assert small(reward="exact").reward(["18"], ["19"]) == [0.0]
    assert small(reward="partial").reward(["18<eos>"], ["19"]) == [0.5]


def test_make_task_names(tmp_path):
    assert isinstance(make_task(TaskConfig(max_digits=2, eval_size=10, train_size=20)), ArithmeticTask)
    with pytest.raises(ValueError, match="unknown task.name"):
        make_task(TaskConfig(name="gsm8k"))
    path = tmp_path / "d.jsonl"
    recs = [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(20)] + [{"prompt": "0+0=", "answer": "0"}]
    path.write_text("\n".join(json.dumps(r) for r in recs) + "\n\n")
    t = make_task(TaskConfig(name=f"jsonl:{path}", eval_size=5, seed=3))
    assert isinstance(t, JsonlTask) and len(t.eval_dataset) == 5
    assert not set(t.train_dataset["prompt"]) & set(t.eval_dataset["prompt"])
    assert len(t.train_dataset) + sum(1 for r in recs if r["prompt"] in set(t.eval_dataset["prompt"])) == len(recs)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": 3}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        make_task(TaskConfig(name=f"jsonl:{bad}"))
    with pytest.raises(ValueError, match="does not exist"):
        make_task(TaskConfig(name=f"jsonl:{tmp_path}/missing.jsonl"))
