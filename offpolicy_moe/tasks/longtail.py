"""Worked sums with a long-tailed number of steps: most problems are short, a few are very long.

The problems and references are the chain task's (:mod:`offpolicy_moe.tasks.chain_sum`): ``n`` one-digit operands
joined by ``+`` and closed by ``=``, worked left to right one addition per step (``"3+8+5+2="`` ->
``"11+5+2=16+2=18"``), rewarded on the final number alone (:func:`~offpolicy_moe.tasks.chain_sum.final_answer_reward`),
with the SFT warm start training on the whole reference.  What differs is ``n``: each problem draws its number of
terms from a truncated Zipf (discrete Pareto) law,

    P(N = n) = (n - n_min + 1) ** (-alpha) / sum_{k=1}^{K} k ** (-alpha),   n = n_min, ..., n_max,

with ``n_min`` = :data:`MIN_TERMS` (4), ``n_max`` = ``task.max_terms`` (default 15), ``K = n_max - n_min + 1`` and
``alpha`` = ``task.length_tail`` (default 2; 0 is uniform, larger is a thinner tail).  A problem has ``n - 1``
steps and its reference rewrites the remaining terms at every step, so its length grows as ``n ** 2``: 11-14
tokens of the embedded character tokenizer at 4 terms, 19-23 at 5, 41-47 at 7, 89-98 at 10, 131-143 at 12 and
209-227 at 15 (plus eos).  The prompt is ``2 n`` tokens; bos + prompt + answer + eos must fit the embedded model's
256 positions (:data:`POSITIONS`), which every problem of up to 14 terms does and a 15-term one does unless its
reference passes 224 tokens (about 2 in 10,000 of them: those are drawn again), so 15 is the most terms
(:data:`MAX_TERMS`) and the longest reference is 224 tokens.

At ``alpha = 2`` the head ``n = 4`` holds 64-80% of the problems whatever ``n_max`` is, so the median reference
stays at 14 tokens while ``task.max_terms`` moves the longest one: that key is the length of the tail.  Measured
on the 4096-problem train split (``task.seed`` 1234, tokens without eos; asserted in tests/tasks/test_longtail.py):

==================  ======  ===  ===  =========  ====================
``task.max_terms``  median  min  max  max/median  nominal (:data:`TAIL_SETTINGS`)
==================  ======  ===  ===  =========  ====================
6                   14      11   34   2.43        2
8                   14      11   62   4.43        4
11                  14      11   119  8.50        8
15 (the default)    14      11   224  16.0
==================  ======  ===  ===  =========  ====================

(the quadratic lengths move in whole steps: these are the settings nearest to 2, 4 and 8).  In a batch of 16
prompts at the defaults, about one batch in two holds a problem of 10 or more terms (>= 89 tokens): a synchronous
RL step waits for that one sequence while the typical one stopped after 14 tokens.

The warm start's teacher (``task.estimate_share``, default 0): that share of the SFT demonstrations
(:attr:`LongTailTask.demonstrations`, rows picked by :func:`estimate_rows`) estimate the answer instead of working
it, ``=`` and the sum rounded to tens (:func:`estimate_answer`: ``"3+8+5+2="`` -> ``"=20"``).  The RL prompts, the
references and the reward are unchanged, so an estimate is rewarded only when the sum is a multiple of ten.  A warm
start taught so estimates most problems at greedy decoding, and RL on the final-answer reward teaches it to work
them out (bench_tta.py's ``longtail`` job: share 0.5, held-out accuracy +0.26 to +0.41 in 120 steps on 5 seeds,
experiments/results/tta/longtail/probes.md).

Splits as the other procedural tasks (:func:`offpolicy_moe.tasks.arithmetic.disjoint_splits`: distinct held-out
prompts drawn first, every held-out prompt refused in training; a pure function of ``task.seed``).
``task.name=longtail``.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

from .chain_sum import ChainSumTask, chain_space, draw_chain, final_number
from .settings import LONGTAIL_MIN_TERMS, POSITIONS
from .tokenizer import build_char_tokenizer, encode_texts

#: the fewest terms of a problem (the head of the law); the embedded model's positions, :data:`POSITIONS`, are the
#: longest bos + prompt + answer + eos a problem may take (both defined with the task's settings, which work out its
#: longest reference from them: :func:`~offpolicy_moe.tasks.settings.longtail_longest`)
MIN_TERMS = LONGTAIL_MIN_TERMS
#: the most terms ``task.max_terms`` may ask for (module docstring: 15 one-digit terms fit :data:`POSITIONS`)
MAX_TERMS = 15
#: ``task.max_terms`` of the three tail settings the issue measures, by their (nominal) max/median of the reference
#: lengths (module docstring's table)
TAIL_SETTINGS = {2: 6, 4: 8, 8: 11}

_DEFAULTS = {"min_digits": 1, "max_digits": 1, "max_terms": 15, "length_tail": 2.0, "estimate_share": 0.0,
             "reward": "exact", "train_size": 4096, "eval_size": 128, "seed": 1234}
#: salt of the generator that picks the warm start's estimated demonstrations (independent of the splits' streams)
_ESTIMATE_SALT = 0x5C07


def terms_law(max_terms: int, length_tail: float, min_terms: int = MIN_TERMS) -> tuple[np.ndarray, np.ndarray]:
    """``(n, P(N = n))`` for ``n = min_terms..max_terms``: the truncated Zipf law of the module docstring."""
    if not min_terms <= max_terms:
        raise ValueError(f"need min_terms <= max_terms, got {min_terms}, {max_terms}")
    terms = np.arange(min_terms, max_terms + 1)
    weights = (terms - min_terms + 1.0) ** (-float(length_tail))
    return terms, weights / weights.sum()


def draw_longtail(rng: np.random.Generator, terms: np.ndarray, probs: np.ndarray) -> tuple[str, str]:
    """One ``(prompt, answer)``: the number of terms from ``(terms, probs)`` (:func:`terms_law`), then a one-digit
    chain sum of that many terms (:func:`~offpolicy_moe.tasks.chain_sum.draw_chain`), its operands drawn again
    while bos + prompt + answer + eos would pass :data:`POSITIONS`."""
    n = int(terms[rng.choice(len(terms), p=probs)])
    while True:
        prompt, answer = draw_chain(rng, 1, 1, n)
        if len(prompt) + len(answer) + 2 <= POSITIONS:
            return prompt, answer


class LongTailTask(ChainSumTask):
    """Chain sums whose number of terms is long-tailed (module docstring).  ``LongTailTask(cfg)`` with a
    ``TaskConfig`` (``max_terms``, ``length_tail``, ``train_size``, ``eval_size``, ``seed``; ``min_digits`` and
    ``max_digits`` must be 1; ``reward`` must be ``exact``: the final answer's exact match), or those keywords."""

    DEFAULTS = _DEFAULTS
    TASK_NAME = "longtail"

    def generator(self, fields: dict) -> tuple[Callable[[np.random.Generator], tuple[str, str]], int]:
        """Check ``max_terms``, ``length_tail`` and the one-digit operands; the drawing function and the number of
        distinct problems (every one-digit chain of ``MIN_TERMS..max_terms`` terms)."""
        lo, hi = int(fields["min_digits"]), int(fields["max_digits"])
        if (lo, hi) != (1, 1):
            raise ValueError(f"task.min_digits/max_digits must be 1 for the longtail task (one-digit operands, so "
                             f"the longest problem fits 256 positions), got {lo}, {hi}")
        n_max = int(fields["max_terms"])
        if not MIN_TERMS + 1 <= n_max <= MAX_TERMS:
            raise ValueError(f"task.max_terms must be in {MIN_TERMS + 1}..{MAX_TERMS} for the longtail task, "
                             f"got {n_max}")
        alpha = float(fields["length_tail"])
        if not (math.isfinite(alpha) and alpha >= 0):
            raise ValueError(f"task.length_tail must be a finite number >= 0 for the longtail task, got {alpha}")
        share = float(fields["estimate_share"])
        if not (math.isfinite(share) and 0.0 <= share < 1.0):
            raise ValueError(f"task.estimate_share must be a number in [0, 1) for the longtail task, got {share}")
        self.min_digits = self.max_digits = 1
        self.min_terms, self.max_terms, self.length_tail = MIN_TERMS, n_max, alpha
        self.estimate_share = share
        terms, probs = terms_law(n_max, alpha)
        self.terms_probs = dict(zip(terms.tolist(), probs.tolist()))
        space = sum(chain_space(1, 1, int(n)) for n in terms)
        return (lambda rng: draw_longtail(rng, terms, probs)), space

    @property
    def demonstrations(self) -> dict[str, list[str]]:
        """The warm start's demonstrations (columns ``prompt``, ``answer`` as lists): the training split, with the
        answers of the rows :func:`estimate_rows` picks replaced by the teacher's estimate (:func:`estimate_answer`,
        ``"=20"``).  The split itself, the RL prompts and the reward are unchanged."""
        demos = self.rows("train")
        if self.estimate_share > 0.0:
            picked = estimate_rows(len(self.train_prompts), self.estimate_share, self.seed)
            demos["answer"] = [estimate_answer(a) if estimated else a for a, estimated in zip(demos["answer"], picked)]
        return demos

    def __repr__(self) -> str:
        return (f"LongTailTask(terms={self.min_terms}..{self.max_terms}, length_tail={self.length_tail}, "
                f"estimate_share={self.estimate_share}, train={len(self.train_prompts)}, "
                f"eval={len(self.eval_prompts)})")


def estimate_answer(answer: str) -> str:
    """What a teacher writes when it estimates instead of working: ``=`` and the final number rounded to the nearest
    ten, halves up, no steps (``"11+5+2=16+2=18"`` -> ``"=20"``).  Right only when the sum is a multiple of ten."""
    total = int(final_number(answer))
    return f"={(total + 5) // 10 * 10}"


def estimate_rows(n: int, share: float, seed: int) -> np.ndarray:
    """Which of ``n`` training rows the warm start's teacher estimates (:func:`estimate_answer`) instead of
    working: each independently with probability ``share``, a pure function of ``(seed, share)``."""
    rng = np.random.default_rng([int(seed), _ESTIMATE_SALT])
    return rng.random(int(n)) < float(share)


def num_terms(prompt: str) -> int:
    """The number of terms of a (chain or longtail) prompt: ``"3+8+5+2="`` -> 4."""
    return prompt.count("+") + 1


def reference_lengths(task: Any, tokenizer: Any = None, split: str = "train") -> list[int]:
    """Token counts (embedded character tokenizer unless ``tokenizer``; no eos) of the references of ``split``."""
    tok = tokenizer if tokenizer is not None else build_char_tokenizer()
    answers = task.train_answers if split == "train" else task.eval_answers
    return [len(ids) for ids in encode_texts(tok, list(answers))]
