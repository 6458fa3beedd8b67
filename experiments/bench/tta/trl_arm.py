"""The ``trl`` arm of bench_tta.py: TRL's GRPOTrainer on the job of our arms, writing metric rows like ours.

The config is resolved from the same trainer overrides as our arms (``offpolicy_moe.config.load.load_config``), so
the task, the tokenizer and the warm-started weights (``model.path``) come from the same code: ``make_task`` and
``load_policy``, as our trainer calls them.  Step i trains on ``task.sample_prompts(i, P)`` (the prompts our
synchronous trainer draws at iteration i; TRL's sampler walks the dataset in order with ``shuffle_dataset=False``),
G samples each at temperature 1 / top-p 1, ``max_completion_length = rollout.max_new_tokens``, token-mean loss
(``loss_type="dapo"``), group-std advantages, clip 0.2, no KL, AdamW at ``optim.lr`` with clip-norm
``optim.grad_clip``, one update per batch.  The rest as bench_vs_trl.py (fp32 model and generation with a KV cache;
``--trl-gradient-checkpointing`` and ``--trl-experts-implementation`` pass through).

Evaluation: what our trainer's ``evaluate`` runs (``greedy_evaluation``: greedy decoding on the held-out split
and on as many training prompts; with ``eval.samples`` > 0 also our trainer's sampled evaluation of the held-out split,
``offpolicy_moe.trainer.sampled_eval.SampledEvaluator``: the same engine, seed and scoring, so ``eval/avg@n``,
``eval/pass@k`` and ``eval/maj@k`` mean the same in both arms), before training (step 0) and in ``on_step_end``
every ``trainer.eval_every`` steps and at the last.  Each row gets ``perf/elapsed_s`` = wall seconds since
``on_train_begin`` (evaluation included, as ours) and ``perf/time_eval_s``.  Rows go to ``RUN_DIR/metrics.jsonl``.
"""
from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

import torch
from datasets import Dataset
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from offpolicy_moe.config.load import load_config
from offpolicy_moe.models import load_policy
from offpolicy_moe.run.full_state import full_model_state
from offpolicy_moe.tasks import make_task
from offpolicy_moe.trainer.evaluation import greedy_evaluation
from offpolicy_moe.trainer.sampled_eval import SampledEvaluator

from .prompts import prompt_ids_match


def evaluate(model, tok, task, max_new_tokens: int, batch_size: int, sampled: SampledEvaluator | None = None,
             step: int = 0) -> dict[str, float]:
    """Greedy accuracy on the held-out split (with the task's own rewards: ``eval/reward``) and on as many training
    prompts (the first ones), as our trainer; with ``sampled``, the sampled metrics of the held-out split under the
    model's current weights (loaded into the evaluator's engine as version ``step``), as our trainer."""
    out = greedy_evaluation(model, tok, task, max_new_tokens=max_new_tokens, batch_size=batch_size)
    if sampled is not None:
        out.update(sampled.evaluate(task, state_dict=full_model_state(model), step=step))
    return out


def run(overrides: list[str], run_dir: str, gradient_checkpointing: bool, experts_implementation: str,
        options: dict | None = None) -> dict:
    """Train with TRL; write metric rows to ``run_dir/metrics.jsonl``; return fairness probes.  ``options``: more
    GRPOConfig fields (``--trl-option``), e.g. its continuous batching or ``torch_compile``."""
    cfg = load_config(None, overrides)
    torch.set_num_threads(cfg.trainer.threads or 1)
    torch.manual_seed(cfg.seed)
    task = make_task(cfg.task)
    cfg.model.experts_implementation = experts_implementation
    model, tok = load_policy(cfg.model, seed=cfg.seed, task=task)
    sampled = SampledEvaluator.build(model, tok, cfg) if cfg.eval.samples > 0 else None
    ro, tc = cfg.rollout, cfg.trainer
    rows = [r for i in range(tc.steps) for r in task.sample_prompts(i, ro.prompts_per_step)]
    # TRL tokenizes a text prompt with ``processing_class(text=prompts)`` (special tokens added: the tokenizer's
    # post-processor puts bos in front), so the prompt is the task's text; a bos in the text would be doubled
    ds = Dataset.from_dict({"prompt": [r["prompt"] for r in rows], "answer": [r["answer"] for r in rows]})
    seen: list[list[str]] = []

    def reward(prompts, completions, answer, **_):
        seen.append(list(prompts))
        return task.reward(completions, answer)

    out = Path(run_dir)
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / "metrics.jsonl", "w")
    clock = {"t0": 0.0, "last": 0.0}

    def write(row: dict) -> None:
        log.write(json.dumps(row) + "\n")
        log.flush()

    def timed_eval(step: int) -> dict:
        t = time.perf_counter()
        ev = evaluate(model, tok, task, ro.max_new_tokens, tc.eval_batch_size, sampled, step)
        ev["perf/time_eval_s"] = time.perf_counter() - t
        return ev

    write({"step": 0, **timed_eval(0)})

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            clock["t0"] = clock["last"] = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            step = state.global_step
            m = {"step": step}
            if (tc.eval_every > 0 and step % tc.eval_every == 0) or step == tc.steps:
                m.update(timed_eval(step))
            now = time.perf_counter()
            m["perf/time_step_s"] = now - clock["last"]
            m["perf/elapsed_s"] = now - clock["t0"]
            clock["last"] = now
            write(m)

    gcfg = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="tta_trl_"), use_cpu=True, report_to="none", save_strategy="no",
        logging_steps=10**6, per_device_train_batch_size=ro.prompts_per_step * ro.group_size,
        num_generations=ro.group_size, gradient_accumulation_steps=1, steps_per_generation=1, num_iterations=1,
        max_completion_length=ro.max_new_tokens, temperature=ro.temperature, top_p=ro.top_p, top_k=0,
        learning_rate=cfg.optim.lr, lr_scheduler_type="constant", beta=0.0, epsilon=0.2, loss_type="dapo",
        scale_rewards="group", max_steps=tc.steps, seed=cfg.seed, bf16=False, disable_dropout=True,
        shuffle_dataset=False, dataloader_num_workers=0, log_completions=False, max_grad_norm=cfg.optim.grad_clip,
        gradient_checkpointing=gradient_checkpointing, weight_decay=cfg.optim.weight_decay, **(options or {}),
    )
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=gcfg, train_dataset=ds, processing_class=tok,
                          callbacks=[Clock()])
    try:
        trainer.train()
    finally:
        log.close()
        if sampled is not None:
            sampled.close()
    first = sorted(set(seen[0])) if seen else []
    want = sorted({r["prompt"] for r in task.sample_prompts(0, ro.prompts_per_step)})
    return {"first_step_prompts_match_ours": first == want, "prompt_ids_match_ours": prompt_ids_match(tok, first), "sequences_per_step": len(seen[0]) if seen else 0,
            "reward_calls": len(seen), "gradient_checkpointing": bool(trainer.args.gradient_checkpointing),
            "experts_implementation": model.config._experts_implementation, "options": dict(options or {}),
            "pid": os.getpid()}
