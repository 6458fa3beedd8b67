"""Scoring ``n`` sampled completions per problem with a task's :class:`~.answer_check.AnswerCheck`, and the metrics
of :mod:`.sampled_metrics` over them: ``eval/avg@n``, ``eval/pass@k``, ``eval/maj@k``, with the unscorable references
excluded and counted (``eval/unscorable_refs``) and the responses without an answer counted apart
(``eval/no_answer``; they are wrong and cast no vote)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

from .answer_check import AnswerCheck
from .sampled_metrics import avg_at_n, maj_at_k, pass_at_k, report_ks

__all__ = ["SampledScores", "score_samples", "sampled_metrics"]


@dataclass
class SampledScores:
    """Per scored problem (its ``n`` samples in order): correctness and the answer each sample votes for (answers
    that the check finds equivalent vote together); the problems whose reference could not be scored."""

    n: int
    correct: list[list[bool]] = field(default_factory=list)
    votes: list[list[Optional[str]]] = field(default_factory=list)
    vote_correct: list[list[bool]] = field(default_factory=list)    # each vote's answer right for the reference
    unscorable: list[int] = field(default_factory=list)       # indices of problems excluded
    no_answer: int = 0                                          # responses of scored problems with no answer


def _vote(check: AnswerCheck, answer: Optional[str], seen: list[str]) -> Optional[str]:
    """The representative of ``answer`` among the answers ``seen`` in this problem (the first one the check finds
    the same), or ``answer`` itself, then seen."""
    if answer is None:
        return None
    for rep in seen:
        if rep == answer or check.same(rep, answer):
            return rep
    seen.append(answer)
    return answer


def score_samples(check: AnswerCheck, completions: Sequence[str], references: Sequence[str], n: int) -> SampledScores:
    """Score ``completions`` (problem ``i``'s samples are ``completions[i * n:(i + 1) * n]``) against
    ``references`` (one per problem)."""
    if n < 1:
        raise ValueError(f"sampled scoring needs n >= 1 samples per problem, got n={n}")
    if len(completions) != len(references) * n:
        raise ValueError(f"{len(completions)} completions for {len(references)} problems x {n} samples")
    out = SampledScores(n=n)
    for i, raw_ref in enumerate(references):
        ref = check.reference(raw_ref)
        if ref is None:
            out.unscorable.append(i)
            continue
        answers = [check.answer(c) for c in completions[i * n:(i + 1) * n]]
        out.no_answer += sum(a is None for a in answers)
        out.correct.append([a is not None and check.same(ref, a) for a in answers])
        seen: list[str] = []
        votes = [_vote(check, a, seen) for a in answers]
        right = {v: check.same(ref, v) for v in seen}
        out.votes.append(votes)
        out.vote_correct.append([v is not None and right[v] for v in votes])
    return out


def sampled_metrics(scores: SampledScores, prefix: str = "eval/", ks: Optional[Sequence[int]] = None,
                    seed: int = 0) -> dict[str, float]:
    """``{prefix}avg@n``, ``{prefix}pass@k`` and ``{prefix}maj@k`` for each ``k`` (default :func:`report_ks`), means
    over the scored problems (NaN when none could be scored), and the counts ``{prefix}unscorable_refs``,
    ``{prefix}no_answer``, ``{prefix}scored_problems``."""
    n = scores.n
    ks = list(ks) if ks is not None else report_ks(n)
    m = len(scores.correct)
    out: dict[str, float] = {f"{prefix}unscorable_refs": float(len(scores.unscorable)),
                             f"{prefix}no_answer": float(scores.no_answer), f"{prefix}scored_problems": float(m)}

    def mean(values: list[float]) -> float:
        return sum(values) / m if m else float("nan")

    out[f"{prefix}avg@{n}"] = mean([avg_at_n(c) for c in scores.correct])
    for k in ks:
        out[f"{prefix}pass@{k}"] = mean([pass_at_k(n, sum(c), k) for c in scores.correct])
        out[f"{prefix}maj@{k}"] = mean([maj_at_k(v, c, k, seed=seed) for v, c in zip(scores.votes, scores.vote_correct)])
    return out
