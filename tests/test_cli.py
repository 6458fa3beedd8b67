import subprocess
import sys

from offpolicy_moe.cli import main


def test_help_lists_commands(capsys):
    assert main([]) == 2
    out = capsys.readouterr().out
    for cmd in ("train", "demo", "sweep", "table", "plot", "presets", "env"):
        assert cmd in out


def test_env_command_json(capsys):
    assert main(["env", "--json"]) == 0
    out = capsys.readouterr().out
    assert '"torch"' in out and '"transformers"' in out


def test_module_entry_point():
    r = subprocess.run([sys.executable, "-m", "offpolicy_moe", "env"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "torch_threads" in r.stdout


def test_overrides_may_follow_options(tmp_path, capsys):
    rc = main(["train", "--dry-run", "preset=[grpo]", "--run-dir", str(tmp_path / "r"), "buffer.staleness=3"])
    assert rc == 0
    rc = main(["train", "--print-config", "--run-dir", str(tmp_path / "r"), "buffer.staleness=3"])
    assert rc == 0
    assert "staleness: 3" in capsys.readouterr().out


def test_unknown_option_is_still_an_error(capsys):
    import pytest

    with pytest.raises(SystemExit) as exc:
        main(["train", "--dry-run", "--no-such-flag"])
    assert exc.value.code == 2
    assert "unrecognized arguments: --no-such-flag" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------- one error path
import pytest  # noqa: E402

from offpolicy_moe.commands.errors import one_line  # noqa: E402
from offpolicy_moe.commands.threads import SMALL_MACHINE_CORES, choose_threads  # noqa: E402


def _rc(argv) -> int:
    try:
        return main(argv)
    except SystemExit as exc:          # argparse mistakes exit through the one-line parser
        return int(exc.code)


def _single_error(capsys, command: str) -> str:
    cap = capsys.readouterr()
    err = [line for line in cap.err.splitlines() if line.strip()]
    assert len(err) == 1, err
    assert err[0].startswith(f"offpolicy-moe {command}: error: "), err[0]
    assert "Traceback" not in cap.err and "RL steps" not in cap.out     # no banner before the refusal
    return err[0]


@pytest.mark.parametrize("argv,needle", [
    (["trainer.steps=abc"], "trainer.steps"),
    (["trainer.stepz=3"], "Did you mean: 'steps'"),
    (["--steps", "-5"], "--steps"),
    (["--steps", "0"], "--steps"),
])
def test_demo_config_mistakes_are_one_line_and_write_nothing(tmp_path, capsys, argv, needle):
    run_dir = tmp_path / "demo"
    assert _rc(["demo", "--run-dir", str(run_dir), *argv]) == 2
    assert needle in _single_error(capsys, "demo")
    assert not run_dir.exists()


@pytest.mark.parametrize("dry_run", [True, False])
def test_train_config_mistake_same_prefix_and_code_with_and_without_dry_run(tmp_path, capsys, dry_run):
    run_dir = tmp_path / "r"
    argv = ["train", "--run-dir", str(run_dir), "trainer.steps=-1"] + (["--dry-run"] if dry_run else [])
    assert _rc(argv) == 2
    assert "trainer.steps" in _single_error(capsys, "train")
    assert not run_dir.exists()


def test_sweep_option_mistakes_are_one_line(tmp_path, capsys):
    exp = tmp_path / "e.yaml"
    exp.write_text("grid: {staleness: {key: buffer.staleness, values: [0]}}\n")
    assert _rc(["sweep", str(exp), "--jobs", "0"]) == 2
    _single_error(capsys, "sweep")
    assert _rc(["sweep", str(exp), "--seeds", "a,b"]) == 2
    _single_error(capsys, "sweep")
    assert _rc(["sweep", str(exp), "--dry-run", "trainer.stepz=1", "--out", str(tmp_path / "sw")]) == 2
    assert "stepz" in _single_error(capsys, "sweep")
    assert not (tmp_path / "sw").exists()


def test_one_line_joins_a_problem_list():
    exc = ValueError("invalid configuration (2 problems):\n - a: bad\n - b: worse")
    assert one_line(exc) == "invalid configuration (2 problems): a: bad; b: worse"


def test_auto_threads_policy():
    # small machines: 1 thread whatever the load (measured: experiments/bench/bench_threads.py)
    for load in (0.0, 1.0, 5.0):
        assert choose_threads(0, SMALL_MACHINE_CORES, load).threads == 1
    assert choose_threads(0, 16, 0.0).threads == 16
    assert choose_threads(0, 16, 4.0, processes=2).threads == 6
    assert choose_threads(0, 16, 40.0).threads == 1
    assert choose_threads(3, 2, 9.0).threads == 3            # an explicit setting is used as given
    assert choose_threads(0, 2, 0.0).setting == "auto"
    # OMP_NUM_THREADS (a sweep's --threads, or the user's) wins under auto, not over an explicit setting
    assert choose_threads(0, 16, 0.0, env_threads="2").threads == 2
    assert choose_threads(4, 16, 0.0, env_threads="2").threads == 4
    assert choose_threads(0, 16, 0.0, env_threads="x").threads == 16


def test_a_closed_pipe_is_not_a_traceback(monkeypatch):
    """`offpolicy-moe presets | head -1` used to end in a BrokenPipeError traceback: stdout is a pipe whose reader
    is gone, so every write fails."""
    import os
    import sys

    from offpolicy_moe.cli import main as cli_main

    r, w = os.pipe()
    os.close(r)
    out = os.fdopen(w, "w", buffering=1)
    saved = os.dup(1)
    monkeypatch.setattr(sys, "stdout", out)
    try:
        assert cli_main(["presets"]) == 0
    finally:
        os.dup2(saved, 1)
        os.close(saved)


_TINY_RUN = ["model.num_layers=1", "model.hidden_size=32", "model.num_experts=4", "model.top_k=2",
             "rollout.prompts_per_step=2", "rollout.max_new_tokens=3", "trainer.steps=1", "trainer.eval_every=0",
             "trainer.sft_warmup_steps=0", "trainer.checkpoint_every=0", "trainer.export_final=false",
             "trainer.threads=1", "logging.progress=false", "logging.loggers=[jsonl]", "trainer.min_free_mb=1"]


@pytest.mark.parametrize("dry_run", [True, False])
def test_warnings_are_one_line_each_once_through_the_cli(tmp_path, dry_run):
    """A library warning (``warnings.warn`` in the task: its eval split is capped) and a config warning
    (``group_size=1`` with std advantages), through the real CLI in a subprocess: each is one line
    ``offpolicy-moe train: warning: ...``, said once in the whole run (checks, then training), with no source line,
    no module path and no warning class."""
    argv = [sys.executable, "-m", "offpolicy_moe", "train", *_TINY_RUN, "task.num_terms=2", "task.max_digits=1",
            "task.train_size=20", "task.eval_size=80", "rollout.group_size=1", "--run-dir", str(tmp_path / "run")]
    r = subprocess.run(argv + (["--dry-run"] if dry_run else []), capture_output=True, text=True, timeout=600,
                       env={**__import__("os").environ, "PYTHONWARNINGS": ""})
    assert r.returncode == 0, r.stderr
    lines = [x for x in r.stderr.splitlines() if "warning" in x.lower()]
    capped = [x for x in lines if "eval split capped" in x]
    group = [x for x in lines if "rollout.group_size=1" in x]
    assert capped == ["offpolicy-moe train: warning: the problem space has only 100 problems; eval split capped at "
                      "50 (asked 80) so that training keeps at least half of it"]
    assert len(group) == 1 and group[0].startswith("offpolicy-moe train: warning: rollout.group_size=1 ")
    assert not [x for x in r.stderr.splitlines() if "UserWarning" in x or ".py:" in x or "warnings.warn" in x
                or x.startswith(" ")]


def test_warning_lines_join_and_deduplicate(capsys):
    import warnings

    from offpolicy_moe.commands.errors import WarningLines, warn

    with WarningLines("demo").capture() as lines:
        warn("a\n  - b")
        warnings.warn("library says x", UserWarning)
        warn("a\n  - b")
        warnings.warn("library says x", RuntimeWarning)
    assert capsys.readouterr().err.splitlines() == ["offpolicy-moe demo: warning: a; b",
                                                    "offpolicy-moe demo: warning: library says x"]
    assert lines.said == ["a; b", "library says x"]
