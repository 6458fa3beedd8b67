"""Fixtures of the engine tests (the tiny job of :mod:`tests.engine.tiny`)."""
from __future__ import annotations

import pytest

from tests.engine.tiny import free_port as _free_port
from tests.engine.tiny import tiny_config


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
