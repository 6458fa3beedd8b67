"""The tasks' names that a config may choose, without torch (the config schema and its validator import this
module, not the task code)."""
from __future__ import annotations

#: ``task.name``: the built-in tasks and the two forms that read a dataset
TASK_NAMES = ("arithmetic", "reverse", "chain", "longtail", "dataset:<folder or file>", "jsonl:<file>")
#: ``task.reward``: exact match, per-digit partial credit, or math-verify equivalence
REWARD_KINDS = ("exact", "partial", "math")
#: ``task.on_reward_error``: stop the run (after a checkpoint), or score the failed rows 0 and count them
ON_REWARD_ERROR = ("stop", "zero")
#: ``task.chat_template``: the tokenizer's template when it has one, or the plain prompt
CHAT_TEMPLATE_MODES = ("auto", "none")
#: ``task.answer_format``: the answer column as it is, or the text after ``####`` (GSM8K)
ANSWER_FORMATS = ("plain", "gsm8k")

__all__ = ["ANSWER_FORMATS", "CHAT_TEMPLATE_MODES", "ON_REWARD_ERROR", "REWARD_KINDS", "TASK_NAMES"]
