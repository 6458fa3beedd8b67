"""A local prompt/answer JSON-lines file: ``task.name="jsonl:<path>"``, shorthand for ``dataset:<path>``.

It goes through the same reader as ``dataset:`` (:mod:`.local_data`: a line-by-line scan, then
``datasets.load_dataset("json")``) and the same split (:mod:`.dataset_task`); the columns default to ``prompt`` and
``answer`` (``task.prompt_column`` / ``task.answer_column`` rename them).  Reading is strict: a bad line raises
``ValueError`` naming the file and line.
"""
from __future__ import annotations

import os
from typing import Optional

from .dataset_task import DatasetTask
from .local_data import load_rows


def read_jsonl_records(path: str) -> list[tuple[str, str]]:
    """``(prompt, answer)`` of every non-blank line of ``path``; both fields must be non-empty strings.

    Every problem is a ``ValueError`` naming the file (and the line): missing, a folder, not UTF-8, not JSON, a
    record without string fields, an empty prompt or answer, no records.
    """
    _check_file(path)
    return [(p, a) for p, a, _ in load_rows(path, json_lines=True)]


def _check_file(path: str) -> None:
    if os.path.isdir(path):
        raise ValueError(f"task file {path!r} is a folder, not a JSONL file")
    if not os.path.isfile(path):
        raise ValueError(f"task file {path!r} does not exist")


class JsonlTask(DatasetTask):
    """Prompt/answer records from a local JSONL file, split into disjoint train/eval by prompt."""

    def __init__(self, path: str, cfg: Optional[object] = None, **overrides) -> None:
        _check_file(path)
        super().__init__(path, cfg, json_lines=True, **overrides)
