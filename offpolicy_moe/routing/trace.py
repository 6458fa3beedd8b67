"""Route traces: the expert ids each MoE layer selected for each token, stored compactly.

A :class:`RouteTrace` holds ``ids[B, S, L_moe, K]`` aligned with a token tensor ``[B, S]`` (the output of
``model.generate`` or the ``input_ids`` of a forward). R3 (Ma et al., arXiv:2510.11370) replays traces recorded by
the rollout engine; R2 (Zheng et al., arXiv:2507.18071, "routing replay") replays traces recorded by the trainer.

Storage: ``uint8`` when ``num_experts <= 255`` (sentinel ``255`` = "not recorded"), ``int16`` otherwise (sentinel
``-1``): ``L_moe * K`` bytes per token (int16: twice that), against ``4 * L_moe * K`` for int32. A row is either
fully recorded or fully sentinel. The layout helpers move routes exactly like tokens (padding, packing, slicing,
concatenation, selection).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
from einops import rearrange, reduce, repeat

from . import engines

__all__ = [
    "RouteTrace",
    "TraceValidationError",
    "UINT8_SENTINEL",
    "INT16_SENTINEL",
    "storage_dtype",
    "sentinel_for",
    "repad",
    "pack_tokens",
    "unpack_tokens",
    "cat_traces",
]

UINT8_SENTINEL = 255
INT16_SENTINEL = -1


class TraceValidationError(ValueError):
    """A route trace that cannot be replayed faithfully (wrong shape, bad ids, broken capture, too many gaps)."""


def storage_dtype(num_experts: int) -> torch.dtype:
    """Compact dtype for expert ids: uint8 when ``num_experts <= 255`` (255 is the sentinel), else int16."""
    if num_experts <= 0:
        raise ValueError(f"num_experts must be positive, got {num_experts}")
    if num_experts <= 255:
        return torch.uint8
    if num_experts <= 32767:
        return torch.int16
    raise ValueError(f"num_experts={num_experts} does not fit int16 storage")


def sentinel_for(dtype: torch.dtype) -> int:
    """Sentinel value meaning "not recorded" for a storage dtype (uint8: 255, int16: -1)."""
    if dtype == torch.uint8:
        return UINT8_SENTINEL
    if dtype == torch.int16:
        return INT16_SENTINEL
    raise ValueError(f"route traces are stored as uint8 or int16, got {dtype}")


def _check_mask(mask: torch.Tensor, b: int, s: int, what: str = "attention_mask") -> torch.Tensor:
    if mask.dim() != 2 or tuple(mask.shape) != (b, s):
        raise ValueError(f"{what} shape {tuple(mask.shape)} does not match the trace's [B, S] = {(b, s)}")
    return mask.bool()


def repad_destinations(mask: torch.Tensor, side: str) -> tuple[torch.Tensor, torch.Tensor]:
    """For the valid entries of each row of ``mask[B, S]``: their column once moved to ``side`` ("left" or "right")
    keeping order, ``[B, S]`` (meaningful where ``mask``), and the new mask."""
    if side not in ("left", "right"):
        raise ValueError(f"side must be 'left' or 'right', got {side!r}")
    s = mask.shape[1]
    n = mask.sum(1)  # [B]
    rank = torch.cumsum(mask.long(), 1) - 1  # position of each valid entry among the valid ones
    cols = torch.arange(s, device=mask.device)[None, :]
    if side == "right":
        return rank, cols < n[:, None]
    return rank + (s - n)[:, None], cols >= (s - n)[:, None]


def repad(x: torch.Tensor, mask: torch.Tensor, side: str, fill) -> tuple[torch.Tensor, torch.Tensor]:
    """Move the valid entries of each row of ``x[B, S, ...]`` to the ``side`` ("left" or "right") of the row,
    keeping order; the other slots get ``fill``. Returns ``(x_new, mask_new)``."""
    b, s = x.shape[:2]
    m = _check_mask(mask.to(x.device), b, s, "mask")
    dst, new_mask = repad_destinations(m, side)
    out = torch.full_like(x, fill)
    rows = repeat(torch.arange(b, device=x.device), "b -> b s", s=s)
    out[rows[m], dst[m]] = x[m]
    return out, new_mask


def pack_tokens(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack the valid entries of ``x[B, S, ...]`` (row by row) into ``[1, N, ...]``; returns ``(packed, cu_seqlens)``.

    ``cu_seqlens`` is int32 ``[B + 1]`` with ``cu_seqlens[b+1] - cu_seqlens[b]`` = valid count of row b (the
    flash-attention varlen convention).
    """
    b, s = x.shape[:2]
    m = _check_mask(mask.to(x.device), b, s, "mask")
    lens = m.sum(1)
    cu = torch.zeros(b + 1, dtype=torch.int32, device=x.device)
    cu[1:] = torch.cumsum(lens, 0)
    return rearrange(x[m], "n ... -> 1 n ..."), cu


def unpack_tokens(packed: torch.Tensor, cu_seqlens: torch.Tensor, fill, side: str = "right",
                  seq_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`pack_tokens`: ``[1, N, ...]`` -> ``[B, seq_len, ...]`` padded on ``side`` with ``fill``."""
    if packed.dim() < 2 or packed.shape[0] != 1:
        raise ValueError(f"packed tensor must have shape [1, N, ...], got {tuple(packed.shape)}")
    cu = cu_seqlens.long().to(packed.device)
    if cu.dim() != 1 or cu.numel() < 2 or cu[0] != 0 or int(cu[-1]) != packed.shape[1] or bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(f"cu_seqlens {cu_seqlens.tolist()} is not a non-decreasing offset vector from 0 to "
                         f"N={packed.shape[1]}")
    lens = cu[1:] - cu[:-1]
    b = lens.numel()
    width = int(lens.max()) if seq_len is None else seq_len
    if width < int(lens.max()):
        raise ValueError(f"seq_len={seq_len} is shorter than the longest packed sequence ({int(lens.max())})")
    cols = torch.arange(width, device=packed.device)[None, :]
    mask = cols < lens[:, None] if side == "right" else cols >= (width - lens)[:, None]
    out = torch.full((b, width) + tuple(packed.shape[2:]), fill, dtype=packed.dtype, device=packed.device)
    out[mask] = packed[0]
    return out, mask


@dataclass
class RouteTrace:
    """Expert ids per token and MoE layer, aligned with a token tensor.

    ``ids``: ``[B, S, L_moe, K]``; ``layer_ids``: the decoder-layer index of each MoE layer (models with dense first
    layers skip some). ``tokens``: optional int32 ``[B, S]``, the token id each route was recorded on (-1: unknown);
    ``RoutingController.replay`` refuses a trace whose tokens differ from the batch's ``input_ids`` at a recorded
    position, naming the first bad row. Every layout transform moves the tokens exactly like the routes; a trace
    without tokens (``None``) is replayed unchecked.
    """

    ids: torch.Tensor
    num_experts: int
    top_k: int
    layer_ids: tuple[int, ...] = field(default_factory=tuple)
    tokens: torch.Tensor | None = None

    def __post_init__(self):
        self.layer_ids = tuple(int(i) for i in self.layer_ids)
        want = storage_dtype(self.num_experts)
        if self.ids.dtype != want:
            raise TypeError(f"RouteTrace.ids must be {want} for num_experts={self.num_experts}, got {self.ids.dtype}"
                            " (build traces with RouteTrace.from_ids)")
        if self.ids.dim() != 4:
            raise ValueError(f"RouteTrace.ids must be [B, S, L_moe, K], got shape {tuple(self.ids.shape)}")
        if self.ids.shape[3] != self.top_k:
            raise ValueError(f"RouteTrace.ids has K={self.ids.shape[3]} but top_k={self.top_k}")
        if self.layer_ids and len(self.layer_ids) != self.ids.shape[2]:
            raise ValueError(f"RouteTrace has {self.ids.shape[2]} MoE layers but layer_ids has {len(self.layer_ids)}")
        if not self.layer_ids:
            self.layer_ids = tuple(range(self.ids.shape[2]))
        if self.tokens is not None:
            if self.tokens.is_floating_point() or tuple(self.tokens.shape) != tuple(self.ids.shape[:2]):
                raise ValueError(f"RouteTrace.tokens must be integer [B, S] = {tuple(self.ids.shape[:2])}, got "
                                 f"{self.tokens.dtype} {tuple(self.tokens.shape)}")
            self.tokens = self.tokens.to(device=self.ids.device, dtype=torch.int32)

    # ----------------------------------------------------------------------------------------------- construction
    @classmethod
    def from_ids(cls, ids: torch.Tensor, num_experts: int, top_k: int | None = None,
                 layer_ids: Sequence[int] | None = None, recorded: torch.Tensor | None = None) -> "RouteTrace":
        """Build a trace from integer ids ``[B, S, L, K]`` where any negative value means "not recorded".

        ``recorded`` (optional bool ``[B, S]``) additionally marks rows as not recorded where False.
        Ids ``>= num_experts`` are refused.
        """
        if ids.dim() != 4:
            raise ValueError(f"ids must be [B, S, L_moe, K], got shape {tuple(ids.shape)}")
        if ids.is_floating_point():
            raise TypeError(f"ids must be an integer tensor, got {ids.dtype}")
        k = ids.shape[3] if top_k is None else top_k
        ids = ids.long()
        if bool((ids >= num_experts).any()):
            raise TraceValidationError(f"expert id {int(ids.max())} out of range for num_experts={num_experts}")
        missing = ids < 0
        if recorded is not None:
            rec = _check_mask(recorded.to(ids.device), ids.shape[0], ids.shape[1], "recorded")
            missing = missing | ~rec[:, :, None, None]
        dt = storage_dtype(num_experts)
        out = torch.where(missing, torch.full_like(ids, sentinel_for(dt)), ids).to(dt)
        return cls(out, num_experts, k, tuple(layer_ids) if layer_ids is not None else ())

    @classmethod
    def from_vllm(cls, prompt_token_ids, completion_token_ids, routed_experts, prompt_routed_experts=None, *,
                  num_experts: int, layer_ids: Sequence[int], num_hidden_layers: int | None = None, start: int = 0,
                  previous: "RouteTrace | None" = None, unreplayed_layer_ids: Sequence[int] = ()) -> "RouteTrace":
        """One vLLM completion as a ``[1, P + T]`` trace tied to its tokens (layouts: ``routing/engines.py``).

        ``routed_experts``: vLLM >= 0.22's ``[S - 1 - start, L, K]`` (base64 ``.npy`` or ndarray; ``start`` = the
        request's ``routed_experts_prompt_start``), or vLLM 0.21's completion part with ``prompt_routed_experts [P, L,
        K]``; ``L`` = MoE layers or ``num_hidden_layers``.  ``None`` is refused.  Rows before ``start`` come from
        ``previous`` (the conversation's last turn) or are "not recorded", as is the never-fed last position.
        ``unreplayed_layer_ids``: routed layers left to themselves, dropped without the dense-layer zero check.
        """
        prompt = rearrange(engines.as_int_tensor(prompt_token_ids, "prompt_token_ids"), "... -> (...)")
        comp = rearrange(engines.as_int_tensor(completion_token_ids, "completion_token_ids"), "... -> (...)")
        routes = engines.vllm_routes(prompt.numel(), comp.numel(), routed_experts, prompt_routed_experts,
                                     tuple(layer_ids), num_hidden_layers, start, tuple(unreplayed_layer_ids))
        tokens = rearrange(torch.cat([prompt, comp]), "s -> 1 s")
        return cls._from_engine(routes, tokens, num_experts, layer_ids, start, previous)

    @classmethod
    def from_sglang(cls, token_ids, routed_experts, *, num_experts: int, top_k: int, layer_ids: Sequence[int],
                    num_hidden_layers: int | None = None, start: int = 0, previous: "RouteTrace | None" = None,
                    unreplayed_layer_ids: Sequence[int] = ()) -> "RouteTrace":
        """One SGLang request (prompt + output ``token_ids``, ``S`` tokens) as a ``[1, S]`` trace tied to its tokens.

        ``routed_experts``: ``meta_info["routed_experts"]`` (base64 of int32 over all hidden layers, rows
        ``[start, S - 1)`` with ``start`` = the request's ``routed_experts_start_len``) or the decoded array/tensor;
        ``S - start`` rows are accepted too. Rows before ``start`` come from ``previous`` (the last turn's trace)
        or are "not recorded"; position ``S - 1`` (never fed) is "not recorded" (layouts: ``routing/engines.py``).
        ``unreplayed_layer_ids``: as in :meth:`from_vllm`.
        """
        tokens = rearrange(engines.as_int_tensor(token_ids, "token_ids"), "... -> 1 (...)")
        routes = engines.sglang_routes(tokens.shape[1], routed_experts, top_k, tuple(layer_ids), num_hidden_layers,
                                       start, tuple(unreplayed_layer_ids))
        return cls._from_engine(routes, tokens, num_experts, layer_ids, start, previous)

    @classmethod
    def _from_engine(cls, routes: torch.Tensor, tokens: torch.Tensor, num_experts: int, layer_ids: Sequence[int],
                     start: int, previous: "RouteTrace | None") -> "RouteTrace":
        """``routes[S, L, K]`` of one sequence as a ``[1, S]`` trace tied to ``tokens[1, S]``; rows ``[0, start)``
        from ``previous`` (its tokens must be the same there)."""
        if previous is not None and start > 0:
            if previous.batch_size != 1 or previous.seq_len < start:
                raise ValueError(f"previous trace has [B, S] = {tuple(previous.ids.shape[:2])}; it must be one "
                                 f"sequence of at least start={start} positions")
            if (previous.num_experts, previous.layer_ids) != (num_experts, tuple(layer_ids)) \
                    or previous.top_k != routes.shape[-1]:
                raise ValueError(f"previous trace has (num_experts, top_k, layer_ids) = "
                                 f"{(previous.num_experts, previous.top_k, previous.layer_ids)}, this turn "
                                 f"{(num_experts, routes.shape[-1], tuple(layer_ids))}")
            if previous.tokens is not None:
                prev_tok = previous.tokens[0, :start].long()
                known = prev_tok >= 0
                if bool((prev_tok[known] != tokens[0, :start][known.to(tokens.device)]).any()):
                    raise TraceValidationError("previous trace was recorded on other tokens than this turn's first "
                                               f"{start} tokens: it is not this conversation's last turn")
            routes = routes.clone()
            routes[:start] = previous.long_ids()[0, :start].cpu()
        ids = rearrange(routes, "s l k -> 1 s l k")
        return cls.from_ids(ids, num_experts, routes.shape[-1], layer_ids).with_tokens(tokens)

    @classmethod
    def empty(cls, batch: int, seq_len: int, num_layers: int, top_k: int, num_experts: int,
              layer_ids: Sequence[int] | None = None, device=None) -> "RouteTrace":
        """A trace where nothing is recorded (all sentinel)."""
        dt = storage_dtype(num_experts)
        ids = torch.full((batch, seq_len, num_layers, top_k), sentinel_for(dt), dtype=dt, device=device)
        return cls(ids, num_experts, top_k, tuple(layer_ids) if layer_ids is not None else ())

    # ---------------------------------------------------------------------------------------------- properties
    @property
    def sentinel(self) -> int:
        """The "not recorded" value of this trace's storage dtype."""
        return sentinel_for(self.ids.dtype)

    @property
    def shape(self) -> torch.Size:
        return self.ids.shape

    @property
    def batch_size(self) -> int:
        return self.ids.shape[0]

    @property
    def seq_len(self) -> int:
        return self.ids.shape[1]

    @property
    def num_layers(self) -> int:
        return self.ids.shape[2]

    @property
    def device(self) -> torch.device:
        return self.ids.device

    def nbytes(self) -> int:
        """Storage size of the ids in bytes."""
        return self.ids.numel() * self.ids.element_size()

    def missing(self) -> torch.Tensor:
        """Bool ``[B, S, L, K]``: entries equal to the sentinel."""
        return self.ids == self.sentinel

    def recorded_mask(self) -> torch.Tensor:
        """Bool ``[B, S]``: rows recorded in every MoE layer (all K ids present)."""
        return ~reduce(self.missing(), "b s l k -> b s", "max")

    def long_ids(self) -> torch.Tensor:
        """ids as int64 with -1 for "not recorded"."""
        x = self.ids.long()
        return torch.where(self.missing(), torch.full_like(x, -1), x)

    def _like(self, ids: torch.Tensor, tokens: torch.Tensor | None = None) -> "RouteTrace":
        return RouteTrace(ids, self.num_experts, self.top_k, self.layer_ids, tokens)

    def with_tokens(self, tokens: torch.Tensor | None) -> "RouteTrace":
        """The same routes tied to ``tokens[B, S]`` (the ids they were recorded on; -1 where unknown), or untied
        (``None``)."""
        return self._like(self.ids, tokens)

    def check_tokens(self, input_ids: torch.Tensor) -> None:
        """Raise :class:`TraceValidationError` naming the first row whose recorded positions hold other token ids
        than ``input_ids[B, S]`` (a shifted, permuted or foreign trace). No-op for a trace without tokens."""
        if self.tokens is None:
            return
        if tuple(input_ids.shape) != tuple(self.tokens.shape):
            raise TraceValidationError(f"trace [B, S] = {tuple(self.tokens.shape)} but input_ids "
                                       f"{tuple(input_ids.shape)}")
        tok = self.tokens.to(input_ids.device).long()
        check = self.recorded_mask().to(input_ids.device) & (tok >= 0)
        bad = check & (tok != input_ids.long())
        if bool(bad.any()):
            b, pos = bad.nonzero()[0].tolist()
            raise TraceValidationError(f"route trace row {b} was recorded on other tokens than the batch's row {b} "
                                       f"(first difference at position {pos}: token {int(tok[b, pos])} in the trace, "
                                       f"{int(input_ids[b, pos])} in input_ids): shifted, permuted or foreign trace")

    # --------------------------------------------------------------------------------------------- validation
    def validate(self, seq_shape: Sequence[int] | None = None, mask: torch.Tensor | None = None,
                 max_missing: float = 0.25, min_rows_zero_check: int = 16) -> dict[str, float]:
        """Check that the trace can be replayed; :class:`TraceValidationError` naming the problem.  Returns
        ``{"missing_frac": float, "recorded_rows": int}``.

        Checks, in order: ``seq_shape`` equals ``ids.shape[:2]``; ids out of range; partially recorded rows; a layer
        whose recorded ids are all 0 (a broken capture, as inference engines produce when capture is silently off;
        checked when K >= 2 or the layer has >= ``min_rows_zero_check`` rows); duplicate ids within a row; the fraction
        of rows missing among ``mask`` above ``max_missing``.
        """
        b, s, nl, k = self.ids.shape
        if seq_shape is not None and tuple(seq_shape) != (b, s):
            raise TraceValidationError(f"trace shape [B, S] = {(b, s)} does not match the sequences' shape "
                                       f"{tuple(seq_shape)}")
        ids = self.ids.long()
        miss = self.ids == self.sentinel
        bad = (~miss) & ((ids < 0) | (ids >= self.num_experts))
        if bool(bad.any()):
            where = bad.nonzero()[0].tolist()
            raise TraceValidationError(f"expert id {int(ids[tuple(where)])} at [b, s, layer, k] = {where} is out of "
                                       f"range for num_experts={self.num_experts}")
        row_any = reduce(miss, "b s l k -> b s", "max")
        row_all = reduce(miss, "b s l k -> b s", "min")
        partial = row_any & ~row_all
        if bool(partial.any()):
            where = partial.nonzero()[0].tolist()
            raise TraceValidationError(f"row [b, s] = {where} is partially recorded (some layers or some of the "
                                       f"K={k} ids are missing)")
        rec = ~row_all  # [B, S]
        n_rec = int(rec.sum())
        if n_rec > 0:
            rows = ids[rec]  # [N, L, K]
            for layer in range(nl):
                if (k >= 2 or n_rec >= min_rows_zero_check) and bool((rows[:, layer] == 0).all()):
                    raise TraceValidationError(
                        f"MoE layer {layer} (decoder layer {self.layer_ids[layer]}) has only expert id 0 in all "
                        f"{n_rec} recorded rows: a broken (all-zero) capture")
            srt = rows.sort(-1).values
            dup = (srt[..., 1:] == srt[..., :-1]).any(-1)  # [N, L]
            if bool(dup.any()):
                r, layer = dup.nonzero()[0].tolist()
                bs = rec.nonzero()[r].tolist()
                raise TraceValidationError(f"duplicate expert ids {rows[r, layer].tolist()} in one row at [b, s] = "
                                           f"{bs}, MoE layer {layer}")
        if mask is not None:
            m = _check_mask(mask.to(self.ids.device), b, s)
        else:
            m = torch.ones(b, s, dtype=torch.bool, device=self.ids.device)
        denom = int(m.sum())
        frac = float((row_all & m).sum()) / denom if denom else 0.0
        if frac > max_missing:
            raise TraceValidationError(f"{frac:.1%} of the rows to replay are not recorded (max_missing="
                                       f"{max_missing:.1%})")
        return {"missing_frac": frac, "recorded_rows": n_rec}

    # ------------------------------------------------------------------------------------------------ layout
    def to(self, device=None) -> "RouteTrace":
        """Move the ids to ``device``."""
        return self._like(self.ids.to(device), None if self.tokens is None else self.tokens.to(device))

    def index_select(self, index: torch.Tensor) -> "RouteTrace":
        """Rows of the batch (e.g. a mini-batch): ``ids[index]``."""
        index = index.to(self.ids.device).long()
        tok = None if self.tokens is None else self.tokens.index_select(0, index)
        return self._like(self.ids.index_select(0, index), tok)

    def slice(self, start: int | None = None, end: int | None = None) -> "RouteTrace":
        """Positions ``start:end`` of every sequence (e.g. the response part ``slice(prompt_width)``)."""
        tok = None if self.tokens is None else self.tokens[:, start:end].contiguous()
        return self._like(self.ids[:, start:end].contiguous(), tok)

    def response(self, prompt_width: int) -> "RouteTrace":
        """Routes of the response tokens of ``generate`` output: positions ``prompt_width:``."""
        return self.slice(prompt_width, None)

    def repad(self, attention_mask: torch.Tensor, side: str) -> tuple["RouteTrace", torch.Tensor]:
        """Move routes like tokens to ``side`` padding ("left"/"right"); pad slots become "not recorded".
        Returns ``(trace, new_attention_mask)``."""
        ids, m = repad(self.ids, attention_mask, side, self.sentinel)
        tok = None if self.tokens is None else repad(self.tokens, attention_mask, side, -1)[0]
        return self._like(ids, tok), m

    def pack(self, attention_mask: torch.Tensor) -> tuple["RouteTrace", torch.Tensor]:
        """Packed layout ``[1, N, L, K]`` of the real tokens (row after row); returns ``(trace, cu_seqlens)``."""
        ids, cu = pack_tokens(self.ids, attention_mask)
        tok = None if self.tokens is None else pack_tokens(self.tokens, attention_mask)[0]
        return self._like(ids, tok), cu

    def unpack(self, cu_seqlens: torch.Tensor, side: str = "right", seq_len: int | None = None
               ) -> tuple["RouteTrace", torch.Tensor]:
        """Inverse of :meth:`pack`: ``[B, seq_len, L, K]`` padded on ``side``; returns ``(trace, attention_mask)``."""
        ids, m = unpack_tokens(self.ids, cu_seqlens, self.sentinel, side, seq_len)
        tok = None if self.tokens is None else unpack_tokens(self.tokens, cu_seqlens, -1, side, seq_len)[0]
        return self._like(ids, tok), m

    def pad_to(self, seq_len: int, side: str = "right") -> "RouteTrace":
        """Pad the sequence dimension with "not recorded" rows up to ``seq_len``."""
        s = self.seq_len
        if seq_len < s:
            raise ValueError(f"cannot pad a trace of length {s} to the shorter length {seq_len}")
        if seq_len == s:
            return self
        pad = torch.full((self.batch_size, seq_len - s, self.num_layers, self.top_k), self.sentinel,
                         dtype=self.ids.dtype, device=self.ids.device)
        parts = [self.ids, pad] if side == "right" else [pad, self.ids]
        tok = None
        if self.tokens is not None:
            tpad = torch.full((self.batch_size, seq_len - s), -1, dtype=self.tokens.dtype, device=self.tokens.device)
            tok = torch.cat([self.tokens, tpad] if side == "right" else [tpad, self.tokens], 1)
        return self._like(torch.cat(parts, 1), tok)

    # --------------------------------------------------------------------------------------------- save/load
    def state_dict(self) -> dict:
        """Plain tensors and ints, safe inside ``torch.save`` checkpoints and staleness buffers."""
        return {"ids": self.ids, "num_experts": int(self.num_experts), "top_k": int(self.top_k),
                "layer_ids": list(self.layer_ids), "tokens": self.tokens, "format": "offpolicy_moe.RouteTrace/1"}

    @classmethod
    def from_state_dict(cls, state: dict) -> "RouteTrace":
        """Inverse of :meth:`state_dict`."""
        missing = {"ids", "num_experts", "top_k", "layer_ids"} - set(state)
        if missing:
            raise ValueError(f"RouteTrace state_dict lacks keys {sorted(missing)}")
        return cls(state["ids"], int(state["num_experts"]), int(state["top_k"]), tuple(state["layer_ids"]),
                   state.get("tokens"))

    def equal(self, other: "RouteTrace") -> bool:
        """Same metadata and identical ids."""
        return (self.num_experts == other.num_experts and self.top_k == other.top_k
                and self.layer_ids == other.layer_ids and self.ids.shape == other.ids.shape
                and bool(torch.equal(self.ids.cpu(), other.ids.cpu())))


def cat_traces(traces: Sequence[RouteTrace], side: str = "right") -> RouteTrace:
    """Concatenate along the batch, padding shorter sequences with "not recorded" rows on ``side`` (the side the
    token tensors are padded on)."""
    if not traces:
        raise ValueError("cat_traces needs at least one trace")
    t0 = traces[0]
    for i, t in enumerate(traces[1:], 1):
        if (t.num_experts, t.top_k, t.layer_ids) != (t0.num_experts, t0.top_k, t0.layer_ids):
            raise ValueError(f"trace {i} has (num_experts, top_k, layer_ids) = {(t.num_experts, t.top_k, t.layer_ids)}"
                             f" but trace 0 has {(t0.num_experts, t0.top_k, t0.layer_ids)}")
    s = max(t.seq_len for t in traces)
    padded = [t.pad_to(s, side) for t in traces]
    tok = None  # tied only when every part is tied
    if all(t.tokens is not None for t in padded):
        tok = torch.cat([t.tokens.to(t0.device) for t in padded], 0)
    return t0._like(torch.cat([t.ids.to(t0.device) for t in padded], 0), tok)
