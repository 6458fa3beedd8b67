"""The tiny job of the trainer, source, rollout and run tests (a few seconds per run on one thread), defined once; imported by the
conftests and the tests as ``tests.tiny``."""
from __future__ import annotations

import json
import socket
from pathlib import Path

from offpolicy_moe.config.load import load_config
from offpolicy_moe.config.schema import ModelConfig
from offpolicy_moe.models import load_policy

TINY = [
    "model.num_layers=1", "model.hidden_size=32", "model.num_experts=4", "model.top_k=2",
    "task.eval_size=16", "task.reward=partial", "rollout.prompts_per_step=4", "rollout.group_size=4",
    "rollout.max_new_tokens=3",
    "rollout.batch_size=64", "trainer.steps=3", "trainer.eval_every=0", "trainer.log_every=100",
    "logging.progress=false", "logging.loggers=[jsonl]", "trainer.min_free_mb=1", "optim.lr=1e-2",
    "trainer.sft_warmup_steps=0",
]


def tiny_config(run_dir, *overrides):
    """The tiny job's ``TrainConfig`` writing to ``run_dir``, with dotted ``overrides``."""
    cfg = load_config(None, TINY + list(overrides))
    cfg.run_dir = str(run_dir)
    return cfg


def tiny_policy(num_layers: int = 1, seed: int = 0, task=None):
    """A tiny 4-expert top-2 MoE policy and its tokenizer."""
    return load_policy(ModelConfig(num_layers=num_layers, hidden_size=32, num_experts=4, top_k=2), seed=seed,
                       task=task)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (for a torch.distributed rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_fused_or_not(cfg, fuse: bool):
    """Train ``cfg`` with ``trainer.fuse_old_logp=fuse`` (checking that the trainer fuses exactly then); returns
    the metric rows without ``perf/*`` and the final weights."""
    from offpolicy_moe.logprobs import Fused
    from offpolicy_moe.trainer.trainer import Trainer

    cfg.trainer.fuse_old_logp = fuse
    tr = Trainer(cfg)
    assert isinstance(tr.stage.strategy, Fused) is fuse
    tr.run()
    rows = [json.loads(x) for x in open(Path(cfg.run_dir) / "metrics.jsonl")]
    rows = [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows]
    return rows, {k: v.clone() for k, v in tr.unwrapped.state_dict().items()}


def rollout_engine(model, tok, *, record_routes: bool = False, seed: int = 0, router_offsets=None, **rollout):
    """The Hugging Face rollout engine of ``RolloutConfig(**rollout)``, built as the trainer builds it (its config
    section; ``seed``: the run's seed, which draws ``rollout.router_perturb``'s perturbation)."""
    from offpolicy_moe.config.schema import RolloutConfig
    from offpolicy_moe.rollout.engine import HFRolloutEngine

    offsets = {k: rollout.pop(k) for k in list(rollout) if k.startswith("pr2_")} or router_offsets
    return HFRolloutEngine(model, tok, RolloutConfig(**rollout), record_routes=record_routes, seed=seed,
                           router_offsets=offsets)
