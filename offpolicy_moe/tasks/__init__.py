"""Tasks: the embedded procedural arithmetic task, a local JSONL task, rewards, the char tokenizer, evaluation."""
from __future__ import annotations

from .arithmetic import ArithmeticSpec, ArithmeticTask, evaluate_expression, format_problem
from .base import PromptAnswerTask
from .evaluation import evaluate_greedy, greedy_completions
from .jsonl import JsonlTask, read_jsonl_records
from .reverse import ReverseTask
from .rewards import (REWARD_KINDS, clean_completion, compute_rewards, exact_match_reward, get_reward_fn,
                      partial_credit_reward)
from .tokenizer import (VOCAB, build_char_tokenizer, char_table, decode_completions, encode_prompts, encode_texts,
                        left_pad)


def make_task(cfg, **overrides) -> PromptAnswerTask:
    """Build the task named by ``cfg.name``: ``"arithmetic"``, ``"reverse"`` or ``"jsonl:<path>"``."""
    name = getattr(cfg, "name", "arithmetic")
    if name == "arithmetic":
        return ArithmeticTask(cfg, **overrides)
    if name == "reverse":
        return ReverseTask(cfg, **overrides)
    if isinstance(name, str) and name.startswith("jsonl:"):
        path = name[len("jsonl:"):]
        if not path:
            raise ValueError("task.name='jsonl:' needs a path, e.g. task.name=jsonl:data/train.jsonl")
        return JsonlTask(path, cfg, **overrides)
    raise ValueError(f"unknown task.name={name!r}; expected 'arithmetic', 'reverse' or 'jsonl:<path>'")


__all__ = [
    "ArithmeticSpec", "ArithmeticTask", "JsonlTask", "PromptAnswerTask", "ReverseTask", "REWARD_KINDS", "VOCAB",
    "build_char_tokenizer", "char_table", "clean_completion", "compute_rewards", "decode_completions",
    "encode_prompts", "encode_texts", "evaluate_expression", "evaluate_greedy", "exact_match_reward",
    "format_problem", "get_reward_fn", "greedy_completions", "left_pad", "make_task", "partial_credit_reward",
    "read_jsonl_records",
]
