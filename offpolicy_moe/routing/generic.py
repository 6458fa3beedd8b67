"""Hooks of the generic routing rule: each router call runs inside a :class:`TopKIntercept`.

Mixed into :class:`RoutingController` (which owns the state these methods read: ``_replay``, ``_offsets``,
``_noise``, ``_recorders``, ``_captures``, ``_tape``/``_tape_replay``, ``_aux``, ``_shape``, ``_last_shape``,
``_modes``, ``_fired``). Per call: the pre-hook plans the call (checkpoint recompute tape, PR2 offsets, noise,
replayed ids; a no-grad probe pass when the selection and the weights see different logits, or when the router's
own choice is wanted under a shift) and opens the intercept; the post-hook (always called) closes it, records the
routes and swaps the unshifted logits back into the router's outputs.
"""
from __future__ import annotations

import torch

from .discovery import Slot
from .intercept import TopKIntercept

__all__ = ["GenericRuleHooks", "RouterBypassError"]

_OWN = object()  # recompute marker shared with the controller: every router uses its own choice


class RouterBypassError(RuntimeError):
    """An MoE block ran without calling its router (hub kernel / ``use_kernels``): hooks cannot see the routing."""


class GenericRuleHooks:
    """Router hooks of the generic rule (see module docstring)."""

    def _make_fired(self, i: int):
        def pre(module, args):
            self._fired[i] = True
        return pre

    def _make_scope_pre(self, s: Slot):
        """Open a :class:`TopKIntercept` for this call with the route to force and the logit shift to apply."""
        i = s.index

        def pre(module, args, kwargs):
            h = args[0] if args else kwargs.get("hidden_states")
            n = h.numel() // h.shape[-1]
            b, sl = self._call_shape(i, h, n)
            if b * sl != n:
                raise ValueError(f"router of MoE layer {i} saw {n} tokens but its block saw [B, s] = {(b, sl)}")
            mode = self._plan_call(s, module, args, kwargs, h, n, b, sl)
            self._modes[i] = mode
            if mode is not None:
                mode.__enter__()
        return pre

    def _call_shape(self, i: int, h: torch.Tensor, n: int) -> tuple[int, int]:
        """``[B, s]`` of this router call: the router input's own when 3-D, else its block's, else the forward's."""
        if h.dim() == 3:
            return int(h.shape[0]), int(h.shape[1])
        for shape in (self._shape.get(i), self._last_shape):
            if shape is not None and shape[0] * shape[1] == n:
                return shape
        return 1, n

    def _tape_next(self):
        """The next forward-time route of a checkpointed layer's recompute (gradient checkpointing replays exactly
        what the forward used); more router calls than the forward made is an error."""
        if self._tape_pos >= len(self._tape_replay):
            raise RuntimeError("gradient-checkpoint recompute called more routers than the forward did")
        entry = self._tape_replay[self._tape_pos]
        self._tape_pos += 1
        return entry

    def _plan_call(self, s: Slot, module, args, kwargs, h, n: int, b: int, sl: int) -> TopKIntercept | None:
        i, e, k = s.index, s.num_experts, s.top_k
        if self._tape_replay is _OWN:
            return None
        if self._tape_replay is not None:
            entry = self._tape_next()
            if entry is None:
                return TopKIntercept(n, e, k)
            idx, dw = entry
            return TopKIntercept(n, e, k, forced=idx, shift=dw)
        d_sel = d_w = None
        if self._offsets is not None:
            d_sel, d_w, _ = self._offsets.shifts(i, h.reshape(n, -1))
        if self._noise is not None:
            z = torch.randn((n, e), generator=self._noise.generator, dtype=torch.float32,
                            device=h.device if self._noise.generator is None else self._noise.generator.device)
            z = z.to(h.device) * self._noise.sigma
            d_sel = z if d_sel is None else d_sel + z
            d_w = z if d_w is None else d_w + z
        forced = rows = None
        if d_sel is not None and d_sel is not d_w:  # selection and weights see different logits: probe first
            forced = self._probe(s, module, args, kwargs, n, d_sel).used
        if self._replay is not None:
            rep, rec = self._replay.layer(i, b, sl, h.device)
            if forced is not None and rec is not None:
                forced = torch.where(rec[:, None], rep, forced)
            else:
                forced, rows = rep, rec
        mode = TopKIntercept(n, e, k, forced=forced, forced_rows=rows, shift=d_w)
        mode.bs = (b, sl)
        if mode.modified and (
                self._captures or any(r.which == "own" for r in self._recorders)):
            mode.own_probe = self._probe(s, module, args, kwargs, n, None)
        return mode

    def _probe(self, s: Slot, module, args, kwargs, n: int, shift) -> TopKIntercept:
        """Run the scope's forward once more without gradients (hooks bypassed) to learn a selection."""
        probe = TopKIntercept(n, s.num_experts, s.top_k, shift=shift)
        with torch.no_grad(), probe:
            module.forward(*args, **kwargs)
        if probe.used is None:
            raise RouterBypassError(f"{type(module).__name__} ran no top-k over {s.num_experts} experts")
        return probe

    def _make_scope_post(self, s: Slot):
        i = s.index

        def post(module, args, output):
            mode = self._modes.pop(i, None)
            if mode is None:
                return None
            mode.__exit__(None, None, None)
            if mode.used is None:
                raise RouterBypassError(f"{type(module).__name__} of MoE layer {i} ran no top-k over "
                                        f"{s.num_experts} experts with k={s.top_k}: its selection cannot be seen")
            if self._tape_replay is not None:
                return self._swap_logits(output, mode)
            b, sl = mode.bs
            own = mode.own if getattr(mode, "own_probe", None) is None else mode.own_probe.own
            for r in self._recorders:
                r._add(i, mode.used if r.which == "used" else own, b, sl)
            if self._aux is not None and mode.logits is not None:
                self._aux.append((mode.logits.reshape(mode.n, -1), mode.used))
            for c in self._captures:
                probe = mode.own_probe or mode
                c._add(i, probe.logits.reshape(mode.n, -1), own, b, sl)
            if self._tape is not None:
                self._tape.append((mode.used.detach(), None if mode.shift is None else mode.shift.detach())
                                  if mode.modified else None)
            return self._swap_logits(output, mode)
        return post

    @staticmethod
    def _swap_logits(output, mode: TopKIntercept):
        """Hand back the unshifted router logits where the router returned the shifted ones."""
        if mode.shifted is None or not isinstance(output, tuple):
            return None
        return tuple(mode.logits if o is mode.shifted else o for o in output)
