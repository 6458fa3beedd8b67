"""The evaluation's greedy decoding (rollout/greedy.py): ``generate``'s greedy tokens exactly, with finished rows
dropped from the decode batch on the way; ``generate`` itself where the model's generation config would process the
logits; and the trainer's evaluation on it equal to the ``generate``-based evaluation, without importing
``datasets``."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from offpolicy_moe.config.load import load_config
from offpolicy_moe.config.schema import ModelConfig, TaskConfig
from offpolicy_moe.models import load_policy
from offpolicy_moe.rollout.greedy import greedy_completions, runs_own_loop
from offpolicy_moe.tasks import evaluate_greedy, make_task
from offpolicy_moe.tasks.evaluation import greedy_completions as generate_greedy
from offpolicy_moe.tasks.evaluation import greedy_metrics
from offpolicy_moe.trainer.evaluation import greedy_evaluation
from tests.tiny import TINY


def _policy_with_early_eos(dtype: torch.dtype, seed: int = 3):
    """A random tiny policy whose eos logit is raised so that rows finish at many different lengths."""
    task = make_task(TaskConfig(min_digits=1, max_digits=2, num_terms=3, train_size=16, eval_size=24, seed=seed))
    model, tok = load_policy(ModelConfig(num_layers=2, hidden_size=32, num_experts=4, top_k=2), seed=seed, task=task)
    with torch.no_grad():
        model.lm_head.weight[tok.eos_token_id] *= 6.0
    return model.to(dtype), tok, task


class BatchSizes:
    """The number of rows of every forward of ``model`` (a forward pre-hook)."""

    def __init__(self, model):
        self.rows: list[int] = []
        self.handle = model.register_forward_pre_hook(self.hook, with_kwargs=True)

    def hook(self, module, args, kwargs):
        self.rows.append(int(kwargs["input_ids"].shape[0]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_own_loop_gives_generates_greedy_tokens_while_dropping_finished_rows(dtype):
    torch.set_num_threads(1)
    model, tok, task = _policy_with_early_eos(dtype)
    prompts = list(task.eval_prompts)
    ref = generate_greedy(model, tok, prompts, max_new_tokens=40, batch_size=16)
    sizes = BatchSizes(model)
    got = greedy_completions(model, tok, prompts, max_new_tokens=40, batch_size=16)
    sizes.handle.remove()
    assert got == ref
    lengths = {len(c) for c in ref}
    assert len(lengths) >= 3 and min(lengths) < 40         # the fixture finishes rows at different lengths
    assert min(sizes.rows) < 16 and sizes.rows[0] == 16    # ... and the loop dropped finished rows on the way


def test_a_generation_config_that_processes_logits_goes_through_generate():
    model, tok, task = _policy_with_early_eos(torch.float32)
    prompts = list(task.eval_prompts)[:8]
    assert runs_own_loop(model)
    model.generation_config.repetition_penalty = 1.5
    assert not runs_own_loop(model)
    assert greedy_completions(model, tok, prompts, max_new_tokens=12) == generate_greedy(model, tok, prompts,
                                                                                         max_new_tokens=12)


def test_bad_sizes_are_refused_before_any_forward():
    model, tok, _ = _policy_with_early_eos(torch.float32)
    for kw in ({"max_new_tokens": 0}, {"batch_size": 0}):
        with pytest.raises(ValueError, match="must be >= 1"):
            greedy_completions(model, tok, ["1+1="], **kw)


def test_metrics_of_mismatched_or_empty_completions_are_refused_in_one_line():
    for completions, answers in ((["1"], ["1", "2"]), ([], [])):
        with pytest.raises(ValueError, match="one completion per answer") as exc:
            greedy_metrics(completions, answers)
        assert "\n" not in str(exc.value)


def test_an_empty_held_out_split_is_refused_before_decoding():
    model, tok, task = _policy_with_early_eos(torch.float32)
    task.eval_prompts, task.eval_answers = [], []
    with pytest.raises(ValueError, match="no held-out problems"):
        greedy_evaluation(model, tok, task, max_new_tokens=4, batch_size=4)


def test_the_trainers_evaluation_equals_the_generate_based_one():
    torch.set_num_threads(1)
    model, tok, task = _policy_with_early_eos(torch.float32, seed=5)
    got = greedy_evaluation(model, tok, task, max_new_tokens=30, batch_size=7)
    ref = evaluate_greedy(model, tok, task.eval_dataset, task=task, max_new_tokens=30, batch_size=7)
    n = min(len(task.train_prompts), len(task.eval_prompts))
    ref.update(evaluate_greedy(model, tok, task.train_dataset.select(range(n)), prefix="eval/train_",
                               max_new_tokens=30, batch_size=7))
    assert got == ref
    assert set(greedy_evaluation(model, tok, task, max_new_tokens=30, batch_size=7, train_split=False)) == {
        k for k in ref if not k.startswith("eval/train_")}


def test_task_rows_are_the_splits_columns():
    task = make_task(TaskConfig(train_size=12, eval_size=5, seed=2))
    held_out = task.eval_dataset
    assert task.rows("eval") == {"prompt": list(held_out["prompt"]), "answer": list(held_out["answer"])}
    assert task.rows("train", 3) == {"prompt": task.train_prompts[:3], "answer": task.train_answers[:3]}
    with pytest.raises(ValueError, match="split must be"):
        task.rows("test")


def test_an_evaluation_imports_no_datasets():
    """``datasets`` costs about 0.4 s to import: a run that trains and evaluates never needs it."""
    code = ("import sys, torch\n"
            "from offpolicy_moe.config.load import load_config\n"
            "from offpolicy_moe.models import load_policy\n"
            "from offpolicy_moe.tasks import make_task\n"
            "from offpolicy_moe.trainer.evaluation import evaluate_policy\n"
            f"cfg = load_config(None, {TINY!r})\n"
            "task = make_task(cfg.task)\n"
            "model, tok = load_policy(cfg.model, seed=0, task=task)\n"
            "evaluate_policy(model, tok, task, cfg, 0)\n"
            "_ = task.demonstrations\n"
            "print('datasets' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False"


def test_the_config_default_evaluation_runs_the_own_loop():
    cfg = load_config(None, TINY)
    model, _ = load_policy(cfg.model, seed=0, task=make_task(cfg.task))
    assert runs_own_loop(model)
