"""The bring-your-own-task example: experiments/make_gsm8k_format.py's file, experiments/byo_task/ (a reward outside
the package, a YAML) accepted by `train --dry-run`, and its reward."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from offpolicy_moe.cli import main
from offpolicy_moe.config.load import load_config
from offpolicy_moe.tasks import VOCAB, make_task, resolve_reward

REPO = Path(__file__).resolve().parents[2]


def _write(tmp_path, *args) -> Path:
    out = tmp_path / "gsm.jsonl"
    subprocess.run([sys.executable, str(REPO / "experiments" / "make_gsm8k_format.py"), "--out", str(out), *args],
                   check=True, capture_output=True, timeout=120)
    return out


def test_the_file_is_gsm8k_format_with_correct_answers(tmp_path):
    rows = [json.loads(x) for x in _write(tmp_path, "--operators", "+-").read_text().splitlines()]
    assert len(rows) == 4000 and len({r["question"] for r in rows}) == 4000      # 10^3 operands x 2^2 operators
    alphabet = {c for c in VOCAB if len(c) == 1}
    for r in rows:
        assert set(r["question"]) <= alphabet and r["question"].endswith("=")
        *steps, final = r["answer"].split("\n")
        assert final == f"#### {eval(r['question'][:-1])}"              # noqa: S307 - digits and +- only
        assert all(eval(s.split("=")[0]) == int(s.split("=")[1]) for s in steps)   # noqa: S307


def test_the_example_config_passes_the_dry_run_and_builds_its_task(tmp_path, monkeypatch, capsys):
    data = _write(tmp_path, "--limit", "300")
    monkeypatch.chdir(REPO)                  # the YAML names its reward file relative to the repository
    yaml = str(REPO / "experiments" / "byo_task" / "train.yaml")
    over = [f"task.name=dataset:{data}", f"run_dir={tmp_path / 'run'}"]
    assert main(["train", "--dry-run", yaml, *over]) == 0, capsys.readouterr().err
    task = make_task(load_config(yaml, over).task)
    try:
        assert len(task.eval_prompts) == 128 and [s.name for s in task.rewards.specs] == ["math", "bare_number"]
        answer = task.train_answers[0]
        s = task.score([answer, f"{answer}<eos>", f"x = {answer}", "0.5"], [answer] * 4)
        assert s.parts["math"] == [1.0, 1.0, 1.0, 0.0] and s.parts["bare_number"] == [1.0, 1.0, 0.0, 0.0]
        assert s.total == [1.1, 1.1, 1.0, 0.0]
    finally:
        task.rewards.close()


def test_bare_number_by_its_path():
    fn = resolve_reward(str(REPO / "experiments" / "byo_task" / "rewards.py") + ":bare_number")
    assert fn(["12", "-3<eos><pad>", " 7 ", "1+2", ""], [""] * 5) == [1.0, 1.0, 1.0, 0.0, 0.0]


def test_the_gpu_twin_passes_the_dry_run_on_a_local_checkpoint_with_a_chat_template(tmp_path, capsys):
    """experiments/byo_task/gpu.yaml with its two placeholders set: a local checkpoint folder whose tokenizer has a
    chat template (built here, nothing downloaded) and a save_to_disk GSM8K-format folder with train/test splits."""
    from datasets import Dataset, DatasetDict

    from offpolicy_moe.models.presets import build_preset
    from tests.tasks.test_chat import chat_tokenizer

    tok = chat_tokenizer()
    special = {"pad_token_id": tok.pad_token_id, "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id}
    model = build_preset("tiny-qwen3-moe", len(tok), num_layers=1, hidden_size=32, num_experts=4, top_k=2,
                         special_ids=special, seed=0)
    model.save_pretrained(tmp_path / "ckpt")
    tok.save_pretrained(tmp_path / "ckpt")
    rows = [{"question": f"Tom has {a} apples and buys {b}. How many now?", "answer": f"{a}+{b}={a + b}\n#### {a + b}"}
            for a in range(20) for b in range(5)]
    DatasetDict({"train": Dataset.from_list(rows[:80]), "test": Dataset.from_list(rows[80:])}).save_to_disk(
        str(tmp_path / "gsm"))
    rc = main(["train", "--dry-run", str(REPO / "experiments" / "byo_task" / "gpu.yaml"),
               f"model.path={tmp_path / 'ckpt'}", f"task.name=dataset:{tmp_path / 'gsm'}",
               f"run_dir={tmp_path / 'run'}"])
    assert rc == 0, capsys.readouterr().err


def test_word_problems_with_letters_run_on_the_embedded_model(tmp_path, monkeypatch, capsys):
    """``--words``: GSM8K-style questions and worked solutions (letters, punctuation, newlines, ``####``). The
    example config accepts them on the embedded model (byte-fallback tokenizer), and a three-step run trains on them
    and decodes its completions."""
    import json as _json

    data = _write(tmp_path, "--words", "--limit", "300")
    rows = [_json.loads(x) for x in data.read_text().splitlines()]
    assert all(any(c.isalpha() for c in r["question"]) and "\n" in r["answer"] for r in rows)
    for r in rows:
        final = int(r["answer"].rsplit("#### ", 1)[1])
        steps = [s for s in r["answer"].splitlines() if "=" in s]
        assert eval(steps[-1].split("=")[0]) == final == int(steps[-1].split("=")[1])      # noqa: S307
    monkeypatch.chdir(REPO)
    yaml = str(REPO / "experiments" / "byo_task" / "train.yaml")
    over = [f"task.name=dataset:{data}", f"run_dir={tmp_path / 'run'}", "trainer.steps=3", "trainer.sft_warmup_steps=1",
            "trainer.eval_every=0", "rollout.prompts_per_step=2", "rollout.group_size=2", "trainer.threads=1",
            "logging.progress=false", "task.eval_size=8", "model.num_layers=1", "model.hidden_size=32"]
    assert main(["train", "--dry-run", yaml, *over]) == 0, capsys.readouterr().err
    assert main(["train", yaml, *over]) == 0, capsys.readouterr().err
    assert "completed: 3 steps" in capsys.readouterr().out
