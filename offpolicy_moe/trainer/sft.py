"""Supervised warm start: teacher forcing on ``bos + prompt + answer + eos``, loss on the answer only.

The RL demo needs a policy that already solves part of the task (so group advantages are not all
zero) but not all of it (so RL has headroom).  A few dozen AdamW steps of next-token cross-entropy on
the answer tokens (and the closing eos) get the tiny presets there:

    L(θ) = − Σ_{b,t ∈ answer(b) ∪ {eos}} log π_θ(x_{b,t} | x_{b,<t}) / #answer tokens

(plain maximum likelihood; the SFT-then-RL recipe of InstructGPT, arXiv:2203.02155, and of
DeepSeekMath/GRPO, arXiv:2402.03300).  Batches are drawn uniformly with replacement from
``task.demonstrations`` (the training split, or a task teacher's own answers to it) by a numpy generator seeded
with ``seed``, so the run is deterministic.
"""
from __future__ import annotations

import math
import time
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

from ..run.nonfinite import NonFiniteError
from ..tasks.tokenizer import encode_texts


def _pre_encode(tok, prompts: list[str], answers: list[str]) -> tuple[list[list[int]], list[list[int]]]:
    if tok.eos_token_id is None:
        raise ValueError("tokenizer has no eos_token_id; SFT teaches the model to stop with eos")
    p_ids = encode_texts(tok, prompts, add_bos=True)
    a_ids = [a + [tok.eos_token_id] for a in encode_texts(tok, answers)]
    return p_ids, a_ids


def build_sft_batch(prompt_ids: list[list[int]], answer_ids: list[list[int]], pad_id: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``(input_ids, attention_mask, loss_mask)`` ``[B, T]``; ``loss_mask[b, t] = 1`` where
    token ``t`` belongs to the answer (or its eos), i.e. where its log-prob enters the loss."""
    if len(prompt_ids) != len(answer_ids):
        raise ValueError(f"{len(prompt_ids)} prompts but {len(answer_ids)} answers")
    width = max(len(p) + len(a) for p, a in zip(prompt_ids, answer_ids))
    n = len(prompt_ids)
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    attn = torch.zeros((n, width), dtype=torch.long)
    loss_mask = torch.zeros((n, width), dtype=torch.float32)
    for b, (p, a) in enumerate(zip(prompt_ids, answer_ids)):
        seq = p + a
        ids[b, :len(seq)] = torch.as_tensor(seq)
        attn[b, :len(seq)] = 1
        loss_mask[b, len(p):len(seq)] = 1.0
    return ids, attn, loss_mask


def answer_nll(model, ids: torch.Tensor, attn: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Mean negative log-likelihood of the masked (answer) tokens under teacher forcing."""
    logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits[:, :-1].float()
    target_mask = loss_mask[:, 1:]
    nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none")
    return (nll * target_mask.reshape(-1)).sum() / target_mask.sum().clamp_min(1.0)


def lr_factor(step: int, steps: int, schedule: str, final: float = 0.1) -> float:
    """Multiplier of the base lr at optimizer step ``step`` (0-based) of ``steps``.

    constant: 1.  cosine: final + (1 − final)·½(1 + cos(π·step/steps)), from 1 down towards ``final``
    (SGDR-style annealing without restarts, arXiv:1608.03983); it makes the end point of a short warm
    start less dependent on the last few noisy batches.
    """
    if schedule == "constant":
        return 1.0
    if schedule == "cosine":
        return final + (1.0 - final) * 0.5 * (1.0 + math.cos(math.pi * step / max(steps, 1)))
    raise ValueError(f"unknown SFT lr schedule {schedule!r}; expected 'constant' or 'cosine'")


def sft_warm_start(model, tok, task, *, steps: int, lr: float = 3e-3, batch_size: int = 64, seed: int = 0,
                   weight_decay: float = 0.0, grad_clip: Optional[float] = 1.0, schedule: str = "cosine",
                   progress: bool = False) -> dict:
    """Train ``model`` in place for ``steps`` AdamW steps of answer-only teacher forcing on ``task``'s
    train split, lr annealed by ``schedule`` (:func:`lr_factor`); leaves no gradient behind (``param.grad`` is
    None on return).  Returns ``{"sft/loss": last loss,
    "sft/loss_history": [...], "sft/steps", "sft/time_s", "sft/tokens_per_s"}``.  ``steps=0`` returns
    without touching the model."""
    if steps < 0 or batch_size < 1 or lr <= 0:
        raise ValueError(f"need steps >= 0, batch_size >= 1, lr > 0; got {steps}, {batch_size}, {lr}")
    lr_factor(0, 1, schedule)  # validates the name before any work
    if steps == 0:
        return {"sft/loss": float("nan"), "sft/loss_history": [], "sft/steps": 0, "sft/time_s": 0.0,
                "sft/tokens_per_s": 0.0}
    if tok.pad_token_id is None:
        raise ValueError("tokenizer has no pad_token_id")
    demos = task.demonstrations
    prompts, answers = list(demos["prompt"]), list(demos["answer"])
    p_ids, a_ids = _pre_encode(tok, prompts, answers)
    rng = np.random.default_rng([int(seed), 0x5F7])
    device = next(model.parameters()).device
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    was_training = model.training
    model.train()
    history: list[float] = []
    n_tokens = 0
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=steps, desc="sft", leave=False)
    t0 = time.perf_counter()
    try:
        for step in range(steps):
            for group in opt.param_groups:
                group["lr"] = lr * lr_factor(step, steps, schedule)
            idx = rng.integers(0, len(p_ids), size=batch_size)
            ids, attn, mask = build_sft_batch([p_ids[i] for i in idx], [a_ids[i] for i in idx], tok.pad_token_id)
            ids, attn, mask = ids.to(device), attn.to(device), mask.to(device)
            loss = answer_nll(model, ids, attn, mask)
            if not torch.isfinite(loss):    # before any RL step: nothing finite to fall back to, whatever on_nan says
                raise NonFiniteError("sft", f"SFT loss ({loss.item()}) at warm-start step {len(history) + 1} of "
                                     f"{steps}", note="no checkpoint was written; lower trainer.sft_lr")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if grad_clip:
                torch.nn.utils.clip_grad_norm_(params, grad_clip)
            opt.step()
            history.append(float(loss.detach()))
            n_tokens += int(attn.sum())
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{history[-1]:.3f}")
    finally:
        if bar is not None:
            bar.close()
        model.train(was_training)
        opt.zero_grad(set_to_none=True)    # no SFT gradient may leak into whatever trains the model next
    elapsed = time.perf_counter() - t0
    return {"sft/loss": history[-1], "sft/loss_history": history, "sft/steps": steps, "sft/time_s": elapsed,
            "sft/tokens_per_s": n_tokens / max(elapsed, 1e-9)}
