"""Common shape of a prompt/answer task: a train split, a held-out eval split, a reward, a prompt stream."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from .rewards import REWARD_KINDS, compute_rewards

# Salt mixed into the seed of the RL prompt stream so it never coincides with the generator's streams.
_STREAM_SALT = 0x5EED_0001


class PromptAnswerTask:
    """A task made of ``{"prompt", "answer"}`` records.

    Subclasses fill ``_train`` and ``_eval`` (lists of ``(prompt, answer)``) in ``__init__`` and call
    ``super().__init__``.  Exposes ``train_dataset``/``eval_dataset`` (``datasets.Dataset`` with
    columns ``prompt`` and ``answer``, built lazily), :meth:`reward` and :meth:`sample_prompts`.
    """

    def __init__(self, train: Sequence[tuple[str, str]], eval_: Sequence[tuple[str, str]], *,
                 reward: str = "exact", seed: int = 0) -> None:
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
        self._datasets: dict[str, object] = {}

    # ----------------------------------------------------------------- datasets
    def _dataset(self, split: str):
        if split not in self._datasets:
            from datasets import Dataset

            prompts, answers = ((self.train_prompts, self.train_answers) if split == "train"
                                else (self.eval_prompts, self.eval_answers))
            self._datasets[split] = Dataset.from_dict({"prompt": list(prompts), "answer": list(answers)})
        return self._datasets[split]

    @property
    def train_dataset(self):
        """Training split as a ``datasets.Dataset`` (columns ``prompt``, ``answer``)."""
        return self._dataset("train")

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
    def reward(self, completions: Sequence[str], answers: Sequence[str]) -> list[float]:
        """Reward of each completion against its answer, with the task's reward kind (exact | partial).

        Completions are cut at ``<eos>`` and stripped before comparison (see :mod:`.rewards`).
        """
        return compute_rewards(completions, answers, self.reward_kind)

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
