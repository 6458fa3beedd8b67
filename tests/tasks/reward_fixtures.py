"""Reward functions the task tests name by import path (``tests.tasks.reward_fixtures:<function>``)."""
from __future__ import annotations

import math


def length_bonus(completions, answers, **columns):
    """0.1 per character of the completion (a shaping reward with known values)."""
    return [0.1 * len(c) for c in completions]


def echo_column(completions, answers, *, prompts, level, **columns):
    """The row's ``level`` column as the reward (checks that the row's columns arrive, aligned)."""
    assert len(prompts) == len(completions) == len(level)
    return [float(x) for x in level]


def raises_on_seven(completions, answers, **columns):
    """Raises on a completion "7"."""
    if "7" in completions:
        raise ZeroDivisionError("seven is unlucky")
    return [0.0 for _ in completions]


def nan_on_seven(completions, answers, **columns):
    """NaN for a completion "7"."""
    return [math.nan if c == "7" else 1.0 for c in completions]


def one_short(completions, answers, **columns):
    """One value too few."""
    return [1.0] * (len(completions) - 1)


NOT_CALLABLE = 3
