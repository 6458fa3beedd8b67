"""The model, task and config a sampler benchmark runs on, shared by ``bench_decode_forward.py`` and
``bench_sampler_copies.py``: the embedded preset (random weights) or a Hugging Face folder (``--model-path``, e.g. a
warm start kept by ``bench_tta.py --warm-cache``), with the benchmark's ``--set`` overrides and its sampling shape."""
from __future__ import annotations

import argparse
from typing import Any

import torch

from offpolicy_moe.config.load import load_config
from offpolicy_moe.models import load_policy
from offpolicy_moe.tasks import make_task


def bench_policy(args: argparse.Namespace) -> tuple[Any, Any, torch.nn.Module, Any]:
    """``(cfg, task, model, tokenizer)`` for ``args`` (``set``, ``max_new_tokens``, ``prompts``, ``group``,
    ``model_path``, ``seed``): a float32 engine whose static batch holds ``prompts x group`` rows; the model in eval
    mode."""
    overrides = [*args.set, f"rollout.max_new_tokens={args.max_new_tokens}", "rollout.dtype=float32",
                 f"rollout.batch_size={args.prompts * args.group}"]
    if args.model_path:
        overrides.append(f"model.path={args.model_path}")
    cfg = load_config(None, overrides)
    task = make_task(cfg.task)
    model, tok = load_policy(cfg.model, seed=args.seed, task=task, progress=False)
    model.eval()
    return cfg, task, model, tok
