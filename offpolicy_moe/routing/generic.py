"""Generic routing rule, for every router without an adapter: each call runs inside a :class:`TopKIntercept`
planned by the pre-hook (tape, offsets, noise, replayed ids; a no-grad probe pass when selection and weights see
different logits), closed by the post-hook, which records the routes and swaps the unshifted logits back.
"""
from __future__ import annotations

import torch
from einops import rearrange

from .discovery import Slot
from .intercept import SelectionSeen, TopKIntercept
from .state import OWN_CHOICE, RouterBypassError, RoutingState

__all__ = ["GenericRule", "RouterBypassError"]


class GenericRule:
    """Router hooks of the generic rule (see module docstring), reading one :class:`RoutingState`."""

    def __init__(self, state: RoutingState):
        self.state = state
        self.modes: dict[int, TopKIntercept | None] = {}   # the intercept open for each MoE layer's current call

    def install(self, s: Slot) -> list:
        """Hook handles for slot ``s``: a pre-hook on the router (it fired) and pre/post hooks on its scope."""
        return [s.router.register_forward_pre_hook(self._fired(s.index)),
                s.scope.register_forward_pre_hook(self._scope_pre(s), with_kwargs=True),
                s.scope.register_forward_hook(self._scope_post(s), always_call=True)]

    def close(self) -> None:
        """Exit every intercept still open (hooks removed mid-forward, e.g. on an exception)."""
        for mode in self.modes.values():
            if mode is not None:
                mode.__exit__(None, None, None)
        self.modes.clear()

    def _fired(self, i: int):
        def pre(module, args):
            self.state.fired[i] = True
        return pre

    def _scope_pre(self, s: Slot):
        def pre(module, args, kwargs):
            h = args[0] if args else kwargs.get("hidden_states")
            n = h.numel() // h.shape[-1]
            b, sl = self.state.call_shape(s.index, h, n)
            if b * sl != n:
                raise ValueError(f"router of MoE layer {s.index} saw {n} tokens but its block saw [B, s] = "
                                 f"{(b, sl)}")
            mode = self._plan(s, module, args, kwargs, h, n, b, sl)
            self.modes[s.index] = mode
            if mode is not None:
                mode.__enter__()
        return pre

    def _plan(self, s: Slot, module, args, kwargs, h, n: int, b: int, sl: int) -> TopKIntercept | None:
        """The intercept of one call: the ids to force (tape, probe under a selection-only shift, replay) and the
        weights' logit shift."""
        st, e, k = self.state, s.num_experts, s.top_k
        if st.tape_replay is OWN_CHOICE:
            return None
        if st.recomputing:
            entry = st.tape_next()
            if entry is None:
                return TopKIntercept(n, e, k)
            idx, dw = entry
            return TopKIntercept(n, e, k, forced=idx, shift=dw)
        h2 = rearrange(h, "... h -> (...) h") if st.offsets is not None else None
        d_sel, d_w, _ = st.offset_shifts(s.index, h2)
        d_sel, d_w = st.with_noise(d_sel, d_w, n, e, h.device)
        forced = rows = None
        if d_sel is not None and d_sel is not d_w:  # selection and weights see different logits: probe first
            forced = self._probe(s, module, args, kwargs, n, d_sel).used
        rep = st.replayed(s.index, b, sl, h.device)
        if rep is not None:
            ids, rec = rep
            if forced is not None and rec is not None:
                forced = torch.where(rec[:, None], ids, forced)
            else:
                forced, rows = ids, rec
        mode = TopKIntercept(n, e, k, forced=forced, forced_rows=rows, shift=d_w)
        mode.bs = (b, sl)
        # forced ids alone: the intercept's own top-k already is the router's choice; a shift hides it
        if d_w is not None and (st.captures or any(r.which == "own" for r in st.recorders)):
            mode.own_probe = self._probe(s, module, args, kwargs, n, None)
        return mode

    def _probe(self, s: Slot, module, args, kwargs, n: int, shift) -> TopKIntercept:
        """Learn a selection by running the scope's forward once more, up to its top-k only (no experts when the
        scope is the whole block), without gradients, on copies of its tensor inputs (a router that scales its
        input in place, DBRX's jitter, scales it once) and with the random state the real call will see (the same
        jitter draw)."""
        probe = TopKIntercept(n, s.num_experts, s.top_k, shift=shift, stop=True)
        args, kwargs = _copied(args), _copied(kwargs)
        devices = sorted({a.device.index for a in (*args, *kwargs.values())
                          if isinstance(a, torch.Tensor) and a.is_cuda})
        with torch.no_grad(), torch.random.fork_rng(devices=devices), probe:
            try:
                module.forward(*args, **kwargs)
            except SelectionSeen:
                pass
        if probe.used is None:
            raise RouterBypassError(f"{type(module).__name__} ran no top-k over {s.num_experts} experts")
        return probe

    def _scope_post(self, s: Slot):
        def post(module, args, output):
            return self._finish(s, module, output)
        return post

    def _finish(self, s: Slot, module, output):
        """Close the call's intercept, hand its ids on, and restore the unshifted logits in the outputs."""
        st, i = self.state, s.index
        mode = self.modes.pop(i, None)
        if mode is None:
            return None
        mode.__exit__(None, None, None)
        if mode.used is None:
            raise RouterBypassError(f"{type(module).__name__} of MoE layer {i} ran no top-k over "
                                    f"{s.num_experts} experts with k={s.top_k}: its selection cannot be seen")
        if st.recomputing:
            return _swap_logits(output, mode)
        b, sl = mode.bs
        probe = mode.own_probe or mode
        st.observe(i, mode.used, probe.own, b, sl, mode.logits, probe.logits,
                   (mode.used.detach(), None if mode.shift is None else mode.shift.detach()) if mode.modified else None)
        return _swap_logits(output, mode)


def _copied(values):
    if isinstance(values, dict):
        return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in values.items()}
    return tuple(v.clone() if isinstance(v, torch.Tensor) else v for v in values)


def _swap_logits(output, mode: TopKIntercept):
    """Hand back the unshifted router logits where the router returned the shifted ones."""
    if mode.shifted is None or not isinstance(output, tuple):
        return None
    return tuple(mode.logits if o is mode.shifted else o for o in output)
