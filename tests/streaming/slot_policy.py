"""The slot sampler tests' policy: a 2-layer tiny MoE whose EOS is likely enough that rows finish at many steps."""
from __future__ import annotations

import torch

from offpolicy_moe.config.schema import ModelConfig, TaskConfig
from offpolicy_moe.models import load_policy
from offpolicy_moe.tasks import make_task


def make_policy():
    """``(model, tokenizer, task)``: the default task, and its EOS logit raised so that rows finish often."""
    torch.manual_seed(0)
    task = make_task(TaskConfig())
    model, tok = load_policy(ModelConfig(num_layers=2, hidden_size=32, num_experts=4, top_k=2), seed=5, task=task)
    with torch.no_grad():
        model.lm_head.weight[tok.eos_token_id] += 0.6 * model.lm_head.weight[3:13].mean(0)
    return model, tok, task
