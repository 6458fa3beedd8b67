"""``offpolicy-moe eval``: a run folder's checkpoint gives exactly the numbers the run logged at its step (greedy and
sampled, same seed), an exported folder those of the checkpoint it was written from; the JSON record and the table;
every mistake is one line, exit code 2, before any weights are read."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from offpolicy_moe.cli import main
from offpolicy_moe.config.load import to_yaml
from offpolicy_moe.trainer import eval_run
from offpolicy_moe.trainer.trainer import Trainer
from tests.tiny import tiny_config

SAMPLES = 4
# an SFT warm start so that some answers are right, a step size that moves the sampled metrics between steps
RUN = ["trainer.sft_warmup_steps=120", "optim.lr=1e-3", "trainer.steps=2", "trainer.eval_every=1",
       "trainer.checkpoint_every=1", "trainer.keep_checkpoints=0", "trainer.threads=1", f"eval.samples={SAMPLES}"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("eval") / "run"
    Trainer(tiny_config(d, *RUN)).run()
    return d


def _logged(run_dir: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: {k: v for k, v in r.items() if k.startswith("eval/") and not k.startswith("eval/train_")}
            for r in rows}


def _cli(capsys, *args: str) -> tuple[int, str, str]:
    rc = main(["eval", *map(str, args)])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_each_checkpoint_gives_the_numbers_the_run_logged_at_its_step(run_dir, tmp_path, capsys):
    logged = _logged(run_dir)
    sampled = [{k: v for k, v in logged[s].items() if "@" in k} for s in (0, 1, 2)]
    assert sampled[0] != sampled[1] and any(v > 0 for v in sampled[1].values())   # the steps can be told apart
    for step in (0, 1, None):
        out = tmp_path / f"step{step}.json"
        rc, _, err = _cli(capsys, run_dir, *(["--step", step] if step is not None else []), "--out", out)
        assert rc == 0, err
        record = json.loads(out.read_text())
        want = 2 if step is None else step            # no --step: the newest checkpoint
        assert record["evaluated"]["step"] == want and record["evaluated"]["checkpoint"] == f"step_{want}"
        assert record["metrics"] == logged[want]
        assert record["settings"]["samples"] == SAMPLES and record["settings"]["ks"] == [1, 2, 4]
        assert set(record["seconds"]) == {"load", "greedy", "engine", "sampled", "total"}


def test_an_exported_folder_gives_the_numbers_of_its_checkpoint(run_dir, tmp_path, capsys):
    out = tmp_path / "export.json"
    rc, table, err = _cli(capsys, run_dir / "export", "--config", run_dir / "config.yaml", "--out", out)
    assert rc == 0, err
    record = json.loads(out.read_text())
    assert record["evaluated"]["kind"] == "model" and record["metrics"] == _logged(run_dir)[2]
    assert "(model folder)" in table


def test_the_options_change_the_sampling_and_the_table_says_what_was_measured(run_dir, tmp_path, capsys):
    out = tmp_path / "t.json"
    rc, table, err = _cli(capsys, run_dir, "--samples", 3, "--k", 3, "--k", 1, "--seed", 5, "--temperature", 0.5,
                          "--out", out)
    assert rc == 0, err
    record = json.loads(out.read_text())
    assert record["settings"]["seed"] == 5 and record["settings"]["temperature"] == 0.5
    assert sorted(k for k in record["metrics"] if "@" in k) == ["eval/avg@3", "eval/maj@1", "eval/maj@3",
                                                                "eval/pass@1", "eval/pass@3"]
    m = record["metrics"]
    lines = table.splitlines()
    assert lines[0].startswith(f"offpolicy-moe eval: {run_dir} (step_2), task arithmetic: 16 held-out problems")
    for name, value in (("greedy accuracy", m["eval/accuracy"]), ("avg@3", m["eval/avg@3"]),
                        ("pass@3", m["eval/pass@3"]), ("maj@3", m["eval/maj@3"])):
        assert any(line.split() == [*name.split(), f"{value:.4f}"] for line in lines), name
    assert any(line.split()[:4] == ["unscorable", "references", "0", "of"] for line in lines)
    assert any(line.split()[:2] == ["no", "answer"] and line.split()[3:] == ["of", "48", "responses"]
               for line in lines)


def _letters_task(tmp_path: Path) -> str:
    f = tmp_path / "words.jsonl"
    f.write_text("".join(json.dumps({"prompt": f"ab{i}=", "answer": f"x{i}"}) + "\n" for i in range(200)))
    return f"jsonl:{f}"


@pytest.fixture
def no_weights(monkeypatch):
    """Fail the test if the command reads weights or evaluates anything."""
    def refuse(*a, **k):
        raise AssertionError("weights were read before the mistake was reported")

    for name in ("load_run_policy", "load_policy", "evaluate_policy"):
        monkeypatch.setattr(eval_run, name, refuse)


def _one_line_error(rc: int, err: str, *parts: str) -> None:
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("offpolicy-moe eval: error: "), err
    for part in parts:
        assert part in lines[0], (part, lines[0])


def test_mistakes_are_one_line_before_any_weights(run_dir, tmp_path, capsys, no_weights):
    empty = tmp_path / "empty"
    empty.mkdir()
    no_ck = tmp_path / "no_ck"
    no_ck.mkdir()
    shutil.copy(run_dir / "config.yaml", no_ck / "config.yaml")
    letters = _letters_task(tmp_path)
    cases = [
        ((tmp_path / "missing",), ["does not exist"]),
        ((empty,), ["is neither a run folder (config.yaml) nor a Hugging Face model folder (config.json)"]),
        ((no_ck,), ["has no checkpoint to evaluate"]),
        ((run_dir, "--step", 9), ["has no checkpoint step_9 (has: step_0, step_1, step_2)"]),
        ((run_dir, "--samples", 0), ["--samples must be >= 1"]),
        ((run_dir, "--samples", 2, "--k", 4), ["pass@k and maj@k need 1 <= k <= n: k=4 with n=2"]),
        ((run_dir, "--task", letters), ["the tokenizer cannot encode the task", "outside the tokenizer alphabet"]),
        ((run_dir / "export", "--task", letters, "task.eval_size=16"), ["the tokenizer cannot encode the task"]),
        ((run_dir / "export", "--step", 1), ["--step applies to a run folder"]),
        ((run_dir, "--config", run_dir / "config.yaml"), ["--config applies to a model folder"]),
        ((run_dir, "model.hidden_size=64"), ["model.hidden_size: a run folder's model"]),
        ((run_dir, "--temperature", -1), ["eval.temperature: must be > 0"]),
        ((tmp_path / "missing", "--out", tmp_path), ["does not exist"]),
        ((run_dir, "--out", tmp_path), ["is a folder"]),
    ]
    for args, parts in cases:
        rc, out, err = _cli(capsys, *args)
        _one_line_error(rc, err, *parts)
        assert out == ""


def test_a_model_folder_whose_vocabulary_is_smaller_than_its_tokenizer_is_refused(run_dir, tmp_path, capsys,
                                                                                   no_weights):
    folder = tmp_path / "small_vocab"
    shutil.copytree(run_dir / "export", folder)
    config = json.loads((folder / "config.json").read_text())
    config["vocab_size"] = 10
    (folder / "config.json").write_text(json.dumps(config))
    rc, _, err = _cli(capsys, folder)
    _one_line_error(rc, err, "the tokenizer has 20 tokens but the model's vocab_size is 10")


def test_the_run_config_keys_can_be_written_back(run_dir):
    """The run's saved config.yaml holds the eval section, so the command and a resume read the same settings."""
    text = (run_dir / "config.yaml").read_text()
    assert "eval:" in text and f"samples: {SAMPLES}" in text
    assert to_yaml(tiny_config(run_dir, *RUN)).count("samples:") == 1


@pytest.mark.parametrize("metric", ["eval/accuracy", f"eval/avg@{SAMPLES}", f"eval/pass@{SAMPLES}"])
def test_best_picks_the_checkpoint_whose_step_logged_the_highest_metric(run_dir, tmp_path, capsys, metric):
    logged = _logged(run_dir)
    top = max(logged[s][metric] for s in (0, 1, 2))
    want = max(s for s in (0, 1, 2) if logged[s][metric] == top)          # a tie goes to the later step
    out = tmp_path / "best.json"
    rc, _, err = _cli(capsys, run_dir, "--best", metric, "--out", out)
    assert rc == 0, err
    record = json.loads(out.read_text())
    assert record["evaluated"]["step"] == want
    assert record["metrics"] == logged[want]


def test_best_mistakes_are_one_line(run_dir, tmp_path, capsys, no_weights):
    for args, match in ((["--best", "eval/nothing"], "no checkpoint's step logged eval/nothing"),
                        (["--best", "eval/accuracy", "--step", "1"], "--step and --best both choose")):
        rc, _, err = _cli(capsys, run_dir, *args)
        assert rc == 2 and len(err.strip().splitlines()) == 1 and match in err, err
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    rc, _, err = _cli(capsys, model, "--best", "eval/accuracy")
    assert rc == 2 and "--best applies to a run folder" in err, err
