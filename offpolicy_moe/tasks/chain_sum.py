"""Procedural sums with worked steps: ``"3+8+5+2="`` -> ``"11+5+2=16+2=18"``, a task whose responses are long.

A problem is ``num_terms`` operands (each draws its number of digits uniformly in ``[min_digits, max_digits]``,
then a value with that many digits, as the arithmetic task) joined by ``+`` and closed by ``=``.  The reference
answer works the sum left to right, one addition per step: each step replaces the first two terms by their sum
and writes the shorter expression followed by ``=``, until one number is left, the final answer.  So a
``num_terms``-term problem has ``num_terms - 1`` steps; with 1-digit operands its response is 29-34 characters at
6 terms, 41-47 at 7 and 73-79 at 9 (plus eos): generation, not the update, is most of an RL step, as in reasoning
RLVR.

Reward (:func:`final_answer_reward`): 1 when the number after the response's last ``=`` equals the reference's
final number, else 0; the worked steps are not graded (RLVR's outcome reward).  The SFT warm start trains on the
whole reference (the steps teach the format); ``eval/accuracy`` (exact match of the whole response) is therefore
stricter than the reward, and ``eval/reward`` is the greedy final-answer accuracy.

Splits as the arithmetic task (:func:`offpolicy_moe.tasks.arithmetic.disjoint_splits`).  ``task.name=chain``.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import numpy as np

from .arithmetic import disjoint_splits
from .base import PromptAnswerTask
from .custom_rewards import RewardSet, RewardSpec, parse_reward_specs
from .rewards import clean_completion

_DEFAULTS = {"min_digits": 1, "max_digits": 1, "num_terms": 7, "reward": "exact", "train_size": 4096,
             "eval_size": 128, "seed": 1234}
MAX_TERMS = 16
#: the reward the task uses unless ``task.rewards`` names others
FINAL_ANSWER_REWARD = "offpolicy_moe.tasks.chain_sum:final_answer_reward"


def worked_steps(operands: Sequence[int]) -> str:
    """The reference response: ``[3, 8, 5, 2]`` -> ``"11+5+2=16+2=18"`` (fold the first two terms per step)."""
    if len(operands) < 2:
        raise ValueError(f"a chain sum needs at least 2 operands, got {len(operands)}")
    terms = list(operands)
    steps = []
    while len(terms) > 1:
        terms = [terms[0] + terms[1]] + terms[2:]
        steps.append("+".join(str(t) for t in terms))
    return "=".join(steps)


def final_number(text: str) -> str:
    """The text after the last ``=`` of a cleaned response (the whole response when it has none)."""
    return clean_completion(text).rsplit("=", 1)[-1].strip()


def final_answer_reward(completions: Sequence[str], answers: Sequence[str], **_: Any) -> list[float]:
    """1.0 where the completion's final number (:func:`final_number`) is the reference's, else 0.0; an empty final
    number scores 0."""
    if len(completions) != len(answers):
        raise ValueError(f"got {len(completions)} completions but {len(answers)} answers")
    out = []
    for c, a in zip(completions, answers):
        got = final_number(c)
        out.append(1.0 if got and got == final_number(a) else 0.0)
    return out


def chain_space(min_digits: int, max_digits: int, num_terms: int) -> int:
    """Number of distinct problems: (numbers with ``min..max`` digits) ** ``num_terms``."""
    lo = 0 if min_digits == 1 else 10 ** (min_digits - 1)
    return (10 ** max_digits - lo) ** num_terms


def draw_chain(rng: np.random.Generator, min_digits: int, max_digits: int, num_terms: int) -> tuple[str, str]:
    """One ``(prompt, answer)`` (module docstring)."""
    operands = []
    for _ in range(num_terms):
        d = int(rng.integers(min_digits, max_digits + 1))
        lo = 0 if d == 1 else 10 ** (d - 1)
        operands.append(int(rng.integers(lo, 10 ** d)))
    return "+".join(str(x) for x in operands) + "=", worked_steps(operands)


class ChainSumTask(PromptAnswerTask):
    """Sums with worked steps (module docstring).  ``ChainSumTask(cfg)`` with a ``TaskConfig`` (``min_digits``,
    ``max_digits``, ``num_terms``, ``train_size``, ``eval_size``, ``seed``; ``reward`` must be ``exact``: the
    final answer's exact match), or those keywords.

    A subclass with another way of drawing problems (:class:`~offpolicy_moe.tasks.longtail.LongTailTask`) sets
    :attr:`DEFAULTS` (the options it reads, with their defaults) and overrides :meth:`generator`; the splits, the
    reward check and the final-answer reward are this class's."""

    #: the options read from the config (or keywords), with the defaults used when the config lacks one
    DEFAULTS: dict = _DEFAULTS
    #: the name in error messages (``task.name``)
    TASK_NAME = "chain"

    def __init__(self, cfg: Optional[object] = None, **overrides: Any) -> None:
        fields = {k: getattr(cfg, k, d) for k, d in self.DEFAULTS.items()}
        unknown = set(overrides) - set(fields)
        if unknown:
            raise TypeError(f"unknown {type(self).__name__} option(s): {sorted(unknown)}")
        fields.update(overrides)
        draw, space = self.generator(fields)
        if fields["reward"] != "exact":
            raise ValueError(f"task.reward={fields['reward']!r}: the {self.TASK_NAME} task scores the final answer's "
                             "exact match (task.rewards can name other reward functions)")
        train, eval_ = disjoint_splits(draw, space, int(fields["train_size"]), int(fields["eval_size"]),
                                       int(fields["seed"]))
        super().__init__(train, eval_, reward="exact", seed=int(fields["seed"]))
        self.configure_rewards()

    def generator(self, fields: dict) -> tuple[Callable[[np.random.Generator], tuple[str, str]], int]:
        """Check the options and keep them on ``self``; the ``(prompt, answer)`` drawing function and the number of
        distinct problems it can draw (for :func:`~offpolicy_moe.tasks.arithmetic.disjoint_splits`)."""
        lo, hi, n = int(fields["min_digits"]), int(fields["max_digits"]), int(fields["num_terms"])
        if not 1 <= lo <= hi <= 3:
            raise ValueError(f"task.min_digits/max_digits must satisfy 1 <= min <= max <= 3 for the chain task, "
                             f"got {lo}, {hi}")
        if not 2 <= n <= MAX_TERMS:
            raise ValueError(f"task.num_terms must be in 2..{MAX_TERMS} for the chain task, got {n}")
        self.min_digits, self.max_digits, self.num_terms = lo, hi, n
        return (lambda rng: draw_chain(rng, lo, hi, n)), chain_space(lo, hi, n)

    def configure_rewards(self, entries: Any = None, *, on_error: str = "stop", math_timeout_s: float = 5.0) -> None:
        """The ``task.rewards`` entries when there are any, else :func:`final_answer_reward` alone (metric
        ``reward/final_answer``)."""
        specs = parse_reward_specs(entries) or [RewardSpec(name="final_answer", fn=FINAL_ANSWER_REWARD)]
        self.rewards = RewardSet(specs, on_error=on_error, math_timeout_s=math_timeout_s)

    def __repr__(self) -> str:
        return (f"ChainSumTask(digits={self.min_digits}..{self.max_digits}, terms={self.num_terms}, "
                f"train={len(self.train_prompts)}, eval={len(self.eval_prompts)})")
