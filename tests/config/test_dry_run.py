"""``train --dry-run`` refuses every bad configuration of :data:`bad_configs.BAD_CONFIGS` before compute, with a
one-line message per problem naming the key; good configurations still pass."""
from __future__ import annotations

import json

import pytest

from offpolicy_moe.cli import main
from bad_configs import BAD_CONFIGS, make_fixture_files, resolve


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bad")
    make_fixture_files(tmp)
    return tmp


@pytest.mark.parametrize("overrides,key", BAD_CONFIGS, ids=[" ".join(o) for o, _ in BAD_CONFIGS])
def test_dry_run_refuses_naming_the_key(overrides, key, files, tmp_path, capsys):
    run_dir = tmp_path / "run"
    rc = main(["train", "--dry-run", "--run-dir", str(run_dir), *resolve(overrides, files)])
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = [ln for ln in err.splitlines() if ln.strip() and "warning" not in ln]
    assert lines and all("Traceback" not in ln for ln in lines), err
    problems = [ln for ln in lines if key in ln]
    assert problems, (key, err)
    assert not run_dir.exists()    # nothing written, nothing computed


def test_dry_run_accepts_defaults_and_a_good_jsonl_task(tmp_path, capsys):
    assert main(["train", "--dry-run", "--run-dir", str(tmp_path / "a")]) == 0
    data = tmp_path / "t.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(8)))
    assert main(["train", "--dry-run", "--run-dir", str(tmp_path / "b"), f"task.name=jsonl:{data}"]) == 0, \
        capsys.readouterr().err


def test_some_answers_too_long_is_a_warning_naming_the_key(capsys, tmp_path):
    rc = main(["train", "--dry-run", "--run-dir", str(tmp_path / "r"), "task.max_digits=2", "task.num_terms=2",
               "task.operators=*", "rollout.max_new_tokens=2"])
    assert rc == 0
    assert "warning: rollout.max_new_tokens=2:" in capsys.readouterr().err
