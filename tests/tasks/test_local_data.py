"""dataset:<folder or file> through `datasets` (save_to_disk folders, JSON, JSONL, Parquet), jsonl: through the same
path, column names, splits, the GSM8K answer format, and the refusals."""
from __future__ import annotations

import json

import pytest
from datasets import Dataset, DatasetDict

from offpolicy_moe.config.schema import TaskConfig
from offpolicy_moe.tasks import DatasetTask, JsonlTask, make_task

ROWS = [{"question": f"{i}+{i}=", "solution": f"{i}+{i}={2 * i}\n#### {2 * i}", "level": i % 3} for i in range(20)]


def _task(name, **kw):
    return make_task(TaskConfig(name=name, **kw))


def _pairs(task, split="train"):
    return (list(zip(task.train_prompts, task.train_answers)) if split == "train"
            else list(zip(task.eval_prompts, task.eval_answers)))


def test_one_table_in_four_formats_gives_the_same_task(tmp_path):
    ds = Dataset.from_list(ROWS)
    ds.save_to_disk(str(tmp_path / "folder"))
    ds.to_parquet(str(tmp_path / "d.parquet"))
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (tmp_path / "d.json").write_text(json.dumps(ROWS))
    kw = dict(prompt_column="question", answer_column="solution", answer_format="gsm8k", eval_size=4, seed=7)
    tasks = [_task(f"dataset:{tmp_path / n}", **kw) for n in ("folder", "d.parquet", "d.jsonl", "d.json")]
    tasks.append(_task(f"jsonl:{tmp_path / 'd.jsonl'}", **kw))
    ref = tasks[0]
    assert isinstance(ref, DatasetTask) and isinstance(tasks[-1], JsonlTask)
    assert len(ref.eval_prompts) == 4 and len(ref.train_prompts) == 16
    assert set(ref.train_prompts).isdisjoint(ref.eval_prompts)
    assert all(a == str(2 * int(p.split("+")[0])) for p, a in _pairs(ref) + _pairs(ref, "eval"))
    for t in tasks[1:]:
        assert _pairs(t) == _pairs(ref) and _pairs(t, "eval") == _pairs(ref, "eval")
        assert t.train_columns == ref.train_columns


def test_stored_columns_are_kept_for_the_rewards(tmp_path):
    Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "f"))
    t = _task(f"dataset:{tmp_path / 'f'}", prompt_column="question", answer_column="solution", answer_format="gsm8k",
              eval_size=2)
    by_prompt = {r["question"]: r for r in ROWS}
    assert all(c == by_prompt[p] for p, c in zip(t.train_prompts, t.train_columns))


def test_named_splits_and_the_held_out_fraction(tmp_path):
    dd = DatasetDict({"train": Dataset.from_list(ROWS[:16]), "test": Dataset.from_list(ROWS[16:])})
    dd.save_to_disk(str(tmp_path / "dd"))
    kw = dict(prompt_column="question", answer_column="solution", answer_format="gsm8k")
    t = _task(f"dataset:{tmp_path / 'dd'}", eval_split="test", **kw)
    assert t.train_prompts == [r["question"] for r in ROWS[:16]]
    assert t.eval_prompts == [r["question"] for r in ROWS[16:]]
    frac = _task(f"dataset:{tmp_path / 'dd'}", eval_fraction=0.25, seed=3, **kw)
    assert len(frac.eval_prompts) == 4 and len(frac.train_prompts) == 12
    assert _pairs(frac, "eval") == _pairs(_task(f"dataset:{tmp_path / 'dd'}", eval_fraction=0.25, seed=3, **kw), "eval")
    assert _pairs(frac, "eval") != _pairs(_task(f"dataset:{tmp_path / 'dd'}", eval_fraction=0.25, seed=4, **kw), "eval")
    with pytest.raises(ValueError, match="task.split='validation'.*no split 'validation' \\(splits: train, test\\)"):
        _task(f"dataset:{tmp_path / 'dd'}", split="validation", **kw)
    with pytest.raises(ValueError, match="task.eval_split='test'.*single dataset"):
        Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "one"))
        _task(f"dataset:{tmp_path / 'one'}", eval_split="test", **kw)


def test_numeric_answers_are_read_as_text(tmp_path):
    (tmp_path / "n.jsonl").write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": i + 1}) + "\n"
                                              for i in range(6)))
    t = _task(f"dataset:{tmp_path / 'n.jsonl'}", eval_size=2)
    assert sorted(t.train_answers + t.eval_answers) == sorted(str(i + 1) for i in range(6))


@pytest.mark.parametrize("write, name, kw, needle", [
    (lambda d: Dataset.from_dict({"prompt": [], "answer": []}).to_parquet(str(d / "e.parquet")), "e.parquet", {},
     "has no records"),
    (lambda d: (d / "e.jsonl").write_text("\n\n"), "e.jsonl", {}, "has no records"),
    (lambda d: Dataset.from_list(ROWS).save_to_disk(str(d / "f")), "f", {"prompt_column": "prompt"},
     r"task.prompt_column='prompt': .* has no column 'prompt' \(columns: question, solution, level\)"),
    (lambda d: Dataset.from_list(ROWS).save_to_disk(str(d / "f")), "f",
     {"prompt_column": "question", "answer_column": "final"}, "task.answer_column='final'"),
    (lambda d: Dataset.from_list([{"prompt": 3, "answer": "1"}] * 3).to_parquet(str(d / "p.parquet")), "p.parquet", {},
     r"p.parquet: row 0: column 'prompt' is int 3, expected a string prompt"),
    (lambda d: (d / "m.jsonl").write_text('{"prompt": "1=", "answer": "1"}\n{"prompt": null, "answer": "2"}\n'),
     "m.jsonl", {}, r"m.jsonl:2: column 'prompt' is NoneType"),
    (lambda d: (d / "g.jsonl").write_text('{"prompt": "1=", "answer": "1"}\n'), "g.jsonl", {"answer_format": "gsm8k"},
     r"g.jsonl:1: task.answer_format=gsm8k but column 'answer' has no '####'"),
    (lambda d: (d / "t.txt").write_text("x"), "t.txt", {}, "unknown file type"),
    (lambda d: (d / "plain").mkdir(), "plain", {}, "not a saved dataset"),
    (lambda d: None, "absent.jsonl", {}, "does not exist"),
])
def test_bad_datasets_are_refused_in_one_line(tmp_path, write, name, kw, needle):
    write(tmp_path)
    with pytest.raises(ValueError, match=needle) as err:
        _task(f"dataset:{tmp_path / name}", **kw)
    assert "\n" not in str(err.value)


def test_jsonl_shorthand_reads_any_file_name_as_json_lines(tmp_path):
    (tmp_path / "data.txt").write_text("".join(json.dumps({"prompt": f"{i}=", "answer": str(i)}) + "\n"
                                               for i in range(6)))
    t = _task(f"jsonl:{tmp_path / 'data.txt'}", eval_size=2)
    assert len(t.train_prompts) == 4 and isinstance(t, JsonlTask)


@pytest.mark.parametrize("answer, fmt", [("   ", "plain"), ("", "plain"), ("work\n#### ", "gsm8k"),
                                         ("work\n####\n", "gsm8k")])
def test_a_reference_with_no_answer_never_reaches_the_training_reward(tmp_path, answer, fmt):
    """The exact and partial rewards score an empty reference as a string (an empty completion would match it), so
    a task file with one is refused before training, naming the row; a gsm8k row with nothing after ``####`` too."""
    rows = [{"prompt": f"{i}+1=", "answer": f"x\n#### {i + 1}" if fmt == "gsm8k" else str(i + 1)} for i in range(5)]
    rows.insert(3, {"prompt": "9+9=", "answer": answer})
    (tmp_path / "e.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match=r"e.jsonl:4: empty 'answer'") as err:
        _task(f"jsonl:{tmp_path / 'e.jsonl'}", eval_size=2, answer_format=fmt)
    assert "\n" not in str(err.value)
