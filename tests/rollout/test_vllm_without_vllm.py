"""``rollout.engine=vllm`` where vLLM is not installed (the default suite's environment), the config refusals that
belong to the vLLM engine, and the positions whose routes reach a scored log-prob (what ``routing/replay_fallback``
counts); the engine itself is tested against the real vLLM under the ``vllm`` marker (tests/vllm)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from offpolicy_moe.config import load_config
from offpolicy_moe.config.validate import ConfigError, validate
from offpolicy_moe.sources.modes import validate_run
from offpolicy_moe.models.loading import build_model
from offpolicy_moe.rollout import vllm_worker
from offpolicy_moe.rollout.engine import make_engine
from offpolicy_moe.rollout.vllm_engine import VLLMEngineError
from offpolicy_moe.tasks import build_char_tokenizer
from offpolicy_moe.logprobs import conditioning_positions


def test_the_vllm_engine_without_vllm_is_one_line_naming_the_extra(hide_package):
    """vLLM hidden for this test: it runs whether the vllm extra is installed or not."""
    hide_package("vllm")
    cfg = load_config(overrides=["rollout.engine=vllm", "model.head_dim=32"])
    tok = build_char_tokenizer()
    with pytest.raises(VLLMEngineError, match=r'pip install -e "\.\[vllm\]"') as err:
        make_engine(build_model(cfg.model, tok, seed=0), tok, cfg.rollout, seed=0)
    assert "\n" not in str(err.value)


def test_vllm_refusals_in_the_config():
    with pytest.raises(ConfigError, match="rollout.update_in_flight=true with rollout.engine=vllm"):
        validate_run(load_config(overrides=["rollout.engine=vllm", "rollout.update_in_flight=true",
                                            "buffer.mode=async", "buffer.staleness=1"]))
    for key in ("rollout.vllm_kv_cache_mib=512", "rollout.vllm_eager=false"):
        with pytest.raises(ConfigError, match=rf"{key.split('=')[0]} sets the vLLM engine, but rollout.engine=hf"):
            validate(load_config(overrides=[key]))
    validate(load_config(overrides=["rollout.engine=vllm", "rollout.vllm_eager=false"]))     # accepted


def test_conditioning_positions_leave_out_each_rows_last_attended_token():
    am = torch.tensor([[0, 1, 1, 1, 1, 0],     # left-padded prompt, response ended before the end (EOS)
                       [1, 1, 1, 1, 1, 1],     # response ran to the last column
                       [0, 0, 1, 1, 0, 0]])
    want = torch.tensor([[0, 1, 1, 1, 0, 0],
                         [1, 1, 1, 1, 1, 0],
                         [0, 0, 1, 0, 0, 0]], dtype=torch.bool)
    assert torch.equal(conditioning_positions(am), want)


def test_routes_cross_vllms_rpc_as_bytes_and_come_back_equal():
    pos = np.array([3, 4, 5], dtype=np.int64)
    ids = np.arange(3 * 2 * 2, dtype=np.int16).reshape(3, 2, 2)
    raw = {"req-1": (pos.tobytes(), ids.tobytes(), ids.shape)}
    back = vllm_worker.decode_routes(raw)
    assert np.array_equal(back["req-1"][0], pos) and np.array_equal(back["req-1"][1], ids)


def test_a_loaders_shorter_parameter_name_reaches_the_parameter():
    """vLLM's fused-MoE wrapper answers for ``...experts.routed_experts.w13_weight`` as ``...experts.w13_weight``."""
    model = torch.nn.Module()
    model.experts = torch.nn.Module()
    model.experts.routed_experts = torch.nn.Module()
    model.experts.routed_experts.w13_weight = torch.nn.Parameter(torch.zeros(1))
    model.norm = torch.nn.Module()
    model.norm.weight = torch.nn.Parameter(torch.zeros(1))
    assert vllm_worker._unfilled(model, {"experts.w13_weight", "norm.weight"}) == []
    assert vllm_worker._unfilled(model, {"experts.w13_weight"}) == ["norm.weight"]
    assert vllm_worker._unfilled(model, {"experts.w2_weight", "norm.weight"}) == ["experts.routed_experts.w13_weight"]
