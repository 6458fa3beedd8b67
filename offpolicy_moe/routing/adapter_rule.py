"""Adapter rule: a router forward hook that rewrites ``(logits, weights, indices)`` with the family adapter.

Per call the selection is the router's own top-k, or re-derived on shifted logits (PR2 offsets, noise), then forced
to the replayed ids where recorded; the weights are recomputed with ``adapter.weights`` from the (shifted) logits at
the ids used, gathered from the full distribution (R3, arXiv:2510.11370, section 3).
"""
from __future__ import annotations

import torch
from einops import rearrange

from .adapters import UnsupportedRouterError
from .discovery import Slot
from .state import OWN_CHOICE, RoutingState

__all__ = ["AdapterRule"]


class AdapterRule:
    """The router hook of adapter families, reading one :class:`RoutingState`."""

    def __init__(self, state: RoutingState):
        self.state = state

    def install(self, s: Slot) -> list:
        """Hook handles for slot ``s``: one forward hook on its router."""
        return [s.router.register_forward_hook(self._hook(s))]

    def close(self) -> None:
        """Nothing stays open between calls."""

    def _hook(self, s: Slot):
        def hook(module, args, output):
            return self.call(s, args, output)
        return hook

    def call(self, s: Slot, args, output):
        """The rewritten router output of one call, or None to keep the router's own."""
        st = self.state
        st.fired[s.index] = True
        if not isinstance(output, tuple) or len(output) < 3:
            raise UnsupportedRouterError(f"router {type(s.router).__name__} did not return (logits, weights, "
                                         f"indices)")
        logits, own = output[0], output[2]
        n = logits.shape[0]
        b, sl = st.block_shape.get(s.index, (1, n))
        if b * sl != n:
            raise ValueError(f"router of MoE layer {s.index} saw {n} tokens but its block saw [B, s] = {(b, sl)}")
        if st.tape_replay is OWN_CHOICE:
            return None
        if st.recomputing:
            return self._recompute(s, logits, output)
        h = rearrange(args[0], "... h -> (...) h") if args and st.offsets is not None else None
        d_sel, d_w, f = st.offset_shifts(s.index, h)
        if st.offsets is not None and st.offsets.feature_cache is not None:   # engine's logits: with the fixed shift
            lf = logits if f is None else (logits.detach().float() + f).to(logits.dtype)
            st.offsets.feature_cache.add(s.index, h, lf, b, sl)
        d_sel, d_w = st.with_noise(d_sel, d_w, n, logits.shape[-1], logits.device)
        idx = own
        if d_sel is not None:
            idx = s.adapter.select(s.router, (logits.detach().float() + d_sel).to(logits.dtype))
        rep = st.replayed(s.index, b, sl, logits.device)
        if rep is not None:
            ids, rec = rep
            idx = ids if rec is None else torch.where(rec[:, None], ids, idx)
        modified = d_sel is not None or rep is not None
        st.observe(s.index, idx, own, b, sl, logits, logits,
                   (idx.detach(), None if d_w is None else d_w.detach()) if modified else None)
        return _rewritten(s, output, idx, d_w) if modified else None

    def _recompute(self, s: Slot, logits: torch.Tensor, output):
        """Recompute of a checkpointed layer: exactly the forward-time route (None: the router's own)."""
        entry = self.state.tape_next()
        return None if entry is None else _rewritten(s, output, *entry)


def _rewritten(s: Slot, output, idx: torch.Tensor, d_w: torch.Tensor | None) -> tuple:
    """The router output with ids ``idx`` and the family's weights at them from the logits shifted by ``d_w``."""
    logits = output[0]
    lw = logits if d_w is None else (logits.float() + d_w).to(logits.dtype)
    return (logits, s.adapter.weights(s.router, lw, idx), idx) + tuple(output[3:])
