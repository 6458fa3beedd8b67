"""The update's cut of a consumed batch into mini- and micro-batches (``trainer.updates_per_step``,
``trainer.grad_accum``, ``trainer.micro_batch_tokens``).  The passes without gradient over a whole batch (old-logp,
reference, proximal) run on the same pieces, so on-policy their log-probs equal the update forward's bit for bit."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

__all__ = ["MicroBatching", "max_over_processes", "micro_batch_count", "update_cut"]


def micro_batch_count(rows: int, seq_len: int, grad_accum: int, max_tokens: Optional[int]) -> int:
    """Micro-batches a mini-batch of ``rows`` sequences padded to ``seq_len`` positions is cut into: at least
    ``grad_accum`` (``trainer.grad_accum``), more when one would hold more than ``max_tokens`` padded positions
    (``trainer.micro_batch_tokens``; None: no cap): ``max(grad_accum, ceil(rows * seq_len / max_tokens))``, never more
    than ``rows``.  A function of the shape only, so a rerun or a resume cuts the same way."""
    n = int(grad_accum)
    if max_tokens is not None and rows * seq_len > max_tokens:
        n = max(n, -(-rows * seq_len // int(max_tokens)))
    return max(1, min(n, rows))


def update_cut(rows: int, seq_len: int, updates_per_step: int, grad_accum: int, max_tokens: Optional[int],
               process_max: Optional[Callable[[int], int]] = None) -> list[list[torch.Tensor]]:
    """The row indices of the update's micro-batches, per mini-batch: ``rows`` split into ``updates_per_step``
    contiguous mini-batches (``tensor_split``), each into :func:`micro_batch_count` contiguous micro-batches (empty
    parts dropped).  The policy update trains on these pieces and the no-grad passes over a whole batch (old-logp,
    reference, proximal) run on the same ones, so on-policy their log-probs are those of the update's forward bit
    for bit, and no forward holds more than ``max_tokens`` padded positions (a row longer than that alone).
    ``process_max``: each count replaced by ``process_max(count)`` (the largest over the processes), never more
    than the mini-batch's rows."""
    cut = []
    for mini in torch.arange(int(rows)).tensor_split(max(1, int(updates_per_step))):
        n = micro_batch_count(int(mini.numel()), seq_len, grad_accum, max_tokens)
        if process_max is not None:
            n = max(1, min(int(process_max(n)), int(mini.numel())))
        cut.append([m for m in mini.tensor_split(n) if m.numel() > 0])
    return cut


def max_over_processes(device: torch.device) -> Callable[[int], int]:
    """``n -> max of n over the processes of the default process group`` (one all-reduce per call, which every
    process must make)."""
    def reduce_max(n: int) -> int:
        t = torch.tensor([int(n)], dtype=torch.long, device=device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return int(t.item())
    return reduce_max


@dataclass(frozen=True)
class MicroBatching:
    """How a consumed batch is cut (``trainer.updates_per_step``, ``trainer.grad_accum``,
    ``trainer.micro_batch_tokens``): :meth:`cut` gives the update's pieces per mini-batch, :meth:`pieces` the same
    pieces in one list (what a no-grad pass over the whole batch runs on).

    ``process_max`` (several processes: :func:`max_over_processes`): each mini-batch's micro-batch count is the
    largest over the processes, so every process runs the same number of forwards (a sharded model gathers its
    parameters in each: unequal counts would hang), whatever its rows and padded length."""

    updates_per_step: int = 1
    grad_accum: int = 1
    max_tokens: Optional[int] = None
    process_max: Optional[Callable[[int], int]] = field(default=None, compare=False, repr=False)

    @classmethod
    def from_trainer(cls, tr: Any, process_max: Optional[Callable[[int], int]] = None) -> "MicroBatching":
        """From the ``trainer`` config section."""
        return cls(int(tr.updates_per_step), int(tr.grad_accum), tr.micro_batch_tokens,
                   process_max)

    def __post_init__(self) -> None:
        if self.updates_per_step < 1 or self.grad_accum < 1 or (self.max_tokens is not None and self.max_tokens < 1):
            raise ValueError(f"MicroBatching needs updates_per_step >= 1, grad_accum >= 1 and max_tokens >= 1 or "
                             f"None, got {self.updates_per_step}, {self.grad_accum}, {self.max_tokens}")

    def cut(self, rows: int, seq_len: int) -> list[list[torch.Tensor]]:
        """:func:`update_cut` of ``rows`` sequences of ``seq_len`` positions (counts agreed over processes)."""
        return update_cut(rows, seq_len, self.updates_per_step, self.grad_accum, self.max_tokens, self.process_max)

    def pieces(self, rows: int, seq_len: int) -> list[torch.Tensor]:
        """Every micro-batch of :meth:`cut`, in row order."""
        return [m for mini in self.cut(rows, seq_len) for m in mini]
