"""The trainer's evaluation: when a step ends with one, the greedy accuracy of the policy on the held-out split and
on as many training prompts, with a watch on the logits that decoding picks from, and with ``eval.samples`` > 0 the
sampled metrics of the held-out split (:mod:`~offpolicy_moe.trainer.sampled_eval`)."""
from __future__ import annotations

from typing import Any, Optional

import torch

from offpolicy_moe.run import probes
from offpolicy_moe.run.full_state import full_model_state
from offpolicy_moe.run.nonfinite import NonFiniteError, watch_logits
from offpolicy_moe.tasks import evaluate_greedy
from offpolicy_moe.trainer.sampled_eval import SampledEvaluator

__all__ = ["eval_due", "evaluate_policy"]


def eval_due(trainer_cfg: Any, step: int) -> bool:
    """Whether trained step ``step`` ends with an evaluation (every ``trainer.eval_every``, and the last)."""
    tc = trainer_cfg
    return (tc.eval_every > 0 and step % tc.eval_every == 0) or step == tc.steps


def evaluate_policy(model: torch.nn.Module, tok: Any, task: Any, cfg: Any, step: int,
                    sampled: Optional[SampledEvaluator] = None, *, train_split: bool = True) -> dict[str, float]:
    """Greedy accuracy on the held-out split (``eval/accuracy``, ``eval/partial``) and, with ``train_split``, on as
    many training prompts (the first ones of the train split: ``eval/train_accuracy``, ``eval/train_partial``).  A
    NaN or infinite next-token logit (greedy decoding would pick a token from it silently) raises
    :class:`NonFiniteError` (stage ``evaluation``, at ``step``).  With ``sampled``, also the sampled metrics of the
    held-out split under the model's current weights (``eval/avg@n``, ``eval/pass@k``, ``eval/maj@k``, ...,
    ``perf/time_eval_sampled_s``; collective when the model is sharded)."""
    kw = dict(max_new_tokens=cfg.rollout.max_new_tokens, batch_size=cfg.trainer.eval_batch_size)
    with watch_logits(model) as watch, probes.poisoned("evaluation", step, model):
        out = evaluate_greedy(model, tok, task.eval_dataset, task=task, **kw)
        if train_split:
            train_ds = task.train_dataset
            n = min(len(train_ds), max(len(task.eval_dataset), 1))
            out.update(evaluate_greedy(model, tok, train_ds.select(range(n)), prefix="eval/train_", **kw))
    if watch.bad:
        raise NonFiniteError("evaluation", "next-token logits of greedy decoding", step=step)
    if sampled is not None:
        out.update(sampled.evaluate(task, state_dict=full_model_state(model), step=step))
    return out
