"""One non-finite policy for the whole training step (``trainer.on_nan``, ``trainer.max_nan_skips``).

Wherever a NaN or an infinity first shows up (:data:`STAGES`), that stage raises (or is translated into) one
:class:`NonFiniteError` naming the stage, and the trainer hands it to one :class:`NanCounter`.  ``stop``: the trainer
checkpoints the last finite state and the run ends ``diverged``, naming the stage and the step.  ``skip``: the batch
(or update) is dropped and counted (``actor/nan_skipped``, ``nan/<stage>``), and after ``trainer.max_nan_skips`` in a
row the run stops as ``diverged``.  :func:`nonfinite_as` turns the loss library's
:class:`~offpolicy_moe.losses.NonFiniteInput` into a :class:`NonFiniteError`, by type.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import contextlib
import math

import torch

from offpolicy_moe.losses import NonFiniteInput

__all__ = ["STAGES", "SKIPPABLE", "NonFiniteError", "NanCounter", "nonfinite_as", "is_finite", "all_finite",
           "watch_logits"]

#: the stages of a step, in order (``nan/<stage>`` counts each); ``sft`` is the warm start before step 1
STAGES = ("sft", "generation", "old_logp", "reference", "metrics", "loss", "gradients", "optimizer", "evaluation")

#: the stages a skip can happen in (the warm start always stops: there is no earlier finite state to fall back to)
SKIPPABLE = STAGES[1:]


class NonFiniteError(RuntimeError):
    """A NaN or an infinity in stage ``stage`` (one of :data:`STAGES`) of trained step ``step`` (1-based: the step
    being computed; 0 before the first) at generation iteration ``iteration``; ``what`` names the values."""

    def __init__(self, stage: str, what: str, *, step: Optional[int] = None, iteration: Optional[int] = None,
                 note: str = ""):
        if stage not in STAGES:
            raise ValueError(f"unknown stage {stage!r}; expected one of {', '.join(STAGES)}")
        self.stage, self.what, self.step, self.iteration, self.note = stage, what, step, iteration, note
        super().__init__(self.describe())

    def describe(self) -> str:
        """One line: ``non-finite <what> at step <n> (iteration <i>, stage <stage>)[; note]``."""
        where, inside = "", f"stage {self.stage}"
        if self.step is not None:
            where = f" at step {self.step}"
            if self.iteration is not None:
                inside = f"iteration {self.iteration}, {inside}"
        return f"non-finite {self.what}{where} ({inside})" + (f"; {self.note}" if self.note else "")

    def located(self, step: int, iteration: Optional[int] = None) -> "NonFiniteError":
        """The same error at ``step`` / ``iteration`` (those already set are kept)."""
        return NonFiniteError(self.stage, self.what, step=self.step if self.step is not None else step,
                              iteration=self.iteration if self.iteration is not None else iteration, note=self.note)

    def with_note(self, note: str) -> "NonFiniteError":
        """The same error with ``note`` appended to its message."""
        joined = f"{self.note}; {note}" if self.note else note
        return NonFiniteError(self.stage, self.what, step=self.step, iteration=self.iteration, note=joined)

    def __reduce__(self):       # picklable (worker pipes) despite the keyword-only arguments
        return (_rebuild, (self.stage, self.what, self.step, self.iteration, self.note))


def _rebuild(stage: str, what: str, step: Optional[int], iteration: Optional[int], note: str) -> NonFiniteError:
    return NonFiniteError(stage, what, step=step, iteration=iteration, note=note)


@contextlib.contextmanager
def nonfinite_as(stage: str, what: str) -> Iterator[None]:
    """Inside the block the loss library's :class:`~offpolicy_moe.losses.NonFiniteInput` becomes a
    :class:`NonFiniteError` of ``stage`` naming ``what`` (a :class:`NonFiniteError` passes unchanged)."""
    try:
        yield
    except NonFiniteInput as exc:
        raise NonFiniteError(stage, f"{what} ({str(exc).strip().splitlines()[0]})") from exc


def is_finite(x: torch.Tensor | float) -> bool:
    """True iff every element is finite."""
    if isinstance(x, torch.Tensor):
        return bool(torch.isfinite(x).all())
    return math.isfinite(float(x))


def all_finite(x: Optional[torch.Tensor], mask: Optional[torch.Tensor] = None) -> bool:
    """True when every element of ``x`` (those where ``mask`` is non-zero, with a mask) is finite; None is."""
    if x is None or x.numel() == 0:
        return True
    x = x.detach()
    if mask is not None:
        x = torch.where(mask.to(x.device).bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))
    lo, hi = torch.aminmax(x.float())
    return bool(torch.isfinite(lo) & torch.isfinite(hi))


@contextlib.contextmanager
def watch_logits(model: torch.nn.Module) -> Iterator["LogitWatch"]:
    """Watch the next-token logits ``model`` computes inside the block (a forward hook on its output embeddings,
    the last position of each row only: left-padded prompts end on a real token); ``watch.bad`` is True afterwards
    when any of them was NaN or infinite.  One reduction per forward, one host sync at the end."""
    watch = LogitWatch()
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    handle = head.register_forward_hook(watch.hook) if head is not None else None
    try:
        yield watch
    finally:
        if handle is not None:
            handle.remove()


@dataclass
class LogitWatch:
    """What :func:`watch_logits` saw: one 0-d flag per forward, resolved with one sync by :attr:`bad`."""

    flags: list = field(default_factory=list)

    def hook(self, module: Any, args: Any, out: Any) -> None:
        logits = out[0] if isinstance(out, tuple) else out
        if isinstance(logits, torch.Tensor) and logits.numel():
            last = logits.detach()[..., -1, :] if logits.dim() >= 3 else logits.detach()
            lo, hi = torch.aminmax(last.float())
            self.flags.append(~(torch.isfinite(lo) & torch.isfinite(hi)))

    @property
    def bad(self) -> bool:
        """True when a watched forward gave a non-finite next-token logit."""
        return bool(torch.stack(self.flags).any()) if self.flags else False


@dataclass
class NanCounter:
    """``trainer.on_nan`` applied: :meth:`record` raises under ``stop`` and after ``max_in_row`` skips in a row,
    and counts the skip otherwise; :meth:`step_done` ends a clean step (the run of skips is broken).  Its counts
    are checkpointed (:meth:`state_dict`)."""

    policy: str = "skip"
    max_in_row: int = 10
    skipped: int = 0
    in_row: int = 0
    by_stage: dict = field(default_factory=lambda: {s: 0 for s in STAGES})
    _this_step: int = 0

    def record(self, exc: NonFiniteError) -> None:
        """Apply the policy to ``exc``: raise it (``stop``, or the ``max_in_row``-th skip in a row, both naming the
        setting) or count it as skipped."""
        if self.policy == "stop":
            raise exc.with_note("the run diverged (trainer.on_nan=stop)")
        self.skipped += 1
        self.in_row += 1
        self._this_step += 1
        self.by_stage[exc.stage] = self.by_stage.get(exc.stage, 0) + 1
        if self.in_row >= self.max_in_row:
            raise exc.with_note(f"the run diverged: {self.in_row} non-finite skips in a row "
                                f"(trainer.max_nan_skips={self.max_in_row})")

    def step_done(self) -> None:
        """A step ended: one without any skip breaks the run of skips."""
        if self._this_step == 0:
            self.in_row = 0
        self._this_step = 0

    def metrics(self) -> dict[str, float]:
        """``actor/nan_skipped`` and ``nan/<stage>`` (cumulative counts)."""
        out = {"actor/nan_skipped": float(self.skipped)}
        out.update({f"nan/{s}": float(self.by_stage.get(s, 0)) for s in SKIPPABLE})
        return out

    def state_dict(self) -> dict:
        return {"skipped": self.skipped, "in_row": self.in_row, "by_stage": dict(self.by_stage)}

    def load_state_dict(self, state: dict) -> None:
        self.skipped = int(state.get("skipped", 0))
        self.in_row = int(state.get("in_row", 0))
        self.by_stage = {s: int(state.get("by_stage", {}).get(s, 0)) for s in STAGES}
        self._this_step = 0
