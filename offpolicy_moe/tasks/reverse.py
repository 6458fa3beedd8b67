"""Procedural digit-reversal task: ``"20417=" -> "71402"``, for experiments that need long responses.

A problem is a string of ``n`` random decimal digits, ``n`` uniform in ``[min_digits, max_digits]``, closed by
``=``; the answer is the string reversed, so every response is ``n`` digits plus eos.  The splits follow the
arithmetic task's rules (:func:`offpolicy_moe.tasks.arithmetic.disjoint_splits`): ``eval_size`` distinct held-out
problems drawn first, training problems drawn with every held-out prompt rejected.  ``reward=partial`` gives
per-digit credit (:mod:`offpolicy_moe.tasks.rewards`), a dense signal on long answers.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from .arithmetic import disjoint_splits
from .base import PromptAnswerTask

_DEFAULTS = {"min_digits": 7, "max_digits": 8, "reward": "partial", "train_size": 4096, "eval_size": 128,
             "seed": 1234}
MAX_DIGITS = 32


def reverse_space(min_digits: int, max_digits: int) -> int:
    """Number of distinct problems: ``Σ_{n=min}^{max} 10^n``."""
    return sum(10 ** n for n in range(min_digits, max_digits + 1))


def draw_reverse(rng: np.random.Generator, min_digits: int, max_digits: int) -> tuple[str, str]:
    """One ``(prompt, answer)``: ``n ~ U{min..max}`` digits, each uniform in 0-9."""
    n = int(rng.integers(min_digits, max_digits + 1))
    digits = "".join(str(int(d)) for d in rng.integers(0, 10, size=n))
    return digits + "=", digits[::-1]


class ReverseTask(PromptAnswerTask):
    """The digit-reversal task (module docstring). ``ReverseTask(cfg)`` with a ``TaskConfig`` (``min_digits``,
    ``max_digits``, ``reward``, ``train_size``, ``eval_size``, ``seed``; the arithmetic-only keys are ignored),
    or those keywords."""

    def __init__(self, cfg: Optional[object] = None, **overrides) -> None:
        fields = {k: getattr(cfg, k, d) for k, d in _DEFAULTS.items()}
        unknown = set(overrides) - set(fields)
        if unknown:
            raise TypeError(f"unknown ReverseTask option(s): {sorted(unknown)}")
        fields.update(overrides)
        lo, hi = int(fields["min_digits"]), int(fields["max_digits"])
        if not 1 <= lo <= hi <= MAX_DIGITS:
            raise ValueError(f"task.min_digits/max_digits must satisfy 1 <= min <= max <= {MAX_DIGITS} for the "
                             f"reverse task, got {lo}, {hi}")
        self.min_digits, self.max_digits = lo, hi
        train, eval_ = disjoint_splits(lambda rng: draw_reverse(rng, lo, hi), reverse_space(lo, hi),
                                       int(fields["train_size"]), int(fields["eval_size"]), int(fields["seed"]))
        super().__init__(train, eval_, reward=fields["reward"], seed=int(fields["seed"]))

    def __repr__(self) -> str:
        return (f"ReverseTask(digits={self.min_digits}..{self.max_digits}, train={len(self.train_prompts)}, "
                f"eval={len(self.eval_prompts)}, reward={self.reward_kind!r})")
