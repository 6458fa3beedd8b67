"""A prompt/answer task read from disk (``task.name=dataset:<folder or file>``, or ``jsonl:<file>``).

Rows come from :func:`offpolicy_moe.tasks.local_data.load_rows` (``task.prompt_column``, ``task.answer_column``,
``task.answer_format``, the ``task.split`` split).  The evaluation split is either the named split ``task.eval_split``
(its first ``task.eval_size`` rows), or held out from the training split: ``n_eval`` distinct prompts chosen by a
seeded shuffle of the sorted distinct prompts (``n_eval = round(task.eval_fraction * #prompts)`` when
``eval_fraction > 0``, else ``task.eval_size``; capped at half the prompts, with a warning); every row whose prompt is
held out leaves training, so the splits are disjoint.  Every stored column of a training row is passed to the reward
functions (:meth:`~offpolicy_moe.tasks.base.PromptAnswerTask.batch_context`).
"""
from __future__ import annotations

import warnings
from typing import Optional

import numpy as np

from .base import PromptAnswerTask
from .local_data import load_rows

OPTIONS = {"reward": "exact", "eval_size": 128, "seed": 1234, "split": "train", "eval_split": None,
           "eval_fraction": 0.0, "prompt_column": "prompt", "answer_column": "answer", "answer_format": "plain"}


class DatasetTask(PromptAnswerTask):
    """Prompt/answer rows of a dataset on disk, split into disjoint train/eval (module docstring)."""

    def __init__(self, source: str, cfg: Optional[object] = None, *, json_lines: bool = False, **overrides) -> None:
        fields = {k: getattr(cfg, k, v) for k, v in OPTIONS.items()}
        unknown = set(overrides) - set(fields)
        if unknown:
            raise TypeError(f"unknown {type(self).__name__} option(s): {sorted(unknown)}")
        fields.update(overrides)
        self.path = source
        read = dict(prompt_column=fields["prompt_column"], answer_column=fields["answer_column"],
                    answer_format=fields["answer_format"], json_lines=json_lines)
        rows = load_rows(source, split=fields["split"], **read)
        seed = int(fields["seed"])
        if fields["eval_split"]:
            held = load_rows(source, split=fields["eval_split"], key="task.eval_split", **read)
            eval_rows = [(p, a) for p, a, _ in held[:max(int(fields["eval_size"]), 1)]]
            train = rows
        else:
            eval_rows, train = self._hold_out(rows, source, fields)
        super().__init__([(p, a) for p, a, _ in train], eval_rows, reward=fields["reward"], seed=seed,
                         train_columns=[c for _, _, c in train])

    @staticmethod
    def _hold_out(rows: list, source: str, fields: dict) -> tuple[list, list]:
        prompts = sorted({p for p, _, _ in rows})
        if len(prompts) < 2:
            raise ValueError(f"task file {source!r} has {len(prompts)} distinct prompt; at least 2 are needed "
                             "(one is held out for evaluation)")
        frac = float(fields["eval_fraction"] or 0.0)
        n_eval = int(round(frac * len(prompts))) if frac > 0 else int(fields["eval_size"])
        n_eval = max(n_eval, 1)
        if n_eval > len(prompts) // 2:
            n_eval = len(prompts) // 2
            warnings.warn(f"{source} has {len(prompts)} distinct prompts; eval split capped at {n_eval}", stacklevel=3)
        order = np.random.default_rng([int(fields["seed"]), 0x150E]).permutation(len(prompts))
        held_out = {prompts[i] for i in order[:n_eval]}
        eval_rows, seen = [], set()
        for p, a, _ in rows:
            if p in held_out and p not in seen:
                seen.add(p)
                eval_rows.append((p, a))
        return eval_rows, [r for r in rows if r[0] not in held_out]
