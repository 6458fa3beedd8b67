"""The update's cut of a consumed batch into mini- and micro-batches (``trainer.updates_per_step``,
``trainer.grad_accum``, ``trainer.micro_batch_tokens``, ``trainer.length_buckets``).  The passes without gradient
over a whole batch (old-logp, reference, proximal) run on the same pieces, so on-policy their log-probs equal the
update forward's bit for bit.  With length buckets a mini-batch of uneven lengths is cut into runs of rows of like
width instead of contiguous rows (:mod:`.length_buckets`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from offpolicy_moe.logprobs.length_buckets import bucket_cut, cut_cost_floor, pieces_cost, row_widths
from offpolicy_moe.models.forward_plan import MARGIN, ForwardCostModel

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
               process_max: Optional[Callable[[int], int]] = None, widths: Optional[torch.Tensor] = None,
               cost: Optional[ForwardCostModel] = None) -> list[list[torch.Tensor]]:
    """The row indices of the update's micro-batches, per mini-batch: ``rows`` split into ``updates_per_step``
    contiguous mini-batches (``tensor_split``), each into :func:`micro_batch_count` contiguous micro-batches (empty
    parts dropped).  The policy update trains on these pieces and the no-grad passes over a whole batch (old-logp,
    reference, proximal) run on the same ones, so on-policy their log-probs are those of the update's forward bit
    for bit, and no forward holds more than ``max_tokens`` padded positions (a row longer than that alone).
    ``process_max``: each count replaced by ``process_max(count)`` (the largest over the processes), never more
    than the mini-batch's rows.

    ``widths`` (``[rows]``, :func:`~.length_buckets.row_widths`) and ``cost`` (one process only): a mini-batch is
    cut instead into the runs of like width of :func:`~.length_buckets.bucket_cut` (at least ``grad_accum`` of
    them, none over ``max_tokens`` padded positions at its own width) when their estimated cost is at most
    :data:`~offpolicy_moe.models.forward_plan.MARGIN` times the contiguous cut's."""
    if cost is not None and process_max is not None:
        raise ValueError("update_cut: length buckets are cut in one process only (several processes must agree "
                         "on their micro-batch counts)")
    cut = []
    for mini in torch.arange(int(rows)).tensor_split(max(1, int(updates_per_step))):
        n = micro_batch_count(int(mini.numel()), seq_len, grad_accum, max_tokens)
        if process_max is not None:
            n = max(1, min(int(process_max(n)), int(mini.numel())))
        pieces = [m for m in mini.tensor_split(n) if m.numel() > 0]
        if cost is not None and widths is not None and mini.numel() > 1:
            pieces = _bucketed(mini, pieces, widths, grad_accum, max_tokens, cost)
        cut.append(pieces)
    return cut


def _bucketed(mini: torch.Tensor, contiguous: list[torch.Tensor], widths: torch.Tensor, grad_accum: int,
              max_tokens: Optional[int], cost: ForwardCostModel) -> list[torch.Tensor]:
    """The length-bucketed cut of mini-batch ``mini`` when it is estimated at most ``MARGIN`` x ``contiguous``'s
    cost (both trimmed per piece), else ``contiguous``."""
    w = torch.as_tensor(widths, dtype=torch.long).cpu()
    if w.dim() != 1 or w.numel() <= int(mini.max()):
        raise ValueError(f"update_cut: {w.numel()} row widths for rows up to {int(mini.max())}")
    local = w.index_select(0, mini)
    base = pieces_cost(w, contiguous, cost)
    if cut_cost_floor(local, grad_accum, cost) > MARGIN * base:     # no cut can pay: skip the search
        return contiguous
    buckets = bucket_cut(local, grad_accum, max_tokens, cost)
    if buckets is None:
        return contiguous
    if pieces_cost(local, buckets, cost) > MARGIN * base:
        return contiguous
    return [mini.index_select(0, b) for b in buckets]


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
    parameters in each: unequal counts would hang), whatever its rows and padded length.

    ``cost`` (``trainer.length_buckets``, one process): a mini-batch of uneven lengths is cut into runs of rows of
    like width when that is estimated cheaper (:mod:`.length_buckets`); :meth:`batch_cut` and
    :meth:`batch_pieces` read the widths from a batch's attention mask."""

    updates_per_step: int = 1
    grad_accum: int = 1
    max_tokens: Optional[int] = None
    process_max: Optional[Callable[[int], int]] = field(default=None, compare=False, repr=False)
    cost: Optional[ForwardCostModel] = None     # length buckets (one process): the forward's cost weights

    @classmethod
    def from_trainer(cls, tr: Any, process_max: Optional[Callable[[int], int]] = None,
                     model_config: Any = None) -> "MicroBatching":
        """From the ``trainer`` config section; length buckets (``trainer.length_buckets``) in one process, with
        the cost weights of ``model_config`` (a transformers config)."""
        buckets = (bool(getattr(tr, "length_buckets", False)) and process_max is None
                   and getattr(model_config, "hidden_size", None) is not None)
        return cls(int(tr.updates_per_step), int(tr.grad_accum), tr.micro_batch_tokens, process_max,
                   ForwardCostModel.from_config(model_config) if buckets else None)

    def __post_init__(self) -> None:
        if self.updates_per_step < 1 or self.grad_accum < 1 or (self.max_tokens is not None and self.max_tokens < 1):
            raise ValueError(f"MicroBatching needs updates_per_step >= 1, grad_accum >= 1 and max_tokens >= 1 or "
                             f"None, got {self.updates_per_step}, {self.grad_accum}, {self.max_tokens}")
        if self.cost is not None and self.process_max is not None:
            raise ValueError("MicroBatching: length buckets (cost) are cut in one process only, not with "
                             "process_max")

    def cut(self, rows: int, seq_len: int, widths: Optional[torch.Tensor] = None) -> list[list[torch.Tensor]]:
        """:func:`update_cut` of ``rows`` sequences of ``seq_len`` positions (counts agreed over processes; with
        ``widths`` and a ``cost``, length buckets)."""
        return update_cut(rows, seq_len, self.updates_per_step, self.grad_accum, self.max_tokens, self.process_max,
                          widths, self.cost)

    def pieces(self, rows: int, seq_len: int, widths: Optional[torch.Tensor] = None) -> list[torch.Tensor]:
        """Every micro-batch of :meth:`cut`, mini-batch by mini-batch."""
        return [m for mini in self.cut(rows, seq_len, widths) for m in mini]

    def batch_cut(self, attention_mask: torch.Tensor) -> list[list[torch.Tensor]]:
        """:meth:`cut` of a batch with this ``[B, S]`` attention mask (its rows' widths when bucketing)."""
        rows, seq_len = attention_mask.shape
        return self.cut(int(rows), int(seq_len), row_widths(attention_mask) if self.cost is not None else None)

    def batch_pieces(self, attention_mask: torch.Tensor) -> list[torch.Tensor]:
        """Every micro-batch of :meth:`batch_cut`, mini-batch by mini-batch."""
        return [m for mini in self.batch_cut(attention_mask) for m in mini]
