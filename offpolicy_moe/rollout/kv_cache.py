"""A decode KV cache whose full-attention layers write into buffers allocated once for the whole generation.

transformers' ``DynamicLayer`` appends each token with ``torch.cat``, copying the whole cache at every decode step
(``O(T^2)`` bytes over ``T`` new tokens; about half of the CPU sampling loop's time at 128-256 new tokens,
docs/benchmarks.md, "Decode").  :class:`PreallocatedLayer` writes each step into ``[B, H, capacity, D]`` buffers and
hands attention a view of the filled part (the same tensor values, so the same result).  The capacity is the prompt
length plus the response budget; a longer run grows the buffer by doubling.
"""
from __future__ import annotations

from typing import Callable

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

__all__ = ["PreallocatedLayer", "preallocated_cache"]


class PreallocatedLayer(DynamicLayer):
    """A ``DynamicLayer`` that stores keys/values in pre-allocated ``[B, H, capacity, D]`` buffers; ``keys`` and
    ``values`` are views of the filled ``[:, :, :length]`` part (row selection and repetition copy the filled
    columns into new buffers of the same capacity)."""

    def __init__(self, capacity: int):
        super().__init__()
        if capacity < 1:
            raise ValueError(f"PreallocatedLayer capacity must be >= 1, got {capacity}")
        self.capacity = int(capacity)
        self._kbuf = self._vbuf = None
        self._len = 0

    def _ensure(self, like: torch.Tensor, need: int) -> None:
        if self._kbuf is not None and need <= self._kbuf.shape[-2]:
            return
        cap = max(self.capacity, need) if self._kbuf is None else max(2 * self._kbuf.shape[-2], need)
        shape = (like.shape[0], like.shape[1], cap, like.shape[-1])
        kbuf, vbuf = like.new_empty(shape), like.new_empty(shape)
        if self._kbuf is not None and self._len:
            kbuf[:, :, :self._len] = self._kbuf[:, :, :self._len]
            vbuf[:, :, :self._len] = self._vbuf[:, :, :self._len]
        self._kbuf, self._vbuf = kbuf, vbuf

    def _expose(self) -> None:
        self.keys = self._kbuf[:, :, :self._len]
        self.values = self._vbuf[:, :, :self._len]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write the new positions after the filled ones; return the filled ``[B, H, length, D]`` views."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        self._ensure(key_states, self._len + n)
        self._kbuf[:, :, self._len:self._len + n] = key_states
        self._vbuf[:, :, self._len:self._len + n] = value_states
        self._len += n
        self._expose()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self._len

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat each row ``repeats`` times (the prefill shared by a group's samples)."""
        if self._len:
            b = self._kbuf.shape[0]
            self._kbuf = self._rows_copy(self._kbuf, b * repeats,
                                         lambda filled: filled.repeat_interleave(repeats, dim=0))
            self._vbuf = self._rows_copy(self._vbuf, b * repeats,
                                         lambda filled: filled.repeat_interleave(repeats, dim=0))
            self._expose()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep rows ``indices`` (finished rows leave the decode batch)."""
        if self._len:
            self._kbuf = self._rows_copy(self._kbuf, indices.numel(), lambda filled: filled.index_select(0, indices))
            self._vbuf = self._rows_copy(self._vbuf, indices.numel(), lambda filled: filled.index_select(0, indices))
            self._expose()

    def _rows_copy(self, buf: torch.Tensor, rows: int, take: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """A buffer of ``rows`` rows and ``buf``'s capacity whose filled columns are ``take(filled)``, ``filled`` =
        ``buf[:, :, :length]``: only the filled columns are copied (the columns after them are written before they
        are read, as in a fresh buffer), unless they are over half the capacity, when ``take`` of the whole buffer
        (one copy) is cheaper than taking the filled part and writing it into a new buffer (two)."""
        if 2 * self._len > buf.shape[-2]:
            return take(buf)
        out = buf.new_empty((rows, *buf.shape[1:]))
        out[:, :, :self._len] = take(buf[:, :, :self._len])
        return out

    # ---------------------------------------------------------------- per-row use (rollout/slots.py)
    @property
    def allocated(self) -> int:
        """Columns the buffers hold (0 before the first write)."""
        return 0 if self._kbuf is None else int(self._kbuf.shape[-2])

    def _realloc(self, rows: int, like: torch.Tensor, vlike: torch.Tensor, cols: int, shift: int = 0) -> None:
        """Zeroed ``[rows, H, cols, D]`` buffers holding the filled columns moved ``shift`` to the right (masked
        columns must stay finite: ``0 * NaN`` would reach attention's output)."""
        kbuf = like.new_zeros((rows, like.shape[1], cols, like.shape[-1]))
        vbuf = vlike.new_zeros((rows, vlike.shape[1], cols, vlike.shape[-1]))
        if self._kbuf is not None and self._len:
            kbuf[:, :, shift:shift + self._len] = self._kbuf[:, :, :self._len]
            vbuf[:, :, shift:shift + self._len] = self._vbuf[:, :, :self._len]
        self._kbuf, self._vbuf = kbuf, vbuf

    def write_rows(self, rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, end: int,
                   batch: int) -> None:
        """Write ``keys[i], values[i]`` (``[a, H, n, D]``) into row ``rows[i]`` at columns ``[end - n, end)``; the
        filled length becomes ``max(length, end)``.  The first write allocates ``batch`` zeroed rows."""
        n = keys.shape[-2]
        if end < n:
            raise ValueError(f"write_rows: {n} columns do not end at column {end}")
        if not self.is_initialized:
            self.lazy_initialization(keys, values)
        if self._kbuf is None:
            self._realloc(int(batch), keys, values, max(self.capacity, end))
        elif end > self._kbuf.shape[-2]:
            self._realloc(self._kbuf.shape[0], self._kbuf, self._vbuf, max(2 * self._kbuf.shape[-2], end))
        rows = rows.to(self._kbuf.device)
        self._kbuf[rows, :, end - n:end] = keys.to(self._kbuf.dtype)
        self._vbuf[rows, :, end - n:end] = values.to(self._vbuf.dtype)
        self._len = max(self._len, int(end))
        self._expose()

    def pad_left(self, n: int) -> None:
        """Insert ``n`` zero columns before the filled ones of every row (positions are in the keys already)."""
        if n <= 0 or self._kbuf is None:
            return
        cols = self._kbuf.shape[-2]
        need = self._len + n
        self._realloc(self._kbuf.shape[0], self._kbuf, self._vbuf, cols if need <= cols else max(2 * cols, need), n)
        self._len = need
        self._expose()

    def trim_left(self, m: int) -> None:
        """Drop columns ``[0, m)`` of every row (no row attends to them any more)."""
        if m <= 0 or self._kbuf is None:
            return
        if m > self._len:
            raise ValueError(f"trim_left: cannot drop {m} of {self._len} columns")
        keep = self._len - m
        self._kbuf[:, :, :keep] = self._kbuf[:, :, m:self._len].clone()
        self._vbuf[:, :, :keep] = self._vbuf[:, :, m:self._len].clone()
        self._len = keep
        self._expose()

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` positions (a negative count, as ``DynamicLayer.crop`` takes it; a
        positive one is refused in one line); the buffers keep their capacity and the next update writes over them."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of positions to drop, got {tokens_to_remove}")
        self._len = max(self._len + int(tokens_to_remove), 0)
        if self._kbuf is not None:
            self._expose()

    def reset(self) -> None:
        self._kbuf = self._vbuf = None
        self._len = 0
        super().reset()


def preallocated_cache(config, capacity: int) -> DynamicCache:
    """A ``DynamicCache`` for ``config`` whose full-attention layers are :class:`PreallocatedLayer` of
    ``capacity`` positions (sliding-window and other layer kinds are left as transformers builds them)."""
    cache = DynamicCache(config=config)
    cache.layers = [PreallocatedLayer(capacity) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache
