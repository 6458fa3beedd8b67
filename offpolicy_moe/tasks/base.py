"""Common shape of a prompt/answer task: a train split, a held-out eval split, its rewards, a prompt stream."""
from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import numpy as np

from .custom_rewards import RewardScores, RewardSet, RewardSpec, parse_reward_specs
from .rewards import REWARD_KINDS

# Salt mixed into the seed of the RL prompt stream so it never coincides with the generator's streams.
_STREAM_SALT = 0x5EED_0001


class PromptAnswerTask:
    """A task made of ``{"prompt", "answer"}`` records.

    Subclasses build ``train`` and ``eval_`` (lists of ``(prompt, answer)``) in ``__init__`` and call
    ``super().__init__``; a task read from disk also passes ``train_columns`` (one dict of the row's stored columns
    per training pair).  Exposes ``train_dataset``/``eval_dataset`` (``datasets.Dataset`` with columns ``prompt``
    and ``answer``, built lazily), :meth:`score` / :meth:`reward` and :meth:`sample_prompts`.  Its rewards are the
    ``reward`` kind alone until :meth:`configure_rewards` sets ``task.rewards``.
    """

    def __init__(self, train: Sequence[tuple[str, str]], eval_: Sequence[tuple[str, str]], *,
                 reward: str = "exact", seed: int = 0,
                 train_columns: Optional[Sequence[Mapping[str, Any]]] = None) -> None:
        if reward not in REWARD_KINDS:
            raise ValueError(f"task.reward={reward!r} is not one of {REWARD_KINDS}")
        if len(train) == 0:
            raise ValueError("the task has no training problems")
        self.reward_kind = reward
        self.seed = int(seed)
        self.train_prompts = [p for p, _ in train]
        self.train_answers = [a for _, a in train]
        self.eval_prompts = [p for p, _ in eval_]
        self.eval_answers = [a for _, a in eval_]
        if train_columns is not None and len(train_columns) != len(self.train_prompts):
            raise ValueError(f"{len(train_columns)} column rows for {len(self.train_prompts)} training pairs")
        self.train_columns = list(train_columns) if train_columns is not None else None
        self._datasets: dict[str, object] = {}
        self.rewards = RewardSet([RewardSpec(name=reward, fn=reward)])
        self.last_scores: Optional[RewardScores] = None

    def configure_rewards(self, entries: Any = None, *, on_error: str = "stop", math_timeout_s: float = 5.0) -> None:
        """Use the ``task.rewards`` entries (see :mod:`.custom_rewards`; each import path is resolved now), or the
        task's ``reward`` kind alone when there are none, with ``task.on_reward_error`` and ``task.math_timeout_s``."""
        specs = parse_reward_specs(entries) or [RewardSpec(name=self.reward_kind, fn=self.reward_kind)]
        self.rewards = RewardSet(specs, on_error=on_error, math_timeout_s=math_timeout_s)

    def set_prompts(self, train_prompts: Sequence[str], eval_prompts: Sequence[str]) -> None:
        """Replace the prompt texts (same lengths and order; e.g. rendered with a chat template)."""
        if len(train_prompts) != len(self.train_prompts) or len(eval_prompts) != len(self.eval_prompts):
            raise ValueError("set_prompts must keep the number of train and eval prompts")
        self.train_prompts, self.eval_prompts = list(train_prompts), list(eval_prompts)
        self._datasets.clear()

    # ----------------------------------------------------------------- datasets
    def rows(self, split: str, n: Optional[int] = None) -> dict[str, list[str]]:
        """The ``prompt`` and ``answer`` columns of ``split`` (``"train"`` or ``"eval"``) as plain lists, the first
        ``n`` rows when given: what evaluation and the warm start read (building a ``datasets.Dataset`` would import
        ``datasets``, about 0.4 s of every run's start-up)."""
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        prompts, answers = ((self.train_prompts, self.train_answers) if split == "train"
                            else (self.eval_prompts, self.eval_answers))
        return {"prompt": list(prompts[:n]), "answer": list(answers[:n])}

    def _dataset(self, split: str):
        if split not in self._datasets:
            from datasets import Dataset

            self._datasets[split] = Dataset.from_dict(self.rows(split))
        return self._datasets[split]

    @property
    def train_dataset(self):
        """Training split as a ``datasets.Dataset`` (columns ``prompt``, ``answer``)."""
        return self._dataset("train")

    @property
    def demonstrations(self) -> dict[str, list[str]]:
        """What the SFT warm start trains on (columns ``prompt``, ``answer`` as lists): the training split unless a
        task's teacher writes some answers another way
        (:attr:`~offpolicy_moe.tasks.longtail.LongTailTask.demonstrations`)."""
        return self.rows("train")

    @property
    def eval_dataset(self):
        """Held-out evaluation split as a ``datasets.Dataset`` (columns ``prompt``, ``answer``)."""
        return self._dataset("eval")

    @property
    def max_answer_chars(self) -> int:
        """Longest answer over both splits (the engine needs ``max_new_tokens >= this + 1`` for eos)."""
        return max(len(a) for a in self.train_answers + self.eval_answers)

    @property
    def alphabet(self) -> set[str]:
        """Every character used by a prompt or an answer (for tokenizer compatibility checks)."""
        chars: set[str] = set()
        for s in self.train_prompts + self.train_answers + self.eval_prompts + self.eval_answers:
            chars.update(s)
        return chars

    # ----------------------------------------------------------------- rewards
    def score(self, completions: Sequence[str], answers: Sequence[str], *, prompts: Sequence[str] = (),
              columns: Optional[Mapping[str, Sequence[Any]]] = None) -> RewardScores:
        """Every configured reward of each completion, and their weighted sum ``R_i = sum_k w_k r_k(i)``
        (:class:`~.custom_rewards.RewardSet`); ``prompts`` and ``columns`` (see :meth:`batch_context`) are passed to
        the reward functions.  Raises :class:`~.custom_rewards.RewardError` under ``on_reward_error=stop``."""
        return self.rewards.score(completions, answers, prompts=prompts, columns=columns)

    def reward(self, completions: Sequence[str], answers: Sequence[str]) -> list[float]:
        """``score(completions, answers).total``; the full :class:`~.custom_rewards.RewardScores` (per-reward values
        and counters for ``reward/<name>`` metrics) is kept in ``self.last_scores``.

        Completions are cut at ``<eos>`` and stripped before comparison (see :mod:`.rewards`).
        """
        self.last_scores = self.score(completions, answers)
        return self.last_scores.total

    def batch_context(self, group_ids: Any, prompts_per_step: int) -> dict:
        """``{"prompts": [...], "columns": {name: [...]}}`` of the rows behind a rollout batch, for :meth:`score`.

        The trainer numbers groups ``g = iteration * prompts_per_step + j`` (``j``: position in the iteration's
        :meth:`sample_prompts`), so row ``g`` is ``sample_indices(g // P, P)[g % P]``.  ``columns`` holds the
        stored columns of a dataset read from disk (empty for generated tasks)."""
        P = int(prompts_per_step)
        gids = [int(g) for g in (group_ids.tolist() if hasattr(group_ids, "tolist") else group_ids)]
        drawn: dict[int, np.ndarray] = {}
        idx = []
        for g in gids:
            it = g // P
            if it not in drawn:
                drawn[it] = self.sample_indices(it, P)
            idx.append(int(drawn[it][g % P]))
        columns: dict[str, list] = {}
        if self.train_columns is not None:
            names = list(self.train_columns[0]) if self.train_columns else []
            columns = {k: [self.train_columns[i].get(k) for i in idx] for k in names}
        return {"prompts": [self.train_prompts[i] for i in idx], "columns": columns}

    # ----------------------------------------------------------------- RL prompt stream
    def sample_indices(self, step: int, n: int) -> np.ndarray:
        """Indices into the train split for RL step ``step``: uniform with replacement, a pure function
        of ``(task seed, step)`` so a resumed run draws exactly the same prompts."""
        if n <= 0:
            raise ValueError(f"n must be positive, got {n}")
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        rng = np.random.default_rng([self.seed, _STREAM_SALT, int(step)])
        return rng.integers(0, len(self.train_prompts), size=n)

    def sample_prompts(self, step: int, n: int) -> list[dict]:
        """``n`` training rows ``{"prompt", "answer", "index"}`` for RL step ``step`` (deterministic, resumable)."""
        return [{"prompt": self.train_prompts[i], "answer": self.train_answers[i], "index": int(i)}
                for i in self.sample_indices(step, n)]

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(train={len(self.train_prompts)}, eval={len(self.eval_prompts)}, "
                f"reward={self.reward_kind!r})")
