"""The trainer's evaluation: when a step ends with one, the greedy accuracy of the policy on the held-out split and
on as many training prompts, with a watch on the logits that decoding picks from, and with ``eval.samples`` > 0 the
sampled metrics of the held-out split (:mod:`~offpolicy_moe.trainer.sampled_eval`)."""
from __future__ import annotations

from typing import Any, Optional

import torch

from offpolicy_moe.run import probes
from offpolicy_moe.run.full_state import full_model_state
from offpolicy_moe.run.nonfinite import NonFiniteError, watch_logits
from offpolicy_moe.rollout.greedy import greedy_completions
from offpolicy_moe.tasks.evaluation import greedy_metrics
from offpolicy_moe.trainer.sampled_eval import SampledEvaluator

__all__ = ["eval_due", "evaluate_policy", "greedy_evaluation"]


def eval_due(trainer_cfg: Any, step: int) -> bool:
    """Whether trained step ``step`` ends with an evaluation (every ``trainer.eval_every``, and the last)."""
    tc = trainer_cfg
    return (tc.eval_every > 0 and step % tc.eval_every == 0) or step == tc.steps


def greedy_evaluation(model: torch.nn.Module, tok: Any, task: Any, *, max_new_tokens: int, batch_size: int,
                      train_split: bool = True, lean: bool = True) -> dict[str, float]:
    """Greedy accuracy and the task's rewards (:func:`~offpolicy_moe.tasks.evaluation.greedy_metrics`) on the
    held-out split (``eval/*``) and, with ``train_split``, on as many training prompts, the first ones of the split
    (``eval/train_*``), decoded by :func:`~offpolicy_moe.rollout.greedy.greedy_completions` (``generate``'s greedy
    tokens, about twice as fast on the long-tailed task; ``lean``: ``rollout.decode_forward=lean``).  An empty
    held-out split raises ``ValueError``."""
    held_out = task.rows("eval")
    if not held_out["prompt"]:
        raise ValueError("the task has no held-out problems to evaluate")
    splits = [("eval/", held_out, task)]
    if train_split:
        splits.append(("eval/train_", task.rows("train", len(held_out["prompt"])), None))
    out: dict[str, float] = {}
    for prefix, rows, scorer in splits:
        completions = greedy_completions(model, tok, rows["prompt"], max_new_tokens=max_new_tokens,
                                         batch_size=batch_size, lean=lean)
        out.update(greedy_metrics(completions, rows["answer"], prompts=rows["prompt"], prefix=prefix, task=scorer))
    return out


def evaluate_policy(model: torch.nn.Module, tok: Any, task: Any, cfg: Any, step: int,
                    sampled: Optional[SampledEvaluator] = None, *, train_split: bool = True) -> dict[str, float]:
    """Greedy accuracy on the held-out split (``eval/accuracy``, ``eval/partial``) and, with ``train_split``, on as
    many training prompts (the first ones of the train split: ``eval/train_accuracy``, ``eval/train_partial``).  A
    NaN or infinite next-token logit (greedy decoding would pick a token from it silently) raises
    :class:`NonFiniteError` (stage ``evaluation``, at ``step``).  With ``sampled``, also the sampled metrics of the
    held-out split under the model's current weights (``eval/avg@n``, ``eval/pass@k``, ``eval/maj@k``, ...,
    ``perf/time_eval_sampled_s``; collective when the model is sharded)."""
    with watch_logits(model) as watch, probes.poisoned("evaluation", step, model):
        out = greedy_evaluation(model, tok, task, max_new_tokens=cfg.rollout.max_new_tokens,
                                batch_size=cfg.trainer.eval_batch_size, train_split=train_split,
                                lean=cfg.rollout.decode_forward == "lean")
    if watch.bad:
        raise NonFiniteError("evaluation", "next-token logits of greedy decoding", step=step)
    if sampled is not None:
        out.update(sampled.evaluate(task, state_dict=full_model_state(model), step=step))
    return out
