"""Accuracy of samples, not of greedy decoding: the mean final-answer reward of 8 samples per problem (the job's
group) at temperature 1 (the RL runs' sampling), on the held-out split or on training problems.

Issue 44, item 1: over 500 steps the longtail runs raise their sampled training reward while their greedy held-out
score falls (experiments/results/tta/longtail/probes.md, fourth round).  This asks whether what the samples gained
carries to held-out problems.  The per-problem accuracy is the mean over its samples, and the figure is the mean
over problems (the "mean@k" estimate of pass@1 with sampling, arXiv 2501.12948).

Usage (``OMP_NUM_THREADS=1``; each MODEL an exported Hugging Face folder: a warm start, a run's ``export``)::

    python experiments/bench/probe_sampled_accuracy.py --split eval MODEL [MODEL ...]
    python experiments/bench/probe_sampled_accuracy.py --split train --problems 256 MODEL [MODEL ...]

One JSON line per model.  The same problems and sampling seeds serve every model, so their differences are paired:
from the second model on, the line also gives the paired difference to the first model with a 95% bootstrap interval
over problems (2,000 resamples, seed 0).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from offpolicy_moe.config.load import load_config
from offpolicy_moe.tasks.make import make_task
from probe_gradient import EVAL_SIZE, GROUP, PROMPTS, TASKS, sample


def paired_difference(x: np.ndarray, y: np.ndarray, resamples: int = 2000) -> tuple[float, list[float]]:
    """``mean(x - y)`` over paired problems and its 95% percentile-bootstrap interval (problems resampled)."""
    d = np.asarray(x, float) - np.asarray(y, float)
    idx = np.random.default_rng(0).integers(0, len(d), size=(resamples, len(d)))
    lo, hi = np.percentile(d[idx].mean(1), [2.5, 97.5])
    return float(d.mean()), [float(lo), float(hi)]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("models", nargs="+", metavar="MODEL")
    p.add_argument("--task", choices=sorted(TASKS), default="longtail")
    p.add_argument("--split", choices=("eval", "train"), default="eval")
    p.add_argument("--problems", type=int, default=EVAL_SIZE, help="the first N problems of the split")
    a = p.parse_args(argv)
    if a.problems < 1:
        p.error(f"--problems must be >= 1, got {a.problems}")
    for path in a.models:
        if not (Path(path) / "config.json").is_file():
            p.error(f"{path}: not an exported model folder (no config.json)")
    torch.set_num_threads(1)
    overrides, max_new = TASKS[a.task]
    task = make_task(load_config(overrides=[*overrides, f"task.eval_size={EVAL_SIZE}"]).task)
    prompts, answers = ((task.eval_prompts, task.eval_answers) if a.split == "eval"
                        else (task.train_prompts, task.train_answers))
    rows = [{"prompt": q, "answer": r} for q, r in zip(prompts[:a.problems], answers[:a.problems])]
    first = None
    for path in a.models:
        tok = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        per_problem = np.concatenate([sample(model, tok, task, rows[j:j + PROMPTS], 7 + j, 1.0, max_new)[3]
                                      .reshape(-1, GROUP).mean(1) for j in range(0, len(rows), PROMPTS)])
        rec = {"model": path, "task": a.task, "split": a.split, "problems": len(per_problem),
               "samples_per_problem": GROUP, "mean_at_k": float(per_problem.mean())}
        if first is None:
            first = per_problem
        else:
            rec["minus_first"], rec["ci95"] = paired_difference(per_problem, first)
        print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
