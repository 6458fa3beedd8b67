"""A reward of your own, in a file outside the package: name it in the config as
``experiments/byo_task/rewards.py:bare_number`` (a path relative to the folder you start the run from).

The signature every reward function has: ``fn(completions, answers, **columns)`` with lists of equal length
(``columns``: ``prompts`` and every column of the dataset's rows, by name, when the trainer passes them), returning
one float per completion.
"""
from __future__ import annotations

import re

_BARE = re.compile(r"-?\d+")


def bare_number(completions, answers, **columns):
    """1.0 when the completion is only the final number (the format this task asks for), else 0.0: a format reward,
    weighted small next to ``math``."""
    return [1.0 if _BARE.fullmatch(c.split("<eos>")[0].strip()) else 0.0 for c in completions]
