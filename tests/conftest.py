"""Shared test settings (small thread counts: CI has 2 cores; wandb never goes online) and the fixtures of the
tiny job (:mod:`tests.tiny`)."""
import os

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.tiny import free_port as _free_port  # noqa: E402
from tests.tiny import tiny_config  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture
def make_cfg(tmp_path):
    """``make_cfg(*overrides, run_dir=None)``: a tiny config in a fresh run folder under ``tmp_path``."""
    counter = {"n": 0}

    def make(*overrides, run_dir=None):
        counter["n"] += 1
        return tiny_config(run_dir or tmp_path / f"run{counter['n']}", *overrides)

    return make


@pytest.fixture
def free_port() -> int:
    """A free local TCP port."""
    return _free_port()


@pytest.fixture
def hide_package(monkeypatch):
    """``hide_package(name)``: for this test only, ``import name`` and every ``import name.sub`` fail as if the package
    were not installed, whether or not it is (the package and each submodule already imported are set to None in
    ``sys.modules``; monkeypatch restores them).  A test of the "not installed" path uses it instead of assuming the
    package is absent: the README installs every extra into the same venv."""
    import importlib.util
    import sys

    def hide(name: str) -> None:
        for mod in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
            monkeypatch.setitem(sys.modules, mod, None)
        monkeypatch.setitem(sys.modules, name, None)
        assert importlib.util.find_spec(name) is None

    return hide
