"""Tasks: the embedded procedural arithmetic task, datasets on disk, rewards (built-in, ``math``, your own), chat
templates, the char tokenizer, evaluation."""
from __future__ import annotations

from .arithmetic import ArithmeticSpec, ArithmeticTask, evaluate_expression, format_problem
from .base import PromptAnswerTask
from .chain_sum import ChainSumTask
from .chat import CHAT_TEMPLATE_MODES, ChatTemplateRecord, apply_chat_template, render_prompt
from .custom_rewards import (BUILTIN_REWARDS, ON_REWARD_ERROR, RewardError, RewardImportError, RewardScores, RewardSet,
                             RewardSpec, parse_reward_specs, resolve_reward)
from .dataset_task import DatasetTask
from .evaluation import evaluate_greedy, greedy_completions
from .jsonl import JsonlTask, read_jsonl_records
from .local_data import ANSWER_FORMATS, load_rows
from .math_answer import MathVerifier, extract_final_answer
from .reverse import ReverseTask
from .rewards import (REWARD_KINDS, clean_completion, compute_rewards, exact_match_reward, get_reward_fn,
                      partial_credit_reward)
from .tokenizer import (VOCAB, build_char_tokenizer, char_table, decode_completions, embedded_tokenizer, encode_prompts,
                        encode_texts,
                        left_pad)

TASK_NAMES = ("arithmetic", "reverse", "chain", "dataset:<folder or file>", "jsonl:<file>")


def make_task(cfg, **overrides) -> PromptAnswerTask:
    """Build the task named by ``cfg.name`` (one of :data:`TASK_NAMES`) with its rewards (``cfg.rewards``,
    ``cfg.on_reward_error``, ``cfg.math_timeout_s``; every import path is resolved here, in the process that builds
    the task: the trainer, each async rollout worker, each sweep run)."""
    name = getattr(cfg, "name", "arithmetic")
    if name == "arithmetic":
        task: PromptAnswerTask = ArithmeticTask(cfg, **overrides)
    elif name == "reverse":
        task = ReverseTask(cfg, **overrides)
    elif name == "chain":
        task = ChainSumTask(cfg, **overrides)
    elif isinstance(name, str) and name.startswith("jsonl:"):
        path = name[len("jsonl:"):]
        if not path:
            raise ValueError("task.name='jsonl:' needs a path, e.g. task.name=jsonl:data/train.jsonl")
        task = JsonlTask(path, cfg, **overrides)
    elif isinstance(name, str) and name.startswith("dataset:"):
        source = name[len("dataset:"):]
        if not source:
            raise ValueError("task.name='dataset:' needs a folder or a file, e.g. task.name=dataset:data/train.jsonl")
        task = DatasetTask(source, cfg, **overrides)
    else:
        raise ValueError(f"unknown task.name={name!r}; expected 'arithmetic', 'reverse', 'chain', 'dataset:<folder or file>' "
                         "or 'jsonl:<path>'")
    task.configure_rewards(getattr(cfg, "rewards", None), on_error=getattr(cfg, "on_reward_error", "stop"),
                           math_timeout_s=getattr(cfg, "math_timeout_s", 5.0))
    return task


__all__ = [
    "ANSWER_FORMATS", "ArithmeticSpec", "ArithmeticTask", "BUILTIN_REWARDS", "CHAT_TEMPLATE_MODES", "ChainSumTask",
    "ChatTemplateRecord", "DatasetTask", "JsonlTask", "MathVerifier", "ON_REWARD_ERROR", "PromptAnswerTask",
    "REWARD_KINDS", "ReverseTask", "RewardError", "RewardImportError", "RewardScores", "RewardSet", "RewardSpec",
    "TASK_NAMES", "VOCAB", "apply_chat_template", "build_char_tokenizer", "char_table", "clean_completion",
    "embedded_tokenizer",
    "compute_rewards", "decode_completions", "encode_prompts", "encode_texts", "evaluate_expression",
    "evaluate_greedy", "exact_match_reward", "extract_final_answer", "format_problem", "get_reward_fn",
    "greedy_completions", "left_pad", "load_rows", "make_task", "parse_reward_specs", "partial_credit_reward",
    "read_jsonl_records", "render_prompt", "resolve_reward",
]
