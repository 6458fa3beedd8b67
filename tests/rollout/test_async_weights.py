"""The shared-memory weight board of the async pipeline: versions, torn reads retried, named timeouts."""
from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from offpolicy_moe.rollout.weights import WeightBoard, WeightWaitTimeout


class _Engine:
    """The engine interface the board needs: ``version``, ``sync(state, version)`` (a copy of the tensors) and
    ``forget_version()``."""

    def __init__(self, during_copy=None):
        self.version, self.weights, self.during_copy = -1, {}, during_copy

    def forget_version(self):
        self.version = -1

    def sync(self, state, version):
        self.weights = {"a": state["a"].clone()}
        if self.during_copy is not None:
            hook, self.during_copy = self.during_copy, None
            hook()
        self.weights["b"] = state["b"].clone()
        self.version = version


def _state(x: float) -> dict:
    return {"a": torch.full((3,), x), "b": torch.full((2, 2), x)}


def _board() -> WeightBoard:
    return WeightBoard(_state(0.0), mp.get_context("spawn"))


def test_versions_are_loaded_once_and_in_order():
    board, eng = _board(), _Engine()
    assert board.version == -1 and board.load_into(eng) is False
    board.publish(_state(1.0), 0)
    assert board.load_into(eng) is True and eng.version == 0 and float(eng.weights["b"][0, 0]) == 1.0
    assert board.load_into(eng) is False
    board.publish(_state(2.0), 1)
    board.publish(_state(3.0), 2)
    assert board.load_into(eng) is True and eng.version == 2 and float(eng.weights["a"][0]) == 3.0
    with pytest.raises(ValueError, match="older than the published 2"):
        board.publish(_state(4.0), 1)
    with pytest.raises(KeyError, match="missing"):
        board.publish({"a": torch.zeros(3)}, 3)


def test_a_copy_torn_by_two_publishes_is_read_again():
    board = _board()
    board.publish(_state(1.0), 0)
    # while the engine copies version 0, the trainer publishes 1 (other copy) and 2 (the copy being read)
    eng = _Engine(during_copy=lambda: (board.publish(_state(2.0), 1), board.publish(_state(3.0), 2)))
    assert board.load_into(eng) is True
    assert eng.version == 2
    assert float(eng.weights["a"][0]) == float(eng.weights["b"][0, 0]) == 3.0      # one version, not a mix


def test_waiting_for_a_version_times_out_naming_it():
    board = _board()
    board.publish(_state(1.0), 3)
    # a version already published is not waited for: with no time allowed at all, any wait would time out
    waited = board.wait_for(2, timeout=0.0)
    assert isinstance(waited, float) and waited >= 0.0
    with pytest.raises(WeightWaitTimeout, match=r"policy version 5 \(newest published: 3\) for iteration 9"):
        board.wait_for(5, timeout=0.05, what="iteration 9")
