"""Micro-batches of rows of like length: a long-tailed batch cut so that short rows are not padded to the longest.

Rows are right-padded to the batch's longest response, so one forward over a batch with a long tail feeds mostly
padding: 128 rows of mean length 26 padded to 234 positions feed 9x the real tokens, and attention costs the square
of that.  Each micro-batch's forward runs on its own rows trimmed to their own longest width
(:meth:`~offpolicy_moe.logprobs.forward.RoutedForward.logp`), so grouping rows of like width into micro-batches
removes the waste: the rows are sorted by width and cut into consecutive runs, the cut that minimises the estimated
cost of its forwards,

    cost(cut) = sum over pieces of  n L + w n L^2  +  o (pieces - 1)

(``n`` rows of width ``L``, ``w`` the cost of one attention entry and ``o`` one forward's fixed cost, both in units
of one token's forward + backward: :class:`~offpolicy_moe.models.forward_plan.ForwardCostModel`), found exactly by
dynamic programming over the sorted rows (over runs of equal width above :data:`EXACT_ROWS` rows: a run is cut only
where the cap on padded positions makes it).  The cut is taken only when its estimate is at most ``margin`` times
the contiguous cut's (each of its pieces trimmed too); otherwise the contiguous cut stands, so a batch of even
lengths (every short job) runs exactly as before.  It depends on the widths only: a rerun or a resume cuts the same
way.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from offpolicy_moe.models.forward_plan import ForwardCostModel

__all__ = ["MAX_PIECES", "row_widths", "pieces_cost", "cut_cost_floor", "bucket_cut"]

#: the most micro-batches a bucketed cut makes of one mini-batch
MAX_PIECES = 16
#: up to this many rows the search is over every cut of the sorted rows; above, over runs of equal width
EXACT_ROWS = 1024


def row_widths(attention_mask: torch.Tensor) -> torch.Tensor:
    """Each row's width ``[B]``: the position of its last real token + 1 (0 for a row without one), the columns a
    forward over it alone needs (prompts are left-padded, responses right-padded)."""
    if attention_mask.dim() != 2:
        raise ValueError(f"row_widths needs a [B, S] attention mask, got shape {tuple(attention_mask.shape)}")
    real = attention_mask.to(torch.bool)
    cols = torch.arange(1, real.shape[1] + 1, device=real.device).expand_as(real)
    return torch.where(real, cols, torch.zeros_like(cols)).amax(1).cpu()


def pieces_cost(widths: torch.Tensor, pieces: Sequence[torch.Tensor], cost: ForwardCostModel) -> float:
    """The estimated cost of forwards over ``pieces`` (row indices into ``widths``), each trimmed to its own widest
    row: ``sum n L + w n L^2 + o (pieces - 1)``."""
    total = 0.0
    for rows in pieces:
        n, length = int(rows.numel()), int(widths.index_select(0, rows).max()) if rows.numel() else 0
        total += n * length + cost.entry_weight * n * length * length
    return total + cost.pass_overhead * max(len(pieces) - 1, 0)


def cut_cost_floor(widths: torch.Tensor, min_pieces: int, cost: ForwardCostModel) -> float:
    """A lower bound of :func:`pieces_cost` for any cut of rows with ``widths`` into at least ``min_pieces`` pieces:
    every row at its own width, ``sum_i (L_i + w L_i^2) + o (max(min_pieces, 1) - 1)`` (a piece costs at least its
    rows' own costs, since each is padded to the piece's widest).  Where even this floor is above the margin times
    the contiguous cut's cost, no cut can be taken and the search is skipped (a few ms a pass on 128 rows)."""
    w = torch.as_tensor(widths, dtype=torch.float64)
    return float((w + cost.entry_weight * w * w).sum()) + cost.pass_overhead * (max(int(min_pieces), 1) - 1)


def _units(widths: torch.Tensor, max_tokens: Optional[int]) -> tuple[list[torch.Tensor], list[int]]:
    """The atoms a bucketed cut is made of, ascending by width, and their widths: each row (up to
    :data:`EXACT_ROWS` rows), else the runs of equal width (rows in index order) cut into parts of at most
    ``max_tokens // width`` rows (at least 1)."""
    order = torch.sort(widths, stable=True).indices
    if widths.numel() <= EXACT_ROWS:
        return list(order.split(1)), widths.index_select(0, order).tolist()
    units, unit_widths = [], []
    for value in torch.unique_consecutive(widths.index_select(0, order)).tolist():
        rows = order[widths.index_select(0, order) == value]
        step = max(1, int(max_tokens) // max(int(value), 1)) if max_tokens is not None else rows.numel()
        for part in rows.split(max(step, 1)):
            units.append(part)
            unit_widths.append(int(value))
    return units, unit_widths


def _segment_costs(units: list[torch.Tensor], unit_widths: list[int], max_tokens: Optional[int],
                   cost: ForwardCostModel) -> torch.Tensor:
    """``seg[i, j]``: the cost of one piece made of units ``i .. j - 1`` (inf where ``j <= i`` or the piece holds
    more than ``max_tokens`` padded positions with more than one row), float64 ``[U + 1, U + 1]``."""
    u = len(units)
    counts = torch.tensor([0] + [int(x.numel()) for x in units], dtype=torch.float64).cumsum(0)
    width = torch.tensor([0] + unit_widths, dtype=torch.float64)
    n = counts[None, :] - counts[:, None]                  # rows of units i .. j - 1
    length = width[None, :].expand(u + 1, u + 1)           # their widest: unit j - 1's width (ascending)
    seg = n * length + cost.entry_weight * n * length * length
    idx = torch.arange(u + 1)
    bad = idx[None, :] <= idx[:, None]
    if max_tokens is not None:
        bad |= (n * length > max_tokens) & (n > 1)
    return seg.masked_fill(bad, float("inf"))


def bucket_cut(widths: torch.Tensor, min_pieces: int, max_tokens: Optional[int], cost: ForwardCostModel
               ) -> Optional[list[torch.Tensor]]:
    """The cheapest cut of rows with ``widths`` into between ``min_pieces`` and :data:`MAX_PIECES` pieces of
    consecutive widths (module docstring), each piece's row indices ascending; ``None`` when none is feasible
    (more pieces needed than rows or than :data:`MAX_PIECES`)."""
    widths = torch.as_tensor(widths, dtype=torch.long).cpu()
    if widths.dim() != 1 or widths.numel() == 0:
        raise ValueError(f"bucket_cut needs a non-empty [B] tensor of row widths, got shape {tuple(widths.shape)}")
    units, unit_widths = _units(widths, max_tokens)
    seg = _segment_costs(units, unit_widths, max_tokens, cost)
    u = len(units)
    best = torch.full((u + 1,), float("inf"), dtype=torch.float64)
    best[0] = 0.0
    choices: list[tuple[float, list[int]]] = []
    back: list[torch.Tensor] = []
    for m in range(1, min(MAX_PIECES, u) + 1):
        total = best[:, None] + seg                        # the last piece: units i .. j - 1
        best, arg = total.min(0)
        back.append(arg)
        if m >= min_pieces and torch.isfinite(best[u]):
            choices.append((float(best[u]) + cost.pass_overhead * (m - 1), [m]))
    if not choices:
        return None
    _, (m,) = min(choices, key=lambda c: c[0])
    ends, j = [], u
    for level in range(m - 1, -1, -1):                      # walk the choices back from the last piece
        i = int(back[level][j])
        ends.append((i, j))
        j = i
    return [torch.sort(torch.cat(units[i:j])).values for i, j in reversed(ends)]
