"""Tasks: the embedded procedural arithmetic task, datasets on disk, rewards (built-in, ``math``, your own), chat
templates, the char tokenizer, evaluation.

The torch-free modules (:mod:`.vocabulary`, :mod:`.reward_specs`, :mod:`.settings`: what a task sets of the keys
outside ``task.*``) are imported with the package; the other names are imported from their modules on first use.
"""
from __future__ import annotations

from offpolicy_moe.lazy import lazy_exports

from .reward_specs import BUILTIN_REWARDS, RewardSpec, parse_reward_specs
from .settings import TaskSettings, task_settings
from .vocabulary import ANSWER_FORMATS, CHAT_TEMPLATE_MODES, ON_REWARD_ERROR, REWARD_KINDS, TASK_NAMES

_EXPORTS = {
    "arithmetic": ("ArithmeticSpec", "ArithmeticTask", "evaluate_expression", "format_problem"),
    "base": ("PromptAnswerTask",),
    "chain_sum": ("ChainSumTask",),
    "chat": ("ChatTemplateRecord", "apply_chat_template", "render_prompt"),
    "custom_rewards": ("RewardError", "RewardImportError", "RewardScores", "RewardSet", "resolve_reward"),
    "dataset_task": ("DatasetTask",),
    "evaluation": ("evaluate_greedy", "greedy_completions", "greedy_metrics"),
    "jsonl": ("JsonlTask", "read_jsonl_records"),
    "local_data": ("load_rows",),
    "longtail": ("LongTailTask",),
    "make": ("make_task",),
    "math_answer": ("MathVerifier", "extract_final_answer"),
    "reverse": ("ReverseTask",),
    "rewards": ("clean_completion", "compute_rewards", "exact_match_reward", "get_reward_fn", "partial_credit_reward"),
    "tokenizer": ("VOCAB", "build_char_tokenizer", "char_table", "decode_completions", "embedded_tokenizer",
                  "encode_prompts", "encode_texts", "left_pad"),
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(["ANSWER_FORMATS", "BUILTIN_REWARDS", "CHAT_TEMPLATE_MODES", "ON_REWARD_ERROR", "REWARD_KINDS",
                  "RewardSpec", "TASK_NAMES", "TaskSettings", "parse_reward_specs", "task_settings",
                  *(name for names in _EXPORTS.values() for name in names)])
