"""The end-to-end benchmark job shared by ``bench_vs_trl.py`` and ``profile_step.py``: its command-line knobs and
its definition as trainer overrides (tiny Qwen3-MoE, GRPO, no replay, fp32 engine, on-policy, one update per step).
"""
from __future__ import annotations

import argparse
import resource

import torch

# knobs of the job (also forwarded to bench_vs_trl's child processes)
JOB_ARGS = ("threads", "prompts", "group", "max_new_tokens", "layers", "hidden", "experts", "digits", "lr", "seed",
            "no_eos")
# measurements TRL has no equivalent of: routing metrics (the engine would record routes) and the counterfactual
# "with R3" mismatch pass
LEAN = ["algo.routing.metrics=false", "trainer.mismatch_metrics=false"]


def add_job_args(p: argparse.ArgumentParser) -> None:
    """``--threads --prompts --group --max-new-tokens --layers --hidden --experts --digits --lr --seed``."""
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=6)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--digits", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-eos", type=int, default=0, choices=(0, 1),
                   help="1: the end-of-sequence token gets logit -1e9 in every model of both systems, so every "
                        "response runs to --max-new-tokens (scaling runs measure the nominal length)")


def forbid_token(model: torch.nn.Module, token_id: int) -> torch.utils.hooks.RemovableHandle:
    """Give ``token_id`` the logit -1e9 in every forward of ``model`` (a hook on its output embedding): sampling
    never draws it, and the log-probs of every other token stay finite and differentiable."""
    def hook(module, args, out):
        return out.index_fill(-1, torch.tensor([token_id], device=out.device), -1e9)
    return model.get_output_embeddings().register_forward_hook(hook)


def peak_rss_mb() -> float:
    """The process's peak resident memory so far, MiB (``ru_maxrss``, KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0

def job_overrides(args: argparse.Namespace, steps: int) -> list[str]:
    """The job as trainer overrides, ``steps`` trained steps, default measurements (add :data:`LEAN` to drop them)."""
    return [
        "preset=[grpo]", f"seed={args.seed}", f"task.max_digits={args.digits}",
        f"model.num_layers={args.layers}", f"model.hidden_size={args.hidden}", f"model.num_experts={args.experts}",
        "rollout.dtype=float32", f"rollout.prompts_per_step={args.prompts}", f"rollout.group_size={args.group}",
        f"rollout.max_new_tokens={args.max_new_tokens}", "rollout.temperature=1.0", "rollout.top_p=1.0",
        "buffer.staleness=0", "algo.routing.replay=none", "algo.correction.mode=none",
        "algo.loss.agg=token-mean", f"optim.lr={args.lr}", "optim.grad_clip=1.0",
        f"trainer.steps={steps}", "trainer.updates_per_step=1", "trainer.sft_warmup_steps=0",
        f"trainer.eval_every={10**6}", f"trainer.log_every={10**6}", f"trainer.threads={args.threads}",
        "task.eval_size=8", "logging.loggers=[jsonl]", "logging.progress=false",
    ]
