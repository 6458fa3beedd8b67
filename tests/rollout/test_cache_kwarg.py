"""The native sampler and the shared-cache forward find the model's KV-cache keyword under either name.

transformers 5.24 renamed ``forward(past_key_values=...)`` to ``forward(cache=...)``; a check of the old name alone
made every model of 5.24 fall back to ``model.generate`` silently (and turned the shared-prompt forward off)."""
from __future__ import annotations

import copy

import torch

from offpolicy_moe.models.layout import CACHE_KWARGS, cache_kwarg
from offpolicy_moe.models.response_logprobs import _can_share
from offpolicy_moe.rollout.worker import build_engine
from offpolicy_moe.trainer.trainer import Trainer
from tests.tiny import tiny_config


class _Old(torch.nn.Module):
    def forward(self, input_ids=None, past_key_values=None, position_ids=None):
        return input_ids


class _New(torch.nn.Module):
    def forward(self, input_ids=None, cache=None, position_ids=None):
        return input_ids


class _None(torch.nn.Module):
    def forward(self, input_ids=None):
        return input_ids


def test_cache_keyword_under_either_name():
    assert cache_kwarg(_Old()) == "past_key_values"
    assert cache_kwarg(_New()) == "cache"
    assert cache_kwarg(_None()) is None
    assert set(CACHE_KWARGS) == {"cache", "past_key_values"}


def test_the_installed_transformers_model_takes_the_native_sampler(tmp_path):
    cfg = tiny_config(tmp_path / "run", "rollout.max_new_tokens=4", "rollout.dtype=float32")
    trainer = Trainer(cfg)
    assert cache_kwarg(trainer.unwrapped) in CACHE_KWARGS
    engine = build_engine(cfg, copy.deepcopy(trainer.unwrapped), trainer.tok)
    assert engine.sampler == "native"
    assert _can_share(trainer.unwrapped)
