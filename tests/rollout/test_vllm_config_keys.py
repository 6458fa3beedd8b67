"""The vLLM engine's GPU keys in the config: refused with another engine, their ranges, and the combinations the
config alone shows cannot work (each one line naming the key, before any compute)."""
from __future__ import annotations

import pytest

from offpolicy_moe.config import load_config
from offpolicy_moe.config.validate import ConfigError, validate


def _refused(overrides: list[str], match: str) -> None:
    """Refused; each problem is one line (a message of several problems lists one a line)."""
    with pytest.raises(ConfigError, match=match) as err:
        validate(load_config(overrides=overrides))
    lines = str(err.value).splitlines()
    assert len(lines) == 1 or all(x.startswith("  - ") for x in lines[1:])


@pytest.mark.parametrize("key", ["rollout.vllm_gpu_memory_utilization=0.8", "rollout.vllm_max_model_len=4096",
                                 "rollout.vllm_routes=hooks", "rollout.vllm_devices=[1]"])
def test_a_vllm_key_with_another_engine_is_refused(key):
    _refused([key], rf"{key.split('=')[0]} sets the vLLM engine, but rollout.engine=hf")


@pytest.mark.parametrize("override, match", [
    ("rollout.vllm_gpu_memory_utilization=0", r"rollout.vllm_gpu_memory_utilization: must be in \(0, 1\]"),
    ("rollout.vllm_gpu_memory_utilization=1.5", r"rollout.vllm_gpu_memory_utilization: must be in \(0, 1\]"),
    ("rollout.vllm_max_model_len=1", r"rollout.vllm_max_model_len: must be >= 2 .*\n.*shorter than one sequence"),
    ("rollout.vllm_routes=kernel", "rollout.vllm_routes: unknown value 'kernel'"),
    ("rollout.vllm_max_model_len=4", r"rollout.vllm_max_model_len=4: shorter than one sequence"),
    ("rollout.vllm_devices=[0,0]", r"rollout.vllm_devices=\[0, 0\]: expected distinct GPU indices"),
    ("rollout.vllm_devices=[-1]", r"rollout.vllm_devices=\[-1\]: expected distinct GPU indices"),
    ("rollout.vllm_eager=false", None),                              # hooks or native: the engine decides
])
def test_vllm_key_ranges(override, match):
    overrides = ["rollout.engine=vllm", override]
    if match is None:
        validate(load_config(overrides=overrides))
    else:
        _refused(overrides, match)


def test_hooks_without_eager_are_refused_when_routes_are_recorded():
    base = ["rollout.engine=vllm", "rollout.vllm_routes=hooks", "rollout.vllm_eager=false"]
    _refused(base, "rollout.vllm_routes=hooks with rollout.vllm_eager=false")
    validate(load_config(overrides=base + ["algo.routing.metrics=false"]))          # no routes recorded


def test_device_keys_by_backend():
    ray = ["rollout.engine=vllm", "buffer.mode=async", "buffer.staleness=1", "rollout.backend=ray"]
    _refused(ray + ["rollout.vllm_devices=[0]"], "rollout.vllm_devices with rollout.backend=ray")
    assert validate(load_config(overrides=ray + ["rollout.ray_num_gpus=2"])) == []
    warnings = validate(load_config(overrides=["rollout.ray_num_gpus=1"]))
    assert any(w.startswith("rollout.ray_num_gpus=1.0 has no effect with rollout.backend=local") for w in warnings)
    _refused(ray + ["rollout.ray_num_gpus=-1"], "rollout.ray_num_gpus: must be >= 0")
