"""The task a config names (:func:`make_task`)."""
from __future__ import annotations

from .arithmetic import ArithmeticTask
from .base import PromptAnswerTask
from .chain_sum import ChainSumTask
from .dataset_task import DatasetTask
from .jsonl import JsonlTask
from .longtail import LongTailTask
from .reverse import ReverseTask
from .vocabulary import TASK_NAMES

__all__ = ["TASK_NAMES", "make_task"]


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
    elif name == "longtail":
        task = LongTailTask(cfg, **overrides)
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
        raise ValueError(f"unknown task.name={name!r}; expected 'arithmetic', 'reverse', 'chain', "
                         "'longtail', 'dataset:<folder or file>' or 'jsonl:<path>'")
    task.configure_rewards(getattr(cfg, "rewards", None), on_error=getattr(cfg, "on_reward_error", "stop"),
                           math_timeout_s=getattr(cfg, "math_timeout_s", 5.0))
    return task
