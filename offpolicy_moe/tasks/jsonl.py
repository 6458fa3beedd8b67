"""A local prompt/answer dataset on disk: one JSON object ``{"prompt": ..., "answer": ...}`` per line.

Selected with ``task.name="jsonl:<path>"``.  The evaluation split holds out ``eval_size`` distinct
prompts chosen by a seeded shuffle; every record whose prompt is held out is removed from training, so
the splits are disjoint.  Reading is strict: a bad line raises ``ValueError`` naming the file and line.
"""
from __future__ import annotations

import json
import os
import warnings
from typing import Optional

import numpy as np

from .base import PromptAnswerTask


def read_jsonl_records(path: str) -> list[tuple[str, str]]:
    """``(prompt, answer)`` of every non-blank line of ``path``; both fields must be non-empty strings.

    Every problem is a ``ValueError`` naming the file (and the line): missing, a folder, not UTF-8, not JSON, a
    record without string fields, an empty prompt or answer, no records.
    """
    if os.path.isdir(path):
        raise ValueError(f"task file {path!r} is a folder, not a JSONL file")
    if not os.path.isfile(path):
        raise ValueError(f"task file {path!r} does not exist")
    rows: list[tuple[str, str]] = []
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise ValueError(f"{path}:{lineno}: not UTF-8 text") from None
            if line.strip():
                rows.append(_parse_record(path, lineno, line))
    if not rows:
        raise ValueError(f"task file {path!r} has no records")
    return rows


def _parse_record(path: str, lineno: int, line: str) -> tuple[str, str]:
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
    if not isinstance(rec, dict) or not isinstance(rec.get("prompt"), str) or not isinstance(rec.get("answer"), str):
        raise ValueError(f"{path}:{lineno}: expected an object with string fields 'prompt' and 'answer'")
    for key in ("prompt", "answer"):
        if not rec[key].strip():
            raise ValueError(f"{path}:{lineno}: empty '{key}'")
    return rec["prompt"], rec["answer"]


class JsonlTask(PromptAnswerTask):
    """Prompt/answer records from a local JSONL file, split into disjoint train/eval by prompt."""

    def __init__(self, path: str, cfg: Optional[object] = None, **overrides) -> None:
        fields = {"reward": getattr(cfg, "reward", "exact"), "eval_size": getattr(cfg, "eval_size", 128),
                  "seed": getattr(cfg, "seed", 1234)}
        unknown = set(overrides) - set(fields)
        if unknown:
            raise TypeError(f"unknown JsonlTask option(s): {sorted(unknown)}")
        fields.update(overrides)
        self.path = path
        rows = read_jsonl_records(path)
        prompts = sorted({p for p, _ in rows})
        if len(prompts) < 2:
            raise ValueError(f"task file {path!r} has {len(prompts)} distinct prompt; at least 2 are needed "
                             "(one is held out for evaluation)")
        n_eval = int(fields["eval_size"])
        if n_eval > len(prompts) // 2:
            n_eval = len(prompts) // 2
            warnings.warn(f"{path} has {len(prompts)} distinct prompts; eval split capped at {n_eval}", stacklevel=2)
        order = np.random.default_rng([int(fields["seed"]), 0x150E]).permutation(len(prompts))
        held_out = {prompts[i] for i in order[:n_eval]}
        eval_rows, seen = [], set()
        for p, a in rows:
            if p in held_out and p not in seen:
                seen.add(p)
                eval_rows.append((p, a))
        train_rows = [(p, a) for p, a in rows if p not in held_out]
        super().__init__(train_rows, eval_rows, reward=fields["reward"], seed=int(fields["seed"]))
