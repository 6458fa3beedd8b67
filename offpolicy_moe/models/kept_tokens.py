"""The kept set of each sampled token: the token ids a truncated sampling distribution (top-k, top-p) could draw.

Nucleus sampling (top-p, Holtzman et al. 2019, arXiv 1904.09751) and top-k sampling draw token ``t`` from the
softmax of the scores restricted to a kept set ``K_t``: ``mu(x | K_t) = exp(s_x) / sum_{j in K_t} exp(s_j)``.
:class:`KeptTokens` carries ``K_t`` from the engine to the trainer, which takes
``log pi(x | K_t) = z_x / tau - logsumexp_{j in K_t}(z_j / tau)`` with its own logits ``z``
(:func:`offpolicy_moe.models.token_logprobs.token_logprobs`, ``kept=``).  The kept set is the ENGINE's, replayed
as routing replay replays expert ids: re-running top-p on the trainer's own logits would keep another set.

Storage is ragged, never ``V`` floats per token: ``counts [B, T]`` (``|K_t|``; 0 = no kept set recorded, the whole
vocabulary) and ``ids``, one segment per position in row-major ``(b, t)`` order.  A segment is the position's kept
ids, ascending, when there are at most ``W`` of them, else a bitmask of the vocabulary in ``W`` little-endian words
(bit ``j % 8`` of the segment's byte ``j // 8`` set when token ``j`` is kept), ``W = ceil(V / w)`` for words of
``w`` bits.  Words and counts are int16 when the vocabulary has at most 32767 tokens, else int32, so a sampled
token costs ``h + h * min(|K_t|, W)`` bytes with ``h = 2`` or ``4``: at most ``V / 8 + 8`` bytes (18,996 for a
151,936-token vocabulary), and ``4 + 4|K_t|`` for the small kept sets of a peaked distribution.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import sys

import torch

__all__ = ["KeptTokens", "index_dtype", "step_support", "segment_words"]


def index_dtype(vocab_size: int) -> torch.dtype:
    """The integer dtype of kept ids and counts for a vocabulary of ``vocab_size`` tokens: int16 up to 32767
    tokens, int32 above."""
    return torch.int16 if vocab_size <= torch.iinfo(torch.int16).max else torch.int32


def segment_words(vocab_size: int) -> int:
    """``W``: the words of a bitmask segment, ``ceil(V / w)`` with ``w`` the bits of :func:`index_dtype`; a kept set
    of more than ``W`` ids is stored as the bitmask."""
    bits = torch.iinfo(index_dtype(vocab_size)).bits
    return -(-int(vocab_size) // bits)


def _encode(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(counts [M], words)`` of a boolean ``[M, V]`` mask: each row's segment, its ids or its bitmask (module
    docstring), in row order."""
    M, V = mask.shape
    dtype = index_dtype(V)
    bits, W = torch.iinfo(dtype).bits, segment_words(V)
    counts = mask.sum(-1)
    dense = counts > W
    seg = torch.where(dense, torch.full_like(counts, W), counts)
    starts = torch.cumsum(seg, 0) - seg
    out = torch.zeros(int(seg.sum()), dtype=dtype, device=mask.device)
    sparse = mask & ~dense.unsqueeze(1)
    rows, cols = sparse.nonzero().unbind(1)          # row-major: each row's ids in a run, ascending
    if rows.numel():
        sc = torch.where(dense, torch.zeros_like(counts), counts)
        rank = torch.arange(rows.numel(), device=mask.device) - (torch.cumsum(sc, 0) - sc)[rows]
        out[starts[rows] + rank] = cols.to(dtype)
    drows = dense.nonzero().flatten()
    if drows.numel():
        _little_endian()
        m = torch.nn.functional.pad(mask[drows], (0, W * bits - V)).view(-1, W * bits // 8, 8).to(torch.uint8)
        packed = (m << torch.arange(8, dtype=torch.uint8, device=mask.device)).sum(-1, dtype=torch.uint8)
        words = packed.view(dtype)                       # [Md, W]: the bytes read as little-endian words
        out[(starts[drows].unsqueeze(1) + torch.arange(W, device=mask.device)).flatten()] = words.flatten()
    return counts.to(dtype), out


def _little_endian() -> None:
    """Bitmask segments are bytes read as little-endian words; refuse (one line) to pack or unpack them elsewhere."""
    if sys.byteorder != "little":
        raise RuntimeError("KeptTokens bitmask segments need a little-endian machine")


def step_support(scores: torch.Tensor, rows: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(counts [B], words)`` of one sampling step: the finite entries of the processed scores ``[B, V]`` (what
    top-k / top-p left; the rest were set to ``-inf``), for the rows where ``rows [B]`` (bool) is true (the other
    rows get count 0), as the segments of :class:`KeptTokens` in row order."""
    if scores.dim() != 2:
        raise ValueError(f"step_support: scores must be [B, V], got {tuple(scores.shape)}")
    live = torch.isfinite(scores)
    if rows is not None:
        live &= rows.to(torch.bool).unsqueeze(1)
    return _encode(live)


def _segment_index(starts: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Indices ``starts[m] + 0 .. starts[m] + counts[m] - 1`` for every ``m``, concatenated (int64)."""
    counts = counts.long()
    total = int(counts.sum())
    if total == 0:
        return torch.zeros(0, dtype=torch.long, device=counts.device)
    offsets = torch.cumsum(counts, 0) - counts
    base = torch.repeat_interleave(starts.long() - offsets, counts, output_size=total)
    return base + torch.arange(total, device=counts.device)


@dataclass
class KeptTokens:
    """Kept sets of a ``[B, T]`` grid of sampled tokens (see the module docstring): ``counts [B, T]``, ``ids`` (the
    segments: ids or bitmask words) and the vocabulary size ``V``.  Refuses (``ValueError``) counts that are not
    ``[B, T]`` non-negative integers up to ``V``, segments of another total length, ids outside ``[0, V)``."""

    counts: torch.Tensor
    ids: torch.Tensor
    vocab_size: int

    def __post_init__(self) -> None:
        c, i, V = self.counts, self.ids, int(self.vocab_size)
        if V < 1:
            raise ValueError(f"KeptTokens: vocab_size must be >= 1, got {V}")
        if c.dim() != 2 or c.is_floating_point() or c.dtype == torch.bool:
            raise ValueError(f"KeptTokens: counts must be integer [B, T], got {c.dtype} {tuple(c.shape)}")
        if i.dim() != 1 or i.is_floating_point() or i.dtype == torch.bool:
            raise ValueError(f"KeptTokens: ids must be a 1-D integer tensor, got {i.dtype} {tuple(i.shape)}")
        self.vocab_size = V
        if c.numel():
            lo, hi = torch.stack([c.min().long(), c.max().long()]).tolist()
            if lo < 0 or hi > V:
                raise ValueError(f"KeptTokens: counts must be in [0, {V}], got {lo} to {hi}")
        seg = self._seg()
        total = int(seg.sum())
        if i.numel() != total:
            raise ValueError(f"KeptTokens: {i.numel()} ids for segments of {total} words (counts {tuple(c.shape)})")
        if total:
            sparse = torch.repeat_interleave(c.flatten().long() <= self.words, seg, output_size=total)
            ids = i[sparse.to(i.device)]
            if ids.numel():
                lo, hi = torch.stack([ids.min().long(), ids.max().long()]).tolist()
                if lo < 0 or hi >= V:
                    raise ValueError(f"KeptTokens: ids must be in [0, {V}), got {lo} to {hi}")

    # ------------------------------------------------------------------ building
    @classmethod
    def from_steps(cls, step_counts: Sequence[torch.Tensor], step_ids: Sequence[torch.Tensor],
                   vocab_size: int) -> "KeptTokens":
        """The ``[B, T]`` kept sets of ``T`` sampling steps, step ``t`` given by :func:`step_support`
        ``(counts [B], ids)``."""
        if len(step_counts) != len(step_ids):
            raise ValueError(f"KeptTokens.from_steps: {len(step_counts)} count steps, {len(step_ids)} id steps")
        dtype = index_dtype(vocab_size)
        if not step_counts:
            return cls(torch.zeros(0, 0, dtype=dtype), torch.zeros(0, dtype=dtype), vocab_size)
        counts_tb = torch.stack([c.to(dtype) for c in step_counts], 0)          # [T, B], steps in order
        ids_tb = torch.cat([i.to(dtype) for i in step_ids])
        seg_tb = counts_tb.long().clamp(max=segment_words(vocab_size))
        starts_tb = (torch.cumsum(seg_tb.flatten(), 0) - seg_tb.flatten()).view_as(seg_tb)
        ids = ids_tb[_segment_index(starts_tb.t().flatten(), seg_tb.t().flatten())]
        return cls(counts_tb.t().contiguous(), ids, vocab_size)

    @classmethod
    def from_mask(cls, mask: torch.Tensor) -> "KeptTokens":
        """The kept sets of a boolean mask ``[B, T, V]`` (True: kept; an all-False position gets count 0)."""
        if mask.dim() != 3 or mask.dtype != torch.bool:
            raise ValueError(f"KeptTokens.from_mask: mask must be bool [B, T, V], got {mask.dtype} "
                             f"{tuple(mask.shape)}")
        B, T, V = mask.shape
        counts, ids = _encode(mask.reshape(B * T, V))
        return cls(counts.view(B, T), ids, V)

    # ------------------------------------------------------------------ shape
    @property
    def shape(self) -> tuple[int, int]:
        return int(self.counts.shape[0]), int(self.counts.shape[1])

    @property
    def words(self) -> int:
        """``W``, the words of a bitmask segment (:func:`segment_words`)."""
        return segment_words(self.vocab_size)

    @property
    def nbytes(self) -> int:
        """Bytes held (counts and ids)."""
        return self.counts.numel() * self.counts.element_size() + self.ids.numel() * self.ids.element_size()

    def to(self, device: torch.device | str) -> "KeptTokens":
        """The same kept sets on ``device``."""
        return KeptTokens(self.counts.to(device), self.ids.to(device), self.vocab_size)

    # ------------------------------------------------------------------ re-layout
    def _seg(self) -> torch.Tensor:
        """Words of each position's segment, ``min(count, W)``, flat (int64)."""
        return self.counts.flatten().long().clamp(max=self.words)

    def _starts(self) -> torch.Tensor:
        seg = self._seg()
        return torch.cumsum(seg, 0) - seg

    def relayout(self, positions: torch.Tensor) -> "KeptTokens":
        """Kept sets on a new grid: ``positions [B', T']`` (int) holds, for each new position, the flat index
        ``b * T + t`` of the old position whose set it takes, or ``-1`` for none (count 0)."""
        if positions.dim() != 2:
            raise ValueError(f"KeptTokens.relayout: positions must be [B', T'], got {tuple(positions.shape)}")
        pos = positions.to(self.counts.device).long().flatten()
        n = self.counts.numel()
        if pos.numel() and int(pos.max()) >= n:
            raise ValueError(f"KeptTokens.relayout: position {int(pos.max())} is outside the {self.shape} grid")
        valid = pos >= 0
        safe = pos.clamp(min=0)
        flat = self.counts.flatten()
        if n == 0:
            counts = torch.zeros(pos.shape, dtype=flat.dtype, device=flat.device)
            starts = torch.zeros(pos.shape, dtype=torch.long, device=flat.device)
        else:
            counts = torch.where(valid, flat[safe], torch.zeros_like(flat[safe]))
            starts = self._starts()[safe]
        seg = counts.long().clamp(max=self.words)
        ids = self.ids[_segment_index(starts, seg).to(self.ids.device)]
        return KeptTokens(counts.view(positions.shape), ids, self.vocab_size)

    def _grid(self) -> torch.Tensor:
        B, T = self.shape
        return torch.arange(B * T, device=self.counts.device).view(B, T)

    def index_select(self, idx: torch.Tensor) -> "KeptTokens":
        """Rows ``idx`` (a RolloutBatch row selection)."""
        return self.relayout(self._grid().index_select(0, torch.as_tensor(idx, dtype=torch.long,
                                                                          device=self.counts.device)))

    def narrow(self, start: int, stop: int) -> "KeptTokens":
        """Columns (sampled positions) ``start .. stop - 1``."""
        return self.relayout(self._grid()[:, start:stop])

    def masked(self, mask: torch.Tensor) -> "KeptTokens":
        """The kept sets where ``mask [B, T]`` is true, count 0 elsewhere."""
        grid = self._grid()
        return self.relayout(torch.where(mask.to(grid.device).bool(), grid, torch.full_like(grid, -1)))

    def pad_to(self, length: int) -> "KeptTokens":
        """Right-padded to ``length`` columns with count 0 (the ids keep their order)."""
        B, T = self.shape
        if length < T:
            raise ValueError(f"KeptTokens.pad_to: {length} columns is fewer than the {T} held")
        counts = torch.nn.functional.pad(self.counts, (0, length - T))
        return KeptTokens(counts, self.ids, self.vocab_size)

    @classmethod
    def cat(cls, parts: Sequence["KeptTokens"]) -> "KeptTokens":
        """Rows of ``parts`` one after the other (same number of columns and vocabulary)."""
        if not parts:
            raise ValueError("KeptTokens.cat: nothing to concatenate")
        if len({p.shape[1] for p in parts}) != 1 or len({p.vocab_size for p in parts}) != 1:
            raise ValueError(f"KeptTokens.cat: parts differ in columns or vocabulary: "
                             f"{[(p.shape, p.vocab_size) for p in parts]}")
        return cls(torch.cat([p.counts for p in parts], 0), torch.cat([p.ids for p in parts]), parts[0].vocab_size)

    # ------------------------------------------------------------------ reading
    def dense(self, rows: slice = slice(None), cols: slice = slice(None)) -> torch.Tensor:
        """Boolean ``[b, t, V]`` mask of positions ``[rows, cols]`` (True: kept); a position of count 0 is all True
        (no kept set: the whole vocabulary).  ``rows`` / ``cols`` are unit-step slices."""
        return self._fill(rows, cols, torch.tensor([False, True]))

    def indicator(self, rows: slice, cols: slice, dtype: torch.dtype) -> torch.Tensor:
        """``[b, t, V]`` 1 on the kept tokens of positions ``[rows, cols]`` (every token of a position of count 0),
        0 elsewhere, in ``dtype``: what the log-prob head multiplies its exponentials by."""
        return self._fill(rows, cols, torch.tensor([0.0, 1.0], dtype=dtype))

    def _fill(self, rows: slice, cols: slice, values: torch.Tensor) -> torch.Tensor:
        """``[b, t, V]`` tensor holding ``values[1]`` on kept tokens (every token of a position of count 0) and
        ``values[0]`` elsewhere; bitmask segments are expanded by a 256-entry table of their bytes (one gather)."""
        grid = self._grid()[rows, cols]
        sub = self.relayout(grid)
        c, seg = sub.counts.flatten().long(), sub._seg()
        M, V, W = c.numel(), self.vocab_size, self.words
        dev = c.device
        off, on = values.to(dev).unbind()
        words = sub.ids.long().to(dev)
        owner = torch.repeat_interleave(torch.arange(M, device=dev), seg, output_size=words.numel())
        sparse = (c <= W)[owner]
        dense = (c > W).nonzero().flatten()
        table_rows = None
        if dense.numel():
            _little_endian()
            raw = sub.ids.to(dev)[~sparse].view(torch.uint8)                      # the bitmask bytes, in order
            bits = (torch.arange(256, device=dev).unsqueeze(1) >> torch.arange(8, device=dev)) & 1
            table = torch.where(bits.bool(), on, off)                               # [256, 8]: a byte's 8 values
            table_rows = table.index_select(0, raw.long()).view(dense.numel(), -1)  # [n_dense, 8 * bytes >= V]
        if dense.numel() == M:          # every position a bitmask (a flat distribution): no other pass
            return table_rows[:, :V].view(*grid.shape, V)
        out = off.expand(M, V).clone()
        out[owner[sparse], words[sparse]] = on
        if table_rows is not None:
            out[dense] = table_rows[:, :V]
        out[c == 0] = on
        return out.view(*grid.shape, V)

    def contains(self, targets: torch.Tensor) -> torch.Tensor:
        """``[B, T]`` bool: ``targets[b, t]`` is in its kept set (True where the count is 0)."""
        if tuple(targets.shape) != self.shape:
            raise ValueError(f"KeptTokens.contains: targets {tuple(targets.shape)} != kept sets {self.shape}")
        c, seg = self.counts.flatten().long(), self._seg()
        x = targets.to(c.device).flatten().long()
        words = self.ids.long().to(c.device)
        owner = torch.repeat_interleave(torch.arange(c.numel(), device=c.device), seg, output_size=words.numel())
        sparse = c <= self.words
        hit = ((words == x[owner]) & sparse[owner]).long()
        found = torch.zeros(c.numel(), dtype=torch.long, device=c.device).index_add_(0, owner, hit) > 0
        h = self.ids.element_size()
        dense = (~sparse).nonzero().flatten()
        if dense.numel():      # bit x % 8 of byte x // 8 of the position's bitmask
            _little_endian()
            raw = self.ids.to(c.device).view(torch.uint8)
            byte = raw[self._starts()[dense] * h + x[dense] // 8].long()
            found[dense] = ((byte >> (x[dense] % 8)) & 1).bool()
        return (found | (c == 0)).view(self.shape)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """Plain tensors and an int (``torch.load(weights_only=True)``-safe); inverse of :meth:`from_state_dict`."""
        return {"counts": self.counts, "ids": self.ids, "vocab_size": int(self.vocab_size)}

    @classmethod
    def from_state_dict(cls, state: dict) -> "KeptTokens":
        """Inverse of :meth:`state_dict`."""
        return cls(state["counts"], state["ids"], int(state["vocab_size"]))
