"""The trainer's greedy evaluation: when a step ends with one, and the accuracy of the policy on the held-out split
and on as many training prompts, with a watch on the logits that decoding picks from."""
from __future__ import annotations

from typing import Any

import torch

from offpolicy_moe.run import probes
from offpolicy_moe.run.nonfinite import NonFiniteError, watch_logits
from offpolicy_moe.tasks import evaluate_greedy

__all__ = ["eval_due", "evaluate_policy"]


def eval_due(trainer_cfg: Any, step: int) -> bool:
    """Whether trained step ``step`` ends with an evaluation (every ``trainer.eval_every``, and the last)."""
    tc = trainer_cfg
    return (tc.eval_every > 0 and step % tc.eval_every == 0) or step == tc.steps


def evaluate_policy(model: torch.nn.Module, tok: Any, task: Any, cfg: Any, step: int) -> dict[str, float]:
    """Greedy accuracy on the held-out split (``eval/accuracy``, ``eval/partial``) and on as many training
    prompts (the first ones of the train split: ``eval/train_accuracy``, ``eval/train_partial``).  A NaN or
    infinite next-token logit (greedy decoding would pick a token from it silently) raises
    :class:`NonFiniteError` (stage ``evaluation``, at ``step``)."""
    kw = dict(max_new_tokens=cfg.rollout.max_new_tokens, batch_size=cfg.trainer.eval_batch_size)
    with watch_logits(model) as watch, probes.poisoned("evaluation", step, model):
        out = evaluate_greedy(model, tok, task.eval_dataset, task=task, **kw)
        train_ds = task.train_dataset
        n = min(len(train_ds), max(len(task.eval_dataset), 1))
        out.update(evaluate_greedy(model, tok, train_ds.select(range(n)), prefix="eval/train_", **kw))
    if watch.bad:
        raise NonFiniteError("evaluation", "next-token logits of greedy decoding", step=step)
    return out
