"""How sampled evaluation reads a task's answers: the final answer of a completion (``None``: it has none), whether
a reference answer can be scored at all, and whether two answers agree.  The check follows the task's rewards: with
a ``math`` reward, math-verify's equivalence of final answers (:mod:`.math_answer`); otherwise exact match of the
cleaned completion (:mod:`.rewards`), the rule of ``eval/accuracy``.

A reference the check cannot read is never scored: it is excluded and counted (``eval/unscorable_refs``), never a
free 1.0 for a response that cannot be read either (huggingface/cookbook#335) nor a silent 0 that shifts pass@k
(NeMo-RL#3635).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from .math_answer import MathVerifier, extract_final_answer
from .rewards import clean_completion

__all__ = ["AnswerCheck", "ExactCheck", "MathCheck", "answer_check"]


class AnswerCheck:
    """The interface: :meth:`answer`, :meth:`reference`, :meth:`same`."""

    name = ""

    def answer(self, completion: str) -> Optional[str]:
        """The final answer of ``completion``; ``None`` when it has none (counted as ``eval/no_answer``)."""
        raise NotImplementedError

    def reference(self, answer: str) -> Optional[str]:
        """The reference ``answer`` as the check reads it; ``None`` when it cannot be scored."""
        raise NotImplementedError

    def same(self, reference: str, answer: str) -> bool:
        """Whether ``answer`` (from :meth:`answer`) is right for ``reference`` (from :meth:`reference`)."""
        raise NotImplementedError


@dataclass
class ExactCheck(AnswerCheck):
    """Exact match of the completion cut at end-of-sequence and stripped; an empty one holds no answer, an empty
    reference cannot be scored."""

    name = "exact"

    def answer(self, completion: str) -> Optional[str]:
        return clean_completion(completion) or None

    def reference(self, answer: str) -> Optional[str]:
        return answer.strip() or None

    def same(self, reference: str, answer: str) -> bool:
        return reference == answer


@dataclass
class MathCheck(AnswerCheck):
    """math-verify equivalence of final answers (``####``, the last ``\\boxed{}``, else the last number); a
    reference is scorable when math-verify reads an expression in it."""

    verifier: MathVerifier
    name = "math"

    def answer(self, completion: str) -> Optional[str]:
        return extract_final_answer(completion) or None

    def reference(self, answer: str) -> Optional[str]:
        ref = extract_final_answer(answer, reference=True)
        return ref if ref and self.verifier.parses(ref) else None

    def same(self, reference: str, answer: str) -> bool:
        return bool(self.verifier.equivalent(reference, answer))


def answer_check(task: Any) -> AnswerCheck:
    """The check of ``task``: :class:`MathCheck` on its math reward's verifier when it has one, else
    :class:`ExactCheck`."""
    verifier = getattr(getattr(task, "rewards", None), "verifier", None)
    return MathCheck(verifier) if verifier is not None else ExactCheck()
