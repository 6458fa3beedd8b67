"""The README's code must run as written, and its commands must match .ci/run."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


def test_loss_example_runs_and_trains():
    (block,) = [b for b in _blocks("python") if "from offpolicy_moe.losses import" in b]
    ns: dict = {}
    exec(compile(block, "README.md", "exec"), ns)
    assert ns["logp"].grad is not None and ns["logp"].grad.abs().sum() > 0
    assert ns["loss"].ndim == 0


def test_ci_runs_the_readme_install_and_test_commands():
    ci = (ROOT / ".ci" / "run").read_text()
    setup = _blocks("bash")[0]
    for line in setup.splitlines():
        cmd = line.split("#")[0].strip()
        if cmd.startswith("pip install"):
            assert cmd in ci, f"README install step {cmd!r} is not in .ci/run"
    assert "python -m pytest -q" in README and "python -m pytest -q\n" in ci
