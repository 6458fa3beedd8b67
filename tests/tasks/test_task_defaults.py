"""Tasks carry their own defaults: ``rollout.max_new_tokens`` left out (``null``) resolves, as the config loads, to
the task's longest reference plus eos, at least 4 (offpolicy_moe/tasks/settings.py).  A value any layer sets is
kept, and one that cannot work is refused in one line; the default task keeps its values; the resolved number is
what ``--print-config`` shows and what the run's config.yaml holds, and a ``--resume`` reads it back."""
from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from offpolicy_moe.cli import main
from offpolicy_moe.config import load_config, save_resolved, to_dict, to_yaml
from offpolicy_moe.config.load import PRESETS_ENV, load_config_dict
from offpolicy_moe.config.schema import RolloutConfig, TaskConfig, TrainConfig
from offpolicy_moe.config.validate import ConfigError, validate
from offpolicy_moe.tasks import build_char_tokenizer, encode_texts, make_task
from offpolicy_moe.tasks.arithmetic import format_problem
from offpolicy_moe.tasks.chain_sum import worked_steps
from offpolicy_moe.tasks.longtail import MAX_TERMS, POSITIONS
from offpolicy_moe.tasks.settings import (BASE_MAX_NEW_TOKENS, arithmetic_longest, chain_longest, longtail_longest,
                                          reverse_longest, task_settings)

ROOT = Path(__file__).resolve().parents[2]
#: a longtail run of a second or two that sets no length key: a small task and model, no warm start
SMALL_LONGTAIL_RUN = ["task.name=longtail", "trainer.steps=2", "task.train_size=64", "task.eval_size=8",
                      "rollout.prompts_per_step=2", "rollout.group_size=2", "trainer.sft_warmup_steps=0",
                      "model.num_layers=1", "model.hidden_size=32", "model.num_experts=4", "trainer.threads=1",
                      "logging.progress=false", "logging.loggers=[jsonl]", "trainer.export_final=false",
                      "trainer.min_free_mb=1"]


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _longest_answer(task) -> int:
    """Tokens (embedded character tokenizer, no eos) of the task's longest reference over both splits."""
    return max(len(ids) for ids in encode_texts(build_char_tokenizer(), task.train_answers + task.eval_answers))


@pytest.mark.parametrize("max_terms", [8, MAX_TERMS])
def test_longtail_left_out_gets_its_longest_reference_and_eos(max_terms):
    cfg = load_config(None, ["task.name=longtail", f"task.max_terms={max_terms}"])
    longest = _longest_answer(make_task(cfg.task))
    assert cfg.rollout.max_new_tokens == longest + 1
    assert task_settings(cfg.task).longest_reference == longest
    if max_terms == MAX_TERMS:
        assert (longest, cfg.rollout.max_new_tokens) == (224, 225)      # docs/tasks.md: 225 for longest + eos
    assert validate(cfg) == []


def test_the_default_task_keeps_its_values():
    cfg = load_config()
    assert cfg.rollout.max_new_tokens == BASE_MAX_NEW_TOKENS == 4
    assert to_yaml(cfg) == to_yaml(load_config(None, ["rollout.max_new_tokens=4"]))
    assert cfg == TrainConfig()                       # built directly, the dataclass resolves the same way
    assert RolloutConfig().max_new_tokens is None     # the section alone says "the task's"
    changed = {k for k, v in _flat(to_dict(load_config(None, ["task.name=longtail"]))).items()
               if _flat(to_dict(cfg))[k] != v}
    assert changed == {"task.name", "rollout.max_new_tokens"}
    assert TrainConfig(task=TaskConfig(name="longtail")).rollout.max_new_tokens == 225


def test_a_value_any_layer_sets_is_kept(tmp_path, monkeypatch):
    assert load_config(None, ["task.name=longtail", "rollout.max_new_tokens=240"]).rollout.max_new_tokens == 240
    assert load_config(None, ["task.name=longtail", "rollout.max_new_tokens=4"]).rollout.max_new_tokens == 4
    assert load_config(None, ["task.name=longtail", "rollout.max_new_tokens=null"]).rollout.max_new_tokens == 225
    assert load_config_dict({"task.name": "longtail", "rollout.max_new_tokens": 30}).rollout.max_new_tokens == 30
    user = tmp_path / "run.yaml"
    user.write_text("task: {name: longtail}\nrollout: {max_new_tokens: 64}\n")
    assert load_config(user).rollout.max_new_tokens == 64
    assert load_config(user, ["rollout.max_new_tokens=null"]).rollout.max_new_tokens == 225
    presets = tmp_path / "presets"
    presets.mkdir()
    (presets / "short_answers.yaml").write_text("# short responses\nrollout: {max_new_tokens: 50}\n")
    monkeypatch.setenv(PRESETS_ENV, str(presets))
    assert load_config(None, ["task.name=longtail"], presets=["short_answers"]).rollout.max_new_tokens == 50
    assert load_config(None, ["task.name=longtail", "rollout.max_new_tokens=60"],
                       presets=["short_answers"]).rollout.max_new_tokens == 60


def test_a_value_that_cannot_work_is_refused_in_one_line(tmp_path, capsys):
    run_dir = tmp_path / "run"
    rc = main(["train", "--dry-run", "--run-dir", str(run_dir), "task.name=longtail", "rollout.max_new_tokens=10"])
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and err.count("\n") == 1, err
    assert lines[0].startswith("offpolicy-moe train: error: ") and "rollout.max_new_tokens=10" in lines[0]
    assert "task.name='longtail'" in lines[0] and not run_dir.exists()
    assert lines[0].endswith("raise rollout.max_new_tokens (the longest answer and its eos take 225)")
    with pytest.raises(ConfigError) as exc:
        validate(load_config(None, ["task.name=longtail", "rollout.max_new_tokens=0"]))
    assert "\n" not in str(exc.value) and str(exc.value).count("rollout.max_new_tokens: must be >= 1") == 1
    cfg = load_config(None, ["task.name=longtail"])
    cfg.rollout.max_new_tokens = None               # null set after loading: nothing resolves it any more
    with pytest.raises(ConfigError, match=r"^invalid configuration: rollout.max_new_tokens: must be set \(null is not "
                                          r"allowed\)$"):
        validate(cfg)


def test_print_config_shows_the_resolved_number(capsys):
    assert main(["train", "--print-config", "task.name=longtail"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["rollout"]["max_new_tokens"] == 225
    assert main(["train", "--print-config"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["rollout"]["max_new_tokens"] == 4


def test_the_run_config_holds_the_resolved_number_and_a_resume_reads_it_back(tmp_path, capsys):
    path = save_resolved(load_config(None, ["task.name=longtail"]), tmp_path / "saved")
    assert yaml.safe_load(path.read_text())["rollout"]["max_new_tokens"] == 225
    assert load_config(path) == load_config(None, ["task.name=longtail"])

    run = tmp_path / "run"
    assert main(["train", *SMALL_LONGTAIL_RUN, "--run-dir", str(run), "--quiet"]) == 0, capsys.readouterr().err
    assert yaml.safe_load((run / "config.yaml").read_text())["rollout"]["max_new_tokens"] == 225
    assert main(["train", "--resume", "--run-dir", str(run), "trainer.steps=3", "--quiet"]) == 0, \
        capsys.readouterr().err
    assert yaml.safe_load((run / "config.yaml").read_text())["rollout"]["max_new_tokens"] == 225
    segments = [json.loads(x) for x in (run / "segments.jsonl").read_text().splitlines()]
    assert [s["status"] for s in segments] == ["completed", "completed"]
    assert segments[-1]["changed"] == {"trainer.steps": [2, 3]}


@pytest.mark.parametrize("min_digits, max_digits, num_terms", [(1, 1, 2), (1, 1, 3), (2, 2, 2), (1, 2, 2)])
def test_the_arithmetic_longest_answer_is_the_longest_of_every_problem(min_digits, max_digits, num_terms):
    values = [v for d in range(min_digits, max_digits + 1) for v in range(0 if d == 1 else 10 ** (d - 1), 10 ** d)]
    for k in range(1, 4):
        for ops in itertools.combinations("+-*", k):
            longest = max(len(format_problem(list(operands), list(o))[1])
                          for operands in itertools.product(values, repeat=num_terms)
                          for o in itertools.product(ops, repeat=num_terms - 1))
            assert arithmetic_longest(min_digits, max_digits, num_terms, "".join(ops)) == longest, ops


def test_the_other_tasks_longest_references_follow_their_generators():
    for digits, terms in itertools.product((1, 2, 3), range(2, 17)):
        assert chain_longest(1, digits, terms) == len(worked_steps([10 ** digits - 1] * terms)), (digits, terms)
    for max_terms in range(5, MAX_TERMS + 1):     # the chain's longest, cut to the positions bos, prompt, eos leave
        assert longtail_longest(max_terms) == max(min(chain_longest(1, 1, n), POSITIONS - 2 - 2 * n)
                                                  for n in range(4, max_terms + 1))
    assert {m: longtail_longest(m) for m in (6, 8, 11, 15)} == {6: 34, 8: 62, 11: 119, 15: 224}   # docs/tasks.md
    assert reverse_longest(7, 8) == 8
    for task in (TaskConfig(name="chain", num_terms=5, train_size=512, eval_size=32),
                 TaskConfig(name="reverse", min_digits=3, max_digits=6, train_size=256, eval_size=32),
                 TaskConfig(max_digits=2, operators="+-*", train_size=2048, eval_size=64)):
        assert _longest_answer(make_task(task)) <= task_settings(task).longest_reference


def test_tasks_read_from_disk_and_options_a_task_refuses_get_the_base():
    assert load_config(None, ["task.name=jsonl:data/train.jsonl"]).rollout.max_new_tokens == BASE_MAX_NEW_TOKENS
    assert load_config(None, ["task.name=dataset:data"]).rollout.max_new_tokens == BASE_MAX_NEW_TOKENS
    for task in (TaskConfig(min_digits=3, max_digits=2), TaskConfig(operators="/"), TaskConfig(name="longtail",
                 max_terms=3), TaskConfig(name="reverse", min_digits=0), TaskConfig(name="chain", num_terms=10 ** 9)):
        assert task_settings(task).max_new_tokens == BASE_MAX_NEW_TOKENS and task_settings(task).longest_reference \
            is None, task
    with pytest.raises(ConfigError, match="need min_digits <= max_digits"):   # and validation still says why
        validate(load_config(None, ["task.name=reverse", "task.min_digits=6", "task.max_digits=5"]))


@pytest.mark.slow
def test_the_longtail_task_trains_with_nothing_but_its_name(tmp_path):
    """The issue's command as written (about 45 s on 2 busy cores: the 60-step warm start, then 225-token rollouts
    and greedy evaluation)."""
    r = subprocess.run([sys.executable, "-m", "offpolicy_moe", "train", "task.name=longtail", "trainer.steps=2",
                        "--run-dir", str(tmp_path / "run")], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["rollout"]["max_new_tokens"] == 225
