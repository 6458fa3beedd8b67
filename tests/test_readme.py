"""The README's code must run as written, and its commands must match .ci/run."""
import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


def _run(block: str) -> dict:
    ns: dict = {"__name__": "__readme__"}
    exec(compile(block, "README.md", "exec"), ns)
    return ns


MAX_README_CHARS = 15_000


def test_readme_stays_short():
    """Details live in docs/; the README is the front page (its limit in characters, not bytes)."""
    assert len(README) <= MAX_README_CHARS, f"README.md has {len(README)} characters; move details to docs/"


def test_readme_has_python_blocks():
    assert len(_blocks("python")) >= 2


@pytest.mark.parametrize("index", range(len(_blocks("python"))))
def test_every_python_block_runs_as_written(index):
    _run(_blocks("python")[index])


def test_loss_example_runs_and_trains():
    (block,) = [b for b in _blocks("python") if "from offpolicy_moe.losses import" in b]
    ns = _run(block)
    assert ns["logp"].grad is not None and ns["logp"].grad.abs().sum() > 0
    assert ns["loss"].ndim == 0


def test_routing_example_replays_the_recorded_routes():
    (block,) = [b for b in _blocks("python") if "RoutingController" in b]
    ns = _run(block)
    seqs, routes, logits = ns["seqs"], ns["routes"], ns["logits"]
    assert torch.is_tensor(seqs) and logits.shape[:2] == seqs.shape
    assert tuple(routes.ids.shape[:2]) == tuple(seqs.shape)
    # the trainer's own top-k, recorded on the same tokens by the same fp32 model, equals the engine's routes
    assert ns["routing_metrics"](routes, ns["own"].trace())["routing/decision_mismatch"] == 0.0


def test_ci_runs_the_readme_install_and_test_commands():
    ci = (ROOT / ".ci" / "run").read_text()
    setup = _blocks("bash")[0]
    for line in setup.splitlines():
        cmd = line.split("#")[0].strip()
        if cmd.startswith("pip install"):
            assert cmd in ci, f"README install step {cmd!r} is not in .ci/run"
    assert "python -m pytest -q" in README and "python -m pytest -q\n" in ci
