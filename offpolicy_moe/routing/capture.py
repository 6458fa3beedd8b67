"""What a forward's routers did, collected by the routing rules' hooks: :class:`Recorder` (the experts each token was
routed to, stacked into a :class:`RouteTrace`) and :class:`RouterCapture` (router logits and the router's own top-k
at chosen tokens, PR2's targets). Both know the model only through its frozen :class:`ModelShape`."""
from __future__ import annotations

import torch
from einops import rearrange

from .state import ModelShape
from .trace import RouteTrace, sentinel_for, storage_dtype

__all__ = ["Recorder", "RouterCapture"]


class Recorder:
    """Routes collected by ``RoutingController.record()``; call :meth:`trace` after the model ran."""

    def __init__(self, shape: ModelShape, which: str):
        if not isinstance(shape, ModelShape):
            raise TypeError(f"Recorder takes the model's ModelShape, got {type(shape).__name__}")
        self.shape = shape
        self.which = which
        self._chunks: dict[int, list[torch.Tensor]] = {}
        self._shapes: dict[int, list[tuple[int, int]]] = {}
        self.final_len: int | None = None  # set by the generate guard: len of sequences
        self._tokens: list[torch.Tensor] = []
        self._tokens_ok = True  # False once the calls' token ids cannot be laid out like the routes
        self._scatter: tuple[torch.Tensor, int] | None = None   # (rows, batch): later calls feed only these rows

    def untie_tokens(self) -> None:
        """The forward's token ids are unknown (``inputs_embeds``): the trace will not be tied to tokens."""
        self._tokens_ok = False

    def add_tokens(self, ids: torch.Tensor) -> None:
        """The token ids ``[B, s]`` of one forward call, in call order (called by the controller's model hook)."""
        if self._scatter is not None or (self._tokens and self._tokens[0].shape[0] != ids.shape[0]):
            self._tokens_ok = False
        if self._tokens_ok:
            self._tokens.append(ids.detach().to(torch.int32))

    def _trace_tokens(self, t: RouteTrace) -> torch.Tensor | None:
        """The token ids laid out like the trace ``t`` (-1 beyond the fed tokens), or None when unknown."""
        if not self._tokens_ok or not self._tokens:
            return None
        tok = torch.cat([x.to(t.device) for x in self._tokens], 1)
        if tok.shape[0] != t.batch_size or tok.shape[1] > t.seq_len:
            return None
        pad = torch.full((tok.shape[0], t.seq_len - tok.shape[1]), -1, dtype=tok.dtype, device=tok.device)
        return torch.cat([tok, pad], 1)

    @property
    def num_calls(self) -> int:
        return max((len(v) for v in self._chunks.values()), default=0)

    def add(self, layer: int, idx: torch.Tensor, b: int, s: int) -> None:
        """One router call's ids ``[b*s, K]`` of MoE layer ``layer`` (called by the routing rules)."""
        dt = storage_dtype(self.shape.num_experts)
        chunk = rearrange(idx.detach(), "(b s) k -> b s k", b=b, s=s).to(dt)
        if self._scatter is not None:
            rows, batch = self._scatter
            if b != rows.numel():
                raise ValueError(f"recorder expected calls on the {rows.numel()} active rows of {batch}, got {b} rows")
            full = torch.full((batch, s, chunk.shape[-1]), sentinel_for(dt), dtype=dt, device=chunk.device)
            full[rows.to(chunk.device)] = chunk
            chunk, b = full, batch
        self._chunks.setdefault(layer, []).append(chunk)
        self._shapes.setdefault(layer, []).append((b, s))

    def scatter_rows(self, rows: torch.Tensor, batch: int) -> None:
        """Later calls run on rows ``rows`` of a ``batch``-row batch only (finished sequences dropped from decoding):
        their routes are written to those rows and the other rows get the "not recorded" sentinel, so the trace
        keeps the full batch layout."""
        rows = torch.as_tensor(rows).long()
        if rows.dim() != 1 or int(batch) < 1 or rows.numel() > int(batch) \
                or (rows.numel() and not (0 <= int(rows.min()) and int(rows.max()) < int(batch))) \
                or rows.unique().numel() != rows.numel():
            raise ValueError(f"scatter_rows needs distinct 1-D row ids in [0, {batch}), got {rows.tolist()[:16]}")
        self._scatter = (rows, int(batch))

    def select_rows(self, index: torch.Tensor) -> None:
        """Re-index the batch of everything recorded so far (``index[b]``: the recorded row that becomes row ``b``),
        as a KV cache's ``batch_select_indices`` does: a prompt prefilled once per group and repeated to its G
        samples is recorded once and repeated the same way, so later (decode) calls see a consistent batch."""
        index = torch.as_tensor(index).long()
        recorded = {b for shapes in self._shapes.values() for b, _ in shapes}
        if index.dim() != 1 or len(recorded) > 1:
            raise ValueError(f"select_rows needs a 1-D row index and one recorded batch size, got index shape "
                             f"{tuple(index.shape)} and batch sizes {sorted(recorded)}")
        if recorded and index.numel() and not (0 <= int(index.min()) and int(index.max()) < min(recorded)):
            raise ValueError(f"select_rows index out of range [0, {min(recorded)}): "
                             f"min {int(index.min())}, max {int(index.max())}")
        self._tokens = [c.index_select(0, index.to(c.device)) for c in self._tokens]
        for layer, chunks in self._chunks.items():
            self._chunks[layer] = [c.index_select(0, index.to(c.device)) for c in chunks]
            self._shapes[layer] = [(int(index.numel()), s) for _, s in self._shapes[layer]]

    def trace(self) -> RouteTrace:
        """Stack the recorded chunks into ``ids[B, S, L_moe, K]``.

        Chunks (prefill, each decode step, or consecutive forward calls) are concatenated along the sequence. After
        ``generate`` the trace is padded with "not recorded" rows to the length of ``sequences`` (the final sampled
        token is never fed to the model). Raises ValueError when layers disagree or the batch size changed.
        """
        shape = self.shape
        if not self._chunks:
            raise ValueError("nothing was recorded: run the model inside `with ctl.record() as rec:`")
        layers = sorted(self._chunks)
        if layers != list(range(shape.num_moe_layers)):
            raise ValueError(f"routes recorded for MoE layers {layers}, expected all of 0..{shape.num_moe_layers - 1}")
        shapes = self._shapes[0]
        for l in layers:
            if self._shapes[l] != shapes:
                raise ValueError(f"MoE layer {l} saw call shapes {self._shapes[l]} but layer 0 saw {shapes}")
        bs = {b for b, _ in shapes}
        if len(bs) != 1:
            raise ValueError(f"the batch size changed between recorded calls ({[b for b, _ in shapes]}): "
                             f"beam search / assisted decoding cannot be recorded")
        ids = torch.stack([torch.cat(self._chunks[l], 1) for l in layers], 2)  # [B, S, L, K]: calls along S
        t = RouteTrace(ids, shape.num_experts, shape.top_k, shape.layer_ids)
        if self.final_len is not None:
            if t.seq_len > self.final_len:
                raise ValueError(f"recorded {t.seq_len} positions but generate returned sequences of length "
                                 f"{self.final_len}: the cache was re-fed (use_cache=False / assisted decoding?)")
            t = t.pad_to(self.final_len, "right")
        return t.with_tokens(self._trace_tokens(t))


class RouterCapture:
    """Router logits and the router's own top-k at chosen tokens, captured during a forward."""

    def __init__(self, shape: ModelShape, batch_index: torch.Tensor, position: torch.Tensor):
        if batch_index.shape != position.shape or batch_index.dim() != 1:
            raise ValueError(f"batch_index {tuple(batch_index.shape)} and position {tuple(position.shape)} must be "
                             f"equal 1-D shapes")
        if not isinstance(shape, ModelShape):
            raise TypeError(f"RouterCapture takes the model's ModelShape, got {type(shape).__name__}")
        self.shape = shape
        self.batch_index = batch_index.long()
        self.position = position.long()
        self._logits: dict[int, torch.Tensor] = {}
        self._ids: dict[int, torch.Tensor] = {}
        self._seen: dict[int, torch.Tensor] = {}
        self._pos: dict[int, int] = {}

    def add(self, layer: int, logits: torch.Tensor, own: torch.Tensor, b: int, s: int) -> None:
        """One router call's logits ``[b*s, E]`` and own ids ``[b*s, K]`` of MoE layer ``layer`` (called by the
        routing rules); the chosen tokens among them are kept."""
        dev = logits.device
        bi, pos = self.batch_index.to(dev), self.position.to(dev)
        m = bi.numel()
        if layer not in self._logits:
            self._logits[layer] = torch.zeros(m, logits.shape[-1], dtype=logits.dtype, device=dev)
            self._ids[layer] = torch.full((m, own.shape[-1]), -1, dtype=torch.long, device=dev)
            self._seen[layer] = torch.zeros(m, dtype=torch.bool, device=dev)
        off = self._pos.get(layer, 0)
        self._pos[layer] = off + s
        if m and int(bi.max()) >= b:
            raise ValueError(f"capture batch index {int(bi.max())} out of range for a batch of {b}")
        sel = (pos >= off) & (pos < off + s)
        lg = rearrange(logits.detach(), "(b s) e -> b s e", b=b, s=s)
        ow = rearrange(own.detach(), "(b s) k -> b s k", b=b, s=s)
        self._logits[layer][sel] = lg[bi[sel], pos[sel] - off]
        self._ids[layer][sel] = ow[bi[sel], pos[sel] - off].long()
        self._seen[layer] |= sel

    def _check(self) -> list[int]:
        layers = sorted(self._logits)
        if layers != list(range(self.shape.num_moe_layers)):
            raise ValueError(f"router logits captured for MoE layers {layers}; run the forward inside the block")
        for l in layers:
            if not bool(self._seen[l].all()):
                raise ValueError(f"{int((~self._seen[l]).sum())} capture positions were never processed "
                                 f"(position beyond the sequence?)")
        return layers

    def logits(self) -> torch.Tensor:
        """``[M, L, E]`` detached router logits (the current router, before any replay/offset)."""
        return torch.stack([self._logits[l] for l in self._check()], 1)

    def own_ids(self) -> torch.Tensor:
        """``[M, L, K]`` int64: the router's own top-k at those tokens."""
        return torch.stack([self._ids[l] for l in self._check()], 1)
