"""One vLLM engine in this process on one expert kernel path, a weight sync, a generation: the figures as JSON.

    python -m tests.vllm.kernel_path_run --dtype float32 [--force-torch-loop] [--replace-experts]
                                         [--drop-experts-from-syncs]

Run by ``tests/vllm/test_vllm_kernel_paths.py`` in a fresh interpreter per case, so that a forced kernel path (a
patch of vLLM's own choice, which must be in place before the engine builds its layers) and vLLM's in-process
state never leak between cases.  ``--replace-experts`` installs new expert parameters on every MoE layer with vLLM's
own ``replace_parameter`` after the start, as its grouped-GEMM path does with the prepacked weights (parameters
without a weight loader), so a sync that writes into processed parameters fails here on any CPU.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from offpolicy_moe.config import load_config
from offpolicy_moe.models.loading import build_model
from offpolicy_moe.rollout import vllm_worker
from offpolicy_moe.rollout.vllm_engine import VLLMEngineError, VLLMRolloutEngine
from offpolicy_moe.tasks import build_char_tokenizer
from tests.vllm.conftest import ANSWERS, PROMPTS, TEMPERATURE, trainer_logp


def replace_experts(worker) -> int:
    """Install fresh copies of every MoE layer's expert parameters with vLLM's ``replace_parameter`` (what the
    grouped-GEMM path does with its prepacked weights); returns how many layers."""
    from vllm.model_executor.layers.quantization.utils.layer_utils import replace_parameter

    n = 0
    for _, module in worker.model_runner.get_model().named_modules():
        if getattr(getattr(module, "quant_method", None), "cpu_fused_moe", None) is None:
            continue
        for name in ("w13_weight", "w2_weight"):
            replace_parameter(module, name, getattr(module, name).detach().clone())
        n += 1
    return n


def drop_experts_from_syncs() -> None:
    """Make every sync leave the experts at their old values while reporting a complete load (a loader that misses
    tensors silently): only the value check can see it."""
    from safetensors.torch import load_file, save_file

    own = vllm_worker.load_weights

    def load_weights(worker, path: str) -> list[str]:
        save_file({k: v for k, v in load_file(path).items() if ".experts." not in k}, path)
        own(worker, path)
        return []

    vllm_worker.load_weights = load_weights


def force_torch_loop() -> None:
    """Make vLLM's CPU MoE choose its per-expert torch loop (the AVX2 path) on any x86 CPU."""
    from vllm.model_executor.layers.fused_moe import cpu_fused_moe

    cpu_fused_moe.CPUFusedMOE.check_grouped_gemm = lambda self, layer: (False, "none")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dtype", default="float32")
    p.add_argument("--force-torch-loop", action="store_true")
    p.add_argument("--replace-experts", action="store_true")
    p.add_argument("--drop-experts-from-syncs", action="store_true")
    args = p.parse_args()
    if args.drop_experts_from_syncs:
        drop_experts_from_syncs()
    if args.force_torch_loop:
        force_torch_loop()
    tok = build_char_tokenizer()
    cfg = load_config(overrides=["rollout.engine=vllm", f"rollout.dtype={args.dtype}", "rollout.max_new_tokens=8",
                                 f"rollout.temperature={TEMPERATURE}"])
    first, second = build_model(cfg.model, tok, seed=0), build_model(cfg.model, tok, seed=1)
    engine = VLLMRolloutEngine(first, tok, cfg.rollout, seed=0, in_process=True)
    out: dict = {"kernels": engine.llm.collective_rpc(vllm_worker.expert_kernels)[0]}
    if args.replace_experts:
        out["replaced_layers"] = engine.llm.collective_rpc(replace_experts)[0]
    try:
        engine.sync(second.state_dict(), 1)
    except VLLMEngineError as exc:
        out["sync_error"] = str(exc)
    else:
        out["probe"] = {"max_abs_diff": engine.last_probe.max_abs_diff, "tolerance": engine.last_probe.tolerance}
        batch = engine.generate(PROMPTS, ANSWERS, group_size=4, seed=7)
        mask = batch.response_mask.bool()
        out["generation_max_abs_diff"] = float((trainer_logp(second, batch, TEMPERATURE) - batch.behav_logp)[mask]
                                               .abs().max())
        out["stale_max_abs_diff"] = float((trainer_logp(first, batch, TEMPERATURE) - batch.behav_logp)[mask]
                                          .abs().max())
    engine.close()
    sys.stdout.write("RESULT " + json.dumps(out) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    with torch.no_grad():
        main()
