"""Greedy evaluation on a held-out split: batched, KV-cached ``generate`` with left padding."""
from __future__ import annotations

from typing import Any, Sequence

import torch

from .rewards import compute_rewards
from .tokenizer import decode_completions, encode_prompts


@torch.no_grad()
def greedy_completions(model, tok, prompts: Sequence[str], *, max_new_tokens: int = 6,
                       batch_size: int = 128) -> list[str]:
    """Greedy (argmax) completion of each prompt, decoded and cut at eos.

    Prompts are encoded as ``bos + prompt`` and left-padded; ``generate`` runs with the KV cache and
    stops each row at ``eos`` (later positions are ``pad``).
    """
    if max_new_tokens < 1 or batch_size < 1:
        raise ValueError(f"max_new_tokens and batch_size must be >= 1, got {max_new_tokens}, {batch_size}")
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    out: list[str] = []
    try:
        for start in range(0, len(prompts), batch_size):
            ids, mask = encode_prompts(tok, list(prompts[start:start + batch_size]))
            ids, mask = ids.to(device), mask.to(device)
            gen = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens,
                                 eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, use_cache=True,
                                 temperature=None, top_p=None, top_k=None)
            out.extend(decode_completions(tok, gen[:, ids.shape[1]:]))
    finally:
        model.train(was_training)
    return out


def evaluate_greedy(model, tok, dataset, *, max_new_tokens: int = 6, batch_size: int = 128,
                    prefix: str = "eval/", task: Any = None) -> dict[str, float]:
    """Greedy accuracy on ``dataset`` (rows with ``prompt`` and ``answer``).

    Returns ``{"eval/accuracy": mean exact match, "eval/partial": mean per-digit partial credit}``
    (see :mod:`offpolicy_moe.tasks.rewards`); with ``task``, also the task's own rewards of the same completions
    (:meth:`~offpolicy_moe.tasks.base.PromptAnswerTask.score`): ``eval/reward`` (mean of the weighted sum ``R_i``)
    and ``eval/reward/<name>`` (mean of each reward), e.g. ``eval/reward/math`` for a math dataset.
    """
    prompts, answers = list(dataset["prompt"]), list(dataset["answer"])
    if not prompts:
        raise ValueError("evaluate_greedy got an empty dataset")
    completions = greedy_completions(model, tok, prompts, max_new_tokens=max_new_tokens, batch_size=batch_size)
    return greedy_metrics(completions, answers, prompts=prompts, prefix=prefix, task=task)


def greedy_metrics(completions: Sequence[str], answers: Sequence[str], *, prompts: Sequence[str] = (),
                   prefix: str = "eval/", task: Any = None) -> dict[str, float]:
    """The metrics of :func:`evaluate_greedy` from completions already decoded: ``accuracy`` (mean exact match),
    ``partial`` (mean per-digit partial credit) and, with ``task``, ``reward`` (mean of ``R_i = sum_k w_k r_k(i)``)
    and ``reward/<name>``, each under ``prefix``."""
    if len(completions) != len(answers) or not answers:
        raise ValueError(f"greedy_metrics needs one completion per answer and at least one; got {len(completions)} "
                         f"completions for {len(answers)} answers")
    exact = compute_rewards(completions, answers, "exact")
    partial = compute_rewards(completions, answers, "partial")
    out = {f"{prefix}accuracy": sum(exact) / len(exact), f"{prefix}partial": sum(partial) / len(partial)}
    if task is not None:
        scores = task.score(completions, answers, prompts=prompts)
        out[f"{prefix}reward"] = sum(scores.total) / len(scores.total)
        out.update({f"{prefix}reward/{name}": sum(v) / len(v) for name, v in scores.parts.items()})
    return out
