"""Verifiable rewards for answer strings: exact match and per-digit partial credit.

Completions are text as decoded by the engine.  They are first cut at the end-of-sequence marker
(``<eos>`` if the decode kept special tokens; the ``<pad>`` filler after it goes too) and stripped
of surrounding whitespace; the rest is compared with the reference answer.  A special token the
model emitted before its eos (``"1<pad>9"``, ``"7<pad>"``) makes the answer wrong.

* exact:   r = 1 if the cleaned completion equals the answer, else 0 (the "verifiable reward" of
           RLVR, e.g. DeepSeekMath/GRPO, arXiv:2402.03300).
* partial: digits are aligned on the right (units with units, tens with tens, the way column
           addition works) and r = (#positions i with c[-i] == a[-i]) / max(len(c), len(a)).
           r = 1 exactly when c == a; extra or missing digits are penalised through the
           denominator; an empty completion gets 0.  A dense shaping of the exact reward that
           keeps the optimum unchanged, useful when exact match is too sparse for a tiny model.
* math:    r = 1 if the final answers are mathematically equivalent (``0.5 = 1/2 = \\frac{1}{2}``), checked by
           math-verify in a killable child process: see :mod:`offpolicy_moe.tasks.math_answer` (scored through
           :class:`offpolicy_moe.tasks.custom_rewards.RewardSet`, not by :func:`compute_rewards`).

The math reward never pays for a reference in which math-verify reads no expression.  Sampled evaluation
(:mod:`.sampled_scores`) excludes an empty reference and counts it; the exact and partial training rewards still
score an empty reference as a string (1 for an empty completion), as the equivalence tests' fixed batches do.
"""
from __future__ import annotations

from typing import Callable, Sequence

from .tokenizer import EOS
from .vocabulary import REWARD_KINDS


def clean_completion(text: str, eos: str = EOS) -> str:
    """Cut ``text`` at the first ``eos`` marker and strip surrounding whitespace."""
    if not isinstance(text, str):
        raise TypeError(f"completion must be a str, got {type(text).__name__}")
    cut = text.split(eos, 1)[0] if eos else text
    return cut.strip()


def exact_match_reward(completion: str, answer: str) -> float:
    """1.0 if the cleaned completion equals the (stripped) answer, else 0.0."""
    return 1.0 if clean_completion(completion) == answer.strip() else 0.0


def partial_credit_reward(completion: str, answer: str) -> float:
    """Right-aligned per-character credit: matches / max(len(completion), len(answer)), in [0, 1]."""
    c, a = clean_completion(completion), answer.strip()
    width = max(len(c), len(a))
    if width == 0:
        return 1.0  # both empty: identical strings
    hits = sum(1 for i in range(1, min(len(c), len(a)) + 1) if c[-i] == a[-i])
    return hits / width


def get_reward_fn(kind: str) -> Callable[[str, str], float]:
    """The per-sample reward function for ``kind`` ("exact" | "partial")."""
    if kind == "exact":
        return exact_match_reward
    if kind == "partial":
        return partial_credit_reward
    if kind == "math":
        raise ValueError("reward 'math' runs math-verify in a child process: score it with "
                         "offpolicy_moe.tasks.math_answer.MathVerifier (or a task's score()), not get_reward_fn")
    raise ValueError(f"unknown reward {kind!r}; expected one of {REWARD_KINDS}")


def compute_rewards(completions: Sequence[str], answers: Sequence[str], kind: str = "exact") -> list[float]:
    """Reward of each (completion, answer) pair; the two lists must have the same length."""
    if isinstance(completions, str) or isinstance(answers, str):
        raise TypeError("completions and answers must be lists of strings, not a single str")
    if len(completions) != len(answers):
        raise ValueError(f"got {len(completions)} completions but {len(answers)} answers")
    fn = get_reward_fn(kind)
    return [fn(c, a) for c, a in zip(completions, answers)]
