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
