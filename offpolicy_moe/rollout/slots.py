"""Continuous batching for the built-in engine: a fixed number of decode rows ("slots") refilled as samples finish.

:meth:`HFRolloutEngine.generate` decodes a batch until its longest row is done, so with long-tailed response
lengths most rows sit finished while one runs on.  :class:`SlotSampler` keeps ``slots`` rows busy instead: each
:meth:`SlotSampler.step` admits queued samples into free rows (one left-padded prefill of the new prompts), draws one
token for every active row, and runs ONE batched decode forward over the occupied rows.

All rows share one KV cache of ``L`` columns.  A row occupies columns ``[s_r, L)`` exactly as a left-padded row
would: its attention mask is 0 before ``s_r`` and 1 from there, its position ids are its own (prompt length plus the
tokens fed so far).  An admitted prompt of length ``p`` is written at ``[L - p, L)`` (every row is shifted right
first when ``L < p``); when ``L`` reaches the buffer's size the columns before the earliest running row are dropped
(:meth:`~offpolicy_moe.rollout.kv_cache.PreallocatedLayer.trim_left`) when that frees at least a quarter of the
buffer, which otherwise doubles: the buffer stays within a few times the longest prompt plus ``max_new_tokens``.

The cache keeps the ``n`` occupied rows in its first ``n`` buffer rows (a row that finishes is replaced by the last
occupied one: one row copied), so the decode forward reads the buffers' first ``b`` rows, a view: the occupied rows
and ``min(free, free_rows)`` free ones fed a pad token that attends to itself only (``free_rows`` = :data:`FREE_ROWS`;
``None`` feeds every free slot: the full-slot decode).  Why feed any free row: the samples are then bit for bit those
of the full-slot decode.  A float32 matmul row does not depend on the other rows' values, but the CPU BLAS picks its
sgemm kernel by the row count ``M``, and the kernels round differently (torch 2.13's MKL, AVX-512: ``M = 1``,
``M = 2..3`` and ``M >= 4`` are three classes; tests/streaming/test_slots_exact.py), in the dense layers (``M = b``)
and in each routed expert (``M`` = the tokens routed to it, pad rows included).  With ``min(free, 3)`` pad rows every
matmul that holds an occupied row's token has ``M >= 4`` whenever the full-slot decode's had (more than 3 free slots
there), and the same ``M`` otherwise, so it falls in the same class, for three rows' cost.  The columns (``L``, the
row offsets, the trims) are those of the full-slot decode, so attention runs the same shapes per row.

Each sample draws with its own generator seeded by its ``seed``, by the exponential race
``x = argmax_v(log_softmax(s)_v - log q_v)``, ``q_v ~ Exp(1)`` (exact sampling from ``softmax(s)``; ``q`` drawn in
float64 so that no ``q_v`` rounds to 0; a row draws its next tokens' ``q`` in one call, :data:`RACE_ELEMENTS`), so a
sample's tokens do not depend on the slot it got or its neighbours.
``behav_logp[t] = log_softmax(s_t)[x_t]`` in float32 on the very scores ``x_t`` was drawn from.
"""
from __future__ import annotations

import collections
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any, Iterable, Optional

import torch

from offpolicy_moe.models.layout import cache_kwarg
from offpolicy_moe.rollout.kv_cache import PreallocatedLayer, preallocated_cache
from offpolicy_moe.run.nonfinite import NonFiniteError

__all__ = ["FREE_ROWS", "RACE_ELEMENTS", "RACE_TOKENS", "StreamSample", "FinishedSample", "SlotSampler",
           "checked_sample", "check_slot_settings"]

#: free slots fed beside the occupied rows in a decode forward (module docstring: the sgemm kernel classes)
FREE_ROWS = 3
#: the most float64 race draws a row holds ahead (its next ``n`` tokens' draws in one call, ``n V <=`` this, at most
#: :data:`RACE_TOKENS`): one ``exponential_`` call of ``n V`` values gives the values of ``n`` calls of ``V`` in order
#: (torch's CPU kernel draws serially; tests/streaming/test_slots.py), so the tokens are those of a draw per token
RACE_ELEMENTS = 1 << 16
RACE_TOKENS = 64


@dataclass(frozen=True)
class StreamSample:
    """One sample to generate: ``key`` = (group, index in the group), unpadded ``prompt_ids [p]``, its own ``seed``."""

    key: tuple[int, int]
    prompt_ids: torch.Tensor
    seed: int


@dataclass(frozen=True)
class FinishedSample:
    """A generated sample (CPU tensors): ``response_ids [n]`` (EOS included when drawn), ``behav_logp [n]``
    (``log_softmax(s_t)[x_t]``, float32), ``versions [n]`` (engine version of the forward that gave ``s_t``),
    ``routes [p + n, L_moe, K]`` (experts of every fed position, -1 at the last response token, which is never fed;
    None when the engine records no routes)."""

    key: tuple[int, int]
    prompt_ids: torch.Tensor
    response_ids: torch.Tensor
    behav_logp: torch.Tensor
    versions: torch.Tensor
    routes: Optional[torch.Tensor]


def checked_sample(sample: StreamSample) -> StreamSample:
    """``sample``, or a one-line ``ValueError`` when its ``prompt_ids`` are not a non-empty 1-D integer tensor."""
    ids = sample.prompt_ids
    if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.numel() < 1 or ids.is_floating_point():
        raise ValueError(f"StreamSample {sample.key}: prompt_ids must be a non-empty 1-D integer tensor")
    return sample


class _Row:
    """The state of one occupied slot."""

    __slots__ = ("sample", "gen", "start", "prompt_len", "tokens", "logps", "versions", "score_version", "routes",
                 "slot", "row", "race", "raced")

    def __init__(self, sample: StreamSample, gen: torch.Generator, start: int, score_version: int, slot: int,
                 row: int):
        self.sample, self.gen, self.start = sample, gen, start
        self.slot = slot                            # its place in the sampler's slots (the order of a step's draws)
        self.row = row                              # its row in the cache buffers (the occupied rows come first)
        self.prompt_len = int(sample.prompt_ids.numel())
        self.tokens: list[int] = []
        self.logps: list[float] = []
        self.versions: list[int] = []
        self.score_version = score_version          # version of the forward whose logits this row draws from next
        self.routes: list[torch.Tensor] = []        # [p, L_moe, K] from the prefill, then [1, L_moe, K] per decode
        self.race: Optional[torch.Tensor] = None    # [n, V] float64 Exp(1) draws of its next tokens (RACE_ELEMENTS)
        self.raced = 0                              # the rows of ``race`` used

    def next_race(self, vocab: int, ahead: int) -> torch.Tensor:
        """``[V]`` Exp(1) draws for this row's next token from its own generator, ``ahead`` tokens' drawn at once."""
        if self.race is None or self.raced == self.race.shape[0]:
            self.race = torch.empty((ahead, vocab), dtype=torch.float64, device=self.gen.device).exponential_(
                generator=self.gen)
            self.raced = 0
        self.raced += 1
        return self.race[self.raced - 1]


class _SlotLayer(PreallocatedLayer):
    """A :class:`PreallocatedLayer` whose update may cover the first ``b`` buffer rows only: the decode of the
    occupied rows (and a few free ones) reads and extends ``[:b, :, :length + n]``, a view.  The other rows keep
    columns they were not written at; those are zeros or stale keys, never uninitialised memory (buffers grow
    zero-filled), so they stay finite where they are masked (``0 * NaN`` would reach attention's output)."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write the ``n`` new positions of rows ``[0, b)`` after the filled ones (growing the buffers of every row
        by doubling when full, as the plain layer does); return the filled ``[b, H, length, D]`` views."""
        if self._kbuf is None:
            return super().update(key_states, value_states, *args, **kwargs)
        b, n = key_states.shape[0], key_states.shape[-2]
        cols = self._kbuf.shape[-2]
        if self._len + n > cols:
            self._realloc(self._kbuf.shape[0], self._kbuf, self._vbuf, max(2 * cols, self._len + n))
        self._kbuf[:b, :, self._len:self._len + n] = key_states
        self._vbuf[:b, :, self._len:self._len + n] = value_states
        self._len += n
        self._expose()
        self.keys, self.values = self.keys[:b], self.values[:b]
        return self.keys, self.values

    def move_row(self, src: int, dst: int) -> None:
        """Copy buffer row ``src``'s filled columns into row ``dst`` (a finished row replaced by the last one)."""
        if self._kbuf is not None and self._len:
            self._kbuf[dst, :, :self._len] = self._kbuf[src, :, :self._len]
            self._vbuf[dst, :, :self._len] = self._vbuf[src, :, :self._len]


def _slot_cache(config: Any, capacity: int) -> Any:
    """:func:`preallocated_cache` of ``capacity`` columns whose layers are :class:`_SlotLayer`."""
    cache = preallocated_cache(config, capacity)
    cache.layers = [_SlotLayer(capacity) if isinstance(layer, PreallocatedLayer) else layer for layer in cache.layers]
    return cache


def check_slot_settings(sampler: str, top_k: int, top_p: float, pr2: bool, model_config: Any) -> None:
    """One-line ``ValueError`` for settings the slot sampler cannot serve: ``rollout.sampler`` other than native,
    a truncated distribution, PR2 predictors (per-sample router offsets), a model whose KV cache has layers other
    than full attention.  Shared by :class:`SlotSampler` and the run's checks (before any worker starts)."""
    if sampler != "native":
        raise ValueError(f"buffer.mode=stream needs rollout.sampler=native (its own KV-cache loop), got {sampler!r}")
    if top_k > 0 or top_p < 1.0:
        raise ValueError(f"buffer.mode=stream samples the full distribution: set rollout.top_k=0 and "
                         f"rollout.top_p=1 (got top_k={top_k}, top_p={top_p})")
    if pr2:
        raise ValueError("buffer.mode=stream does not run PR2 predictors (per-sample router offsets); "
                         "use algo.routing.replay=r3 or none")
    kinds = {type(layer).__name__ for layer in preallocated_cache(model_config, 1).layers
             if not isinstance(layer, PreallocatedLayer)}
    if kinds:
        raise ValueError(f"buffer.mode=stream needs full-attention KV-cache layers only; "
                         f"model {getattr(model_config, 'model_type', '?')} has {sorted(kinds)} (sliding window or "
                         "another kind)")


class SlotSampler:
    """Continuous batching over ``slots`` decode rows of one :class:`~offpolicy_moe.rollout.engine.HFRolloutEngine`
    (see the module docstring): :meth:`submit` queues samples, each :meth:`step` returns those that finished."""

    def __init__(self, engine: Any, slots: int, free_rows: Optional[int] = FREE_ROWS):
        """A sampler of ``slots`` rows on ``engine`` (native sampler, full distribution, no PR2).  Each decode
        forward feeds the occupied rows and ``min(free, free_rows)`` free ones (``None``: all of them, the full-slot
        decode; ``0``: the occupied rows alone, which may round differently: module docstring)."""
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
            raise ValueError(f"SlotSampler needs slots >= 1, got {slots!r}")
        if free_rows is not None and (isinstance(free_rows, bool) or not isinstance(free_rows, int)
                                      or free_rows < 0):
            raise ValueError(f"SlotSampler needs free_rows >= 0 or None, got {free_rows!r}")
        check_slot_settings(getattr(engine, "sampler", None), engine.top_k, engine.top_p,
                            getattr(engine, "pr2_predictors", None) is not None, engine.model.config)
        self.engine, self.slots = engine, int(slots)
        tok = engine.tokenizer
        self.eos = tok.eos_token_id             # a row that draws it is finished
        self.pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        self._queue: collections.deque[StreamSample] = collections.deque()
        self.free_rows = free_rows
        self._rows: list[Optional[_Row]] = [None] * self.slots
        self._order: list[int] = []   # the slot of each occupied buffer row: row k holds slot _order[k]
        self._cache = None            # the shared KV cache (created at the first admission)
        self._L = 0                   # its column count
        self._logits: Optional[torch.Tensor] = None     # [slots, V] float32: the logits each row draws from next
        self.trims = self.grows = 0   # cache maintenance counters (tests, benchmarks)

    # ------------------------------------------------------------------ queue
    def submit(self, samples: Iterable[StreamSample]) -> None:
        """Queue ``samples`` (first in, first admitted)."""
        for s in samples:
            self._queue.append(checked_sample(s))

    @property
    def queued(self) -> int:
        """Samples submitted and not yet admitted."""
        return len(self._queue)

    @property
    def active(self) -> int:
        """Rows decoding now (each occupied row holds one entry of the buffer-row order)."""
        return len(self._order)

    # ------------------------------------------------------------------ one step
    def step(self) -> list[FinishedSample]:
        """Run ``engine.between_tokens``, admit queued samples, draw one token per active row, run one decode
        forward of the rows still running; return the samples that finished (EOS or ``max_new_tokens``)."""
        eng = self.engine
        if eng.between_tokens is not None:
            eng.between_tokens(eng)
        if not self._queue and not self.active:
            return []
        ctl = eng.controller
        grad_off = torch.inference_mode() if ctl is None else torch.no_grad()
        with grad_off, ExitStack() as stack:
            if ctl is not None:
                if eng.router_noise > 0:
                    stack.enter_context(ctl.logit_noise(eng.router_noise))
                if eng.router_perturbation is not None:     # logits + h dW^T, selection and weights
                    stack.enter_context(ctl.offsets(eng.router_perturbation, in_weights=True))
            self._admit()
            done = self._draw()
            self._decode()
        return [self._finish(r) for r in done]

    def _forward(self, **kw) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """One model forward: ``(last-position logits [b, V], routes [b, s, L_moe, K] or None)``; a decode step
        (one token per row, no routes recorded) goes through the engine's :class:`DecodeForward`."""
        eng = self.engine
        if eng._keeps_logits:
            kw["logits_to_keep"] = 1

        def forward() -> torch.Tensor:
            if kw["input_ids"].shape[1] == 1:
                return eng.decode(kw["input_ids"], kw["attention_mask"], kw["position_ids"],
                                  kw[cache_kwarg(eng.model)])
            return eng.model(use_cache=True, **kw).logits

        if eng.controller is not None and eng.record_routes:
            with eng.controller.record() as rec:
                logits = forward()
            routes = rec.trace().ids
        else:
            logits, routes = forward(), None
        return logits[:, -1, :], routes

    def _admit(self) -> None:
        """Prefill queued samples into free slots (one left-padded forward) and write them into the shared cache."""
        free = [i for i, r in enumerate(self._rows) if r is None]
        n = min(len(free), len(self._queue))
        if n == 0:
            return
        eng = self.engine
        dev = eng.device
        new = [self._queue.popleft() for _ in range(n)]
        # samples of one group with the same prompt share a prefill row, unless router noise makes them differ
        uniq, src = {}, []
        for s in new:
            k = (s.key[0], tuple(s.prompt_ids.tolist())) if eng.router_noise == 0 else id(s)
            src.append(uniq.setdefault(k, len(uniq)))
        prompts = [None] * len(uniq)
        for s, u in zip(new, src):
            prompts[u] = s.prompt_ids
        P = max(int(p.numel()) for p in prompts)
        ids = torch.full((len(prompts), P), self.pad, dtype=torch.long)
        am = torch.zeros((len(prompts), P), dtype=torch.long)
        for u, p in enumerate(prompts):
            ids[u, P - p.numel():] = p
            am[u, P - p.numel():] = 1
        ids, am = ids.to(dev), am.to(dev)
        pos = (am.cumsum(-1) - 1).masked_fill(am == 0, 1)
        pcache = preallocated_cache(eng.model.config, P)
        logits, routes = self._forward(input_ids=ids, attention_mask=am, position_ids=pos,
                                       **{cache_kwarg(eng.model): pcache})
        if self._cache is None:
            self._cache = _slot_cache(eng.model.config, P + eng.max_new_tokens + 1)
            self._logits = logits.new_zeros((self.slots, logits.shape[-1]), dtype=torch.float32)
        if self._L < P:       # room for the longest new prompt at [L - P, L): shift every row right
            shift = P - self._L
            layers = self._cache.layers
            self.grows += int(any(0 < layer.allocated < layer.get_seq_length() + shift for layer in layers))
            for layer in layers:
                layer.pad_left(shift)
            for r in self._rows:
                if r is not None:
                    r.start += shift
            self._L = P
        first = len(self._order)          # the new rows take buffer rows [first, first + n)
        buf_rows = torch.arange(first, first + n, device=dev)
        src_t = torch.tensor(src, device=dev)
        for layer, player in zip(self._cache.layers, pcache.layers):
            layer.write_rows(buf_rows, player.keys.index_select(0, src_t), player.values.index_select(0, src_t),
                             self._L, self.slots)
        self._logits.index_copy_(0, torch.tensor(free[:n], device=dev), logits.float().index_select(0, src_t))
        for k, (slot, s, u) in enumerate(zip(free, new, src)):
            gen = torch.Generator(device=dev).manual_seed(int(s.seed))
            row = _Row(s, gen, self._L - int(s.prompt_ids.numel()), eng.version, slot, first + k)
            if routes is not None:
                row.routes.append(routes[u, P - row.prompt_len:])
            self._rows[slot] = row
            self._order.append(slot)

    def _draw(self) -> list[_Row]:
        """One token for every active row from its held logits; frees and returns the rows that finished."""
        act = [i for i, r in enumerate(self._rows) if r is not None]
        if not act:
            return []
        eng = self.engine
        idx = torch.tensor(act, device=self._logits.device)
        scores = eng._process_scores(self._logits.index_select(0, idx))
        logp = torch.log_softmax(scores.float(), dim=-1)
        V = logp.shape[-1]
        ahead = max(1, min(RACE_TOKENS, eng.max_new_tokens, RACE_ELEMENTS // V))
        race = torch.stack([self._rows[i].next_race(V, ahead) for i in act])
        x = torch.argmax(logp.double() - race.log(), dim=-1)
        lp = logp.gather(1, x.unsqueeze(1)).squeeze(1)
        bad = torch.isnan(logp).any(dim=-1)        # NaN or +inf scores, or no finite score: no distribution
        host = torch.stack([x.double(), lp.double(), bad.double()], 1).cpu().tolist()      # one transfer
        if any(b for _, _, b in host):
            rows = [self._rows[i].sample.key for i, (_, _, b) in zip(act, host) if b]
            raise NonFiniteError("generation", f"sampling probabilities (samples {rows[:4]})")
        done = []
        for i, (tok, l, _) in zip(act, host):
            r = self._rows[i]
            r.tokens.append(int(tok))
            r.logps.append(l)
            r.versions.append(r.score_version)
            if int(tok) == self.eos or len(r.tokens) >= eng.max_new_tokens:
                done.append(r)
        for r in done:
            self._release(r)
        return done

    def _release(self, r: _Row) -> None:
        """Free row ``r``'s slot; the last occupied buffer row moves into its buffer row (the occupied rows stay
        first)."""
        last = len(self._order) - 1
        if r.row != last:
            for layer in self._cache.layers:
                layer.move_row(last, r.row)
            moved = self._order[last]
            self._order[r.row] = moved
            self._rows[moved].row = r.row
        self._order.pop()
        self._rows[r.slot] = None

    def _decode(self) -> None:
        """One batched decode forward over the occupied rows (buffer rows ``[0, n)``) and
        ``min(free, free_rows)`` free ones fed a pad token that attends to itself only."""
        n = len(self._order)
        if n == 0:
            return
        eng = self.engine
        dev = self._logits.device
        self._make_room()
        L = self._L
        b = n + (self.slots - n if self.free_rows is None else min(self.slots - n, self.free_rows))
        starts, last, pos = [L] * b, [self.pad] * b, [0] * b
        for k, slot in enumerate(self._order):
            r = self._rows[slot]
            starts[k], last[k] = r.start, r.tokens[-1]
            pos[k] = r.prompt_len + len(r.tokens) - 1
        starts_t = torch.tensor(starts, device=dev)
        mask = (torch.arange(L + 1, device=dev).unsqueeze(0) >= starts_t.unsqueeze(1)).long()
        logits, routes = self._forward(input_ids=torch.tensor(last, device=dev).unsqueeze(1), attention_mask=mask,
                                       position_ids=torch.tensor(pos, device=dev).unsqueeze(1),
                                       **{cache_kwarg(eng.model): self._cache})
        self._L = L + 1
        self._logits.index_copy_(0, torch.tensor(self._order, device=dev), logits[:n].float())
        for k, slot in enumerate(self._order):
            r = self._rows[slot]
            r.score_version = eng.version
            if routes is not None:
                r.routes.append(routes[k])

    def _make_room(self) -> None:
        """Before a decode that would fill the buffers: drop the columns no running row attends to when that frees a
        quarter of the buffer (a trim copies the whole buffer: one that freed a column or two would come back at the
        next step); else let the layers' update grow the buffers (doubling)."""
        allocated = min(layer.allocated for layer in self._cache.layers)
        if self._L + 1 <= allocated:
            return
        m = min(self._rows[slot].start for slot in self._order)
        if m > 0 and 4 * m >= allocated:
            for layer in self._cache.layers:
                layer.trim_left(m)
            for slot in self._order:
                self._rows[slot].start -= m
            self._L -= m
            self.trims += 1
        else:
            self.grows += 1

    def _finish(self, r: _Row) -> FinishedSample:
        """The finished sample of row ``r`` as plain CPU tensors."""
        n = len(r.tokens)
        routes = None
        if r.routes:
            fed = torch.cat(r.routes, 0).long().cpu()                     # [p + n - 1, L_moe, K]
            routes = torch.cat([fed, torch.full_like(fed[:1], -1)], 0)      # the last token is never fed
            assert routes.shape[0] == r.prompt_len + n
        return FinishedSample(key=r.sample.key, prompt_ids=r.sample.prompt_ids,
                              response_ids=torch.tensor(r.tokens, dtype=torch.long),
                              behav_logp=torch.tensor(r.logps, dtype=torch.float32),
                              versions=torch.tensor(r.versions, dtype=torch.long), routes=routes)
