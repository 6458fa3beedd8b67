"""Tiny configs for the engine tests (a few seconds per run on one thread); imported by conftest and tests."""
from __future__ import annotations


TINY = [
    "model.num_layers=1", "model.hidden_size=32", "model.num_experts=4", "model.top_k=2",
    "task.eval_size=16", "task.reward=partial", "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=3",
    "rollout.batch_size=64", "trainer.steps=3", "trainer.eval_every=0", "trainer.log_every=100",
    "logging.progress=false", "logging.loggers=[jsonl]", "trainer.min_free_mb=1", "optim.lr=1e-2",
    "trainer.sft_warmup_steps=0",
]


def tiny_config(run_dir, *overrides):
    from offpolicy_moe.config.load import load_config

    cfg = load_config(None, TINY + list(overrides))
    cfg.run_dir = str(run_dir)
    return cfg


