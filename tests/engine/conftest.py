"""Fixtures of the engine tests."""
from __future__ import annotations

import pytest
from engine_tiny import tiny_config


@pytest.fixture
def make_cfg(tmp_path):
    counter = {"n": 0}

    def make(*overrides, run_dir=None):
        counter["n"] += 1
        return tiny_config(run_dir or tmp_path / f"run{counter['n']}", *overrides)

    return make
