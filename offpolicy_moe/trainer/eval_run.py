"""Evaluating a trained policy outside a run, as ``offpolicy-moe eval`` does (docs/evaluation.md): a run folder's
checkpoint, or a Hugging Face model folder (``offpolicy-moe export``'s, a run's ``export/``, any local transformers
model), on a task, with the greedy accuracy and the sampled metrics the trainer logs.

Every check runs before the weights are read: the task is built (a bad task file is one line naming
``task.name``), the model's tokenizer must encode it and hold its answers within ``rollout.max_new_tokens``, and a
model folder's vocabulary must hold the tokenizer.  The evaluation is then the trainer's own:
:func:`~offpolicy_moe.trainer.evaluation.evaluate_policy` (greedy, held-out split) and
:class:`~offpolicy_moe.trainer.sampled_eval.SampledEvaluator` (``eval.samples`` samples per problem, seeded by
``eval.seed``), so a run folder's checkpoint of step ``s`` gives the numbers the run logged at step ``s`` with the
same seed and settings.
"""
from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from offpolicy_moe.config.preflight import check_answers_fit, check_model_shape, check_task_data
from offpolicy_moe.config.validate import Findings
from offpolicy_moe.models import (CheckpointNotFoundError, load_model_config, load_policy, load_tokenizer,
                                  tokenizer_source)
from offpolicy_moe.run.export import load_run_policy, pick_checkpoint, run_tokenizer
from offpolicy_moe.tasks import apply_chat_template
from offpolicy_moe.tasks.sampled_metrics import check_ks
from offpolicy_moe.trainer.build import set_determinism
from offpolicy_moe.trainer.evaluation import evaluate_policy
from offpolicy_moe.trainer.sampled_eval import TIME_KEY, SampledEvaluator, eval_rollout

__all__ = ["EvalInputError", "EvalTarget", "EvalResult", "LoadedPolicy", "check_ks", "load_target", "evaluate_target"]


class EvalInputError(ValueError):
    """A user mistake in what to evaluate (no checkpoint, a folder that is no model, a task the model's tokenizer
    cannot take): one line, raised before any weights are read or any token generated."""


@dataclass
class EvalTarget:
    """What to evaluate: ``kind`` ``run`` (checkpoint ``step`` of the run folder ``path``, default its newest intact
    one; ``saved``: the run's own ``config.yaml``, whose model and tokenizer the checkpoint fits) or ``model`` (the
    Hugging Face folder ``path``, already set as ``cfg.model.path``); ``cfg``: the evaluation's config (task,
    rollout, ``eval``, ``trainer.eval_batch_size``)."""

    kind: str
    path: Path
    cfg: Any
    saved: Any = None
    step: Optional[int] = None


@dataclass
class LoadedPolicy:
    """The model, its tokenizer, the task (prompts as the model sees them) and what was loaded."""

    model: torch.nn.Module
    tok: Any
    task: Any
    evaluated: dict = field(default_factory=dict)


@dataclass
class EvalResult:
    """What ``offpolicy-moe eval`` writes: what was evaluated, with which settings, the metrics and their cost."""

    evaluated: dict
    settings: dict
    metrics: dict
    seconds: dict

    def to_dict(self) -> dict:
        """The JSON record (keys ``evaluated``, ``settings``, ``metrics``, ``seconds``)."""
        return {"evaluated": self.evaluated, "settings": self.settings, "metrics": self.metrics,
                "seconds": self.seconds}


def _fitted_task(cfg: Any, tok: Any) -> Any:
    """The task of ``cfg`` built as the trainer builds it, checked against ``tok`` (its characters encode, its answers
    fit ``rollout.max_new_tokens``); :class:`EvalInputError` naming ``task.name`` otherwise, warnings as warnings."""
    found = Findings()
    task = check_task_data(cfg, found)
    if task is not None:
        check_answers_fit(cfg, found, task, tok)
    if found.errors:
        raise EvalInputError(f"{found.errors[0]} (the model's tokenizer is the one it was trained with)")
    for message in found.warnings:
        warnings.warn(message, stacklevel=3)
    return task


def _run_policy(target: EvalTarget) -> LoadedPolicy:
    """A run folder's checkpoint: the run's tokenizer, the task checked against it, then the weights."""
    try:
        ck = pick_checkpoint(target.path, target.step, "evaluate")
    except FileNotFoundError as exc:
        raise EvalInputError(str(exc)) from None
    tok = run_tokenizer(target.saved)
    task = _fitted_task(target.cfg, tok)
    model, tok, _ = load_run_policy(target.saved, ck, tokenizer=tok)
    step = int(ck.name.rsplit("_", 1)[-1])
    return LoadedPolicy(model, tok, task, {"kind": "run", "path": str(target.path), "checkpoint": ck.name,
                                           "step": step})


def _folder_policy(target: EvalTarget) -> LoadedPolicy:
    """A Hugging Face folder: its config and tokenizer, the task and the vocabulary checked, then the weights."""
    cfg = target.cfg
    try:
        model_config = load_model_config(cfg.model.path)
        tok = load_tokenizer(*tokenizer_source(cfg.model))
    except CheckpointNotFoundError as exc:
        raise EvalInputError(str(exc).strip().splitlines()[0]) from None
    found = Findings()
    check_model_shape(cfg, found, model_config, tok)
    if found.errors:
        raise EvalInputError(found.errors[0])
    task = _fitted_task(cfg, tok)
    try:
        model, tok = load_policy(cfg.model, tok, seed=cfg.seed)
    except ValueError as exc:
        raise EvalInputError(str(exc).strip().splitlines()[0]) from None
    return LoadedPolicy(model, tok, task, {"kind": "model", "path": str(target.path), "checkpoint": None,
                                           "step": None})


def load_target(target: EvalTarget) -> LoadedPolicy:
    """The policy, tokenizer and task of ``target`` (every check first, module docstring); the task's prompts
    rendered with the tokenizer's chat template as the trainer renders them (``task.chat_template``)."""
    if target.kind not in ("run", "model"):
        raise ValueError(f"unknown evaluation target kind {target.kind!r}")
    loaded = _run_policy(target) if target.kind == "run" else _folder_policy(target)
    apply_chat_template(loaded.task, loaded.tok, target.cfg.task.chat_template)
    return loaded


def _settings(cfg: Any, ks: Sequence[int], device: torch.device) -> dict:
    """The settings the numbers depend on, as the JSON record states them."""
    ro = eval_rollout(cfg)
    return {"samples": int(cfg.eval.samples), "ks": list(ks), "seed": int(cfg.eval.seed), "engine": ro.engine,
            "temperature": ro.temperature, "top_p": ro.top_p, "top_k": ro.top_k, "dtype": ro.dtype,
            "sampler": ro.sampler, "max_new_tokens": int(ro.max_new_tokens), "batch_size": int(ro.batch_size),
            "device": str(device), "threads": torch.get_num_threads()}


def evaluate_target(target: EvalTarget, *, ks: Optional[Sequence[int]] = None,
                    device: Optional[torch.device] = None) -> EvalResult:
    """Greedy accuracy and the sampled metrics (``eval.samples`` >= 1 per problem; pass@k and maj@k at ``ks``,
    default 1, 2, 4, ..., n) of ``target``'s held-out split, on ``device`` (default CUDA when there is one), with
    the seconds of each part: ``load`` (checks, tokenizer, task, weights), ``greedy``, ``engine`` (the sampler's own
    copy of the policy), ``sampled`` (sampling and scoring: the run's ``perf/time_eval_sampled_s``), ``total``."""
    cfg = target.cfg
    ks = check_ks(int(cfg.eval.samples), ks)          # n < 1 or k > n: refused before anything is read
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    set_determinism(cfg.trainer)
    t0 = time.perf_counter()
    loaded = load_target(target)
    model = loaded.model.to(device)
    t_load = time.perf_counter()
    step = int(loaded.evaluated["step"] or 0)
    metrics = evaluate_policy(model, loaded.tok, loaded.task, cfg, step, train_split=False)
    t_greedy = time.perf_counter()
    sampler = None
    try:
        sampler = SampledEvaluator.build(model, loaded.tok, cfg, device=device, ks=ks)
        t_engine = time.perf_counter()
        metrics.update(sampler.evaluate(loaded.task, step=step))
    finally:
        if sampler is not None:
            sampler.close()                 # a vLLM engine's process
        loaded.task.rewards.close()         # the math reward's math-verify process, if any
    t_end = time.perf_counter()
    evaluated = {**loaded.evaluated, "task": cfg.task.name, "held_out_problems": len(loaded.task.eval_prompts)}
    seconds = {"load": t_load - t0, "greedy": t_greedy - t_load, "engine": t_engine - t_greedy,
               "sampled": float(metrics.pop(TIME_KEY)), "total": t_end - t0}
    return EvalResult(evaluated, _settings(cfg, ks, device), metrics, seconds)
