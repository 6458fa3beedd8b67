"""Accuracy of ``n`` sampled answers per problem, as RL-for-reasoning papers report it: avg@n, the unbiased pass@k
and maj@k (majority vote).  Pure functions of per-sample outcomes; the sampling is the caller's.

Each problem contributes ``n`` samples, of which ``c`` are correct.  An unscorable sample (a response with no
extractable answer) counts as wrong and casts no vote; a problem whose reference cannot be scored is excluded by the
caller before it gets here, never scored.
"""
from __future__ import annotations

import functools
import itertools
import math
import random
from collections import Counter
from typing import Optional, Sequence

import numpy as np

__all__ = ["pass_at_k", "avg_at_n", "majority_correct", "maj_at_k", "report_ks", "check_ks"]

# maj@k over at most this many k-subsets of a problem's samples: every subset when there are no more, else a seeded
# sample of this many (the estimate's standard error is then at most 0.5 / sqrt(SUBSETS) per problem)
SUBSETS = 2048


def _check(n: int, k: int, c: Optional[int] = None) -> None:
    if n < 1:
        raise ValueError(f"sampled metrics need n >= 1 samples per problem, got n={n}")
    if not 1 <= k <= n:
        raise ValueError(f"pass@k / maj@k need 1 <= k <= n, got k={k} with n={n} samples per problem")
    if c is not None and not 0 <= c <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n correct samples, got c={c} of n={n}")


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of pass@k from ``n`` samples of which ``c`` are correct (Chen et al., 2021, "Evaluating
    Large Language Models Trained on Code", https://arxiv.org/abs/2107.03374, eq. 1): the probability that a
    uniformly drawn ``k``-subset of the ``n`` samples holds at least one correct one,

        pass@k = 1 - C(n - c, k) / C(n, k) = 1 - prod_{i = n - c + 1}^{n} (1 - k / i),

    the product form avoiding the large binomials.  Unbiased for ``1 - (1 - p)^k`` when the samples are independent
    draws with success rate ``p``.  ``pass@1 = c / n``."""
    _check(n, k, c)
    if n - c < k:
        return 1.0
    keep = 1.0
    for i in range(n - c + 1, n + 1):
        keep *= 1.0 - k / i
    return 1.0 - keep


def avg_at_n(correct: Sequence[bool]) -> float:
    """avg@n: the mean correctness of one problem's ``n`` samples (= pass@1 of the same samples)."""
    if not correct:
        raise ValueError("avg@n needs at least one sample")
    return sum(bool(x) for x in correct) / len(correct)


def majority_correct(answers: Sequence[Optional[str]], correct: Sequence[bool]) -> bool:
    """Whether the majority vote of one problem's samples is right: the answer given most often among the samples
    that have one (``None``: no extractable answer, no vote) wins, a tie going to the answer given first; no answer
    at all is wrong.  Samples with the same answer must agree on its correctness."""
    if len(answers) != len(correct):
        raise ValueError(f"{len(answers)} answers but {len(correct)} correctness flags")
    right: dict[str, bool] = {}
    for a, ok in zip(answers, correct):
        if a is None:
            continue
        if right.setdefault(a, bool(ok)) != bool(ok):
            raise ValueError(f"the answer {a!r} is scored both right and wrong: the checker's answers are not "
                             "comparable, so maj@k is undefined")
    votes = Counter(a for a in answers if a is not None)
    if not votes:
        return False
    top = max(votes.values())
    winner = next(a for a in answers if a is not None and votes[a] == top)      # the first answer among the tied
    return right[winner]


@functools.lru_cache(maxsize=128)
def _subsets(n: int, k: int, seed: int) -> np.ndarray:
    """The ``k``-subsets maj@k averages over (:func:`maj_at_k`), ``[S, k]`` sample indices, each row ascending: every
    subset when there are at most :data:`SUBSETS`, else :data:`SUBSETS` drawn with ``seed``; the same for every
    problem with the same ``n``, ``k`` and ``seed`` (computed once)."""
    if math.comb(n, k) <= SUBSETS:
        rows = list(itertools.combinations(range(n), k))
    else:
        rng = random.Random(seed)
        rows = [sorted(rng.sample(range(n), k)) for _ in range(SUBSETS)]
    out = np.asarray(rows, dtype=np.int64).reshape(len(rows), k)
    out.setflags(write=False)
    return out


def _answer_ids(answers: Sequence[Optional[str]], correct: Sequence[bool]) -> tuple[np.ndarray, np.ndarray]:
    """Each sample's answer as an index into the distinct answers (first seen first; ``-1``: no answer) and each
    distinct answer's correctness; ValueError when one answer is scored both right and wrong."""
    index: dict[str, int] = {}
    right: list[bool] = []
    ids = []
    for a, ok in zip(answers, correct):
        if a is None:
            ids.append(-1)
            continue
        if a not in index:
            index[a] = len(right)
            right.append(bool(ok))
        elif right[index[a]] != bool(ok):
            raise ValueError(f"the answer {a!r} is scored both right and wrong: the checker's answers are not "
                             "comparable, so maj@k is undefined")
        ids.append(index[a])
    return np.asarray(ids, dtype=np.int64), np.asarray(right, dtype=bool)


def maj_at_k(answers: Sequence[Optional[str]], correct: Sequence[bool], k: int, *, seed: int = 0) -> float:
    """maj@k of one problem: the expected :func:`majority_correct` of ``k`` samples drawn without replacement from its
    ``n``, the subsets keeping the samples' order; exact over every subset when there are at most :data:`SUBSETS`,
    else the mean over that many subsets drawn with ``seed``.  ``maj@n`` is the vote of all ``n`` samples.

    Every subset is voted at once (arrays ``[S, k]``): the votes of each sample's answer in its subset, the first
    sample whose answer has the most votes (a tie goes to the answer given first), that answer's correctness; the
    same wins as :func:`majority_correct` subset by subset."""
    n = len(answers)
    if len(correct) != n:
        raise ValueError(f"maj@k got {n} answers but {len(correct)} correctness flags")
    _check(n, k)
    ids, right = _answer_ids(answers, correct)
    subsets = _subsets(n, k, seed)
    if not right.size:
        return 0.0
    picked = ids[subsets]                                                  # [S, k] answer ids, -1: no answer
    votes = (picked[:, :, None] == np.arange(right.size)).sum(1)          # [S, A]
    top = votes.max(1)                                                     # [S]
    mine = np.where(picked >= 0, np.take_along_axis(votes, np.maximum(picked, 0), 1), -1)
    first = (mine == top[:, None]).argmax(1)                              # the first sample of a top answer
    winner = picked[np.arange(len(picked)), first]
    wins = (top > 0) & right[np.maximum(winner, 0)]
    return int(wins.sum()) / len(subsets)


def report_ks(n: int) -> list[int]:
    """The k at which pass@k and maj@k are reported for ``n`` samples: 1, 2, 4, ... up to ``n``, and ``n``."""
    if n < 1:
        raise ValueError(f"sampled metrics need n >= 1 samples per problem, got n={n}")
    ks = [1 << i for i in range(n.bit_length()) if (1 << i) <= n]
    return ks if ks[-1] == n else ks + [n]


def check_ks(n: int, ks: Optional[Sequence[int]] = None) -> list[int]:
    """The ``k`` at which pass@k and maj@k are reported for ``n`` samples: ``ks`` (sorted, distinct) when given,
    else :func:`report_ks`; one-line ``ValueError`` when ``n < 1`` or a ``k`` is outside ``[1, n]`` (pass@k and
    maj@k take ``k`` of the ``n`` samples)."""
    if n < 1:
        raise ValueError(f"sampled evaluation needs n >= 1 samples per problem, got n={n}")
    if not ks:
        return report_ks(n)
    out = sorted({int(k) for k in ks})
    bad = [k for k in out if not 1 <= k <= n]
    if bad:
        raise ValueError(f"pass@k and maj@k need 1 <= k <= n: k={bad[-1]} with n={n} samples per problem (draw at "
                         f"least {max(bad)} samples, or ask for a smaller k)")
    return out
