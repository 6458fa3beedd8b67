"""Generic routing rule: the router's own forward, with its expert selection intercepted at its top-k.

:class:`TopKIntercept` is a ``TorchFunctionMode`` open only while one router (or the MoE block holding the top-k)
runs: it shifts the first ``[N, E]`` linear/matmul output (the router logits), answers the expert ``torch.topk``
with the forced ids (values gathered from the scores, looking through a ``masked_fill`` group mask, as R3 gathers
from the full distribution) and remembers the router's own choice.  The weights, extra outputs and gradients then
come from the model's own code (docs/routing.md, "How a router is handled").
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["SelectionSeen", "TopKIntercept"]

_TOPK = {torch.topk, torch.Tensor.topk}
_LINEAR = {F.linear, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm, torch.Tensor.mm,
           torch.addmm, torch.bmm, torch.einsum}
_MASKED = {torch.masked_fill, torch.Tensor.masked_fill}


class SelectionSeen(Exception):
    """Raised by a probing :class:`TopKIntercept` (``stop=True``) once the selection is known: the rest of the
    forward (the experts, when the block holds the top-k) never runs."""


class TopKIntercept(TorchFunctionMode):
    """Intercept one router call's top-k over ``num_experts`` experts (see module docstring).

    ``forced``: ``[N, K]`` int64 ids to force (on the rows of ``forced_rows``, default all); ``shift``: float
    ``[N, E]`` added to the router logits; ``stop``: raise :class:`SelectionSeen` right after the expert top-k.

    After the call: ``logits`` (unshifted ``[N, E]`` or None), ``own`` (the real top-k ids of the last matching
    top-k, ``[N, K]``), ``used`` (the ids the rule went on with), ``shifted`` (the shifted tensor handed to the
    router, to swap back in its outputs).
    """

    def __init__(self, n: int, num_experts: int, top_k: int, forced: torch.Tensor | None = None,
                 forced_rows: torch.Tensor | None = None, shift: torch.Tensor | None = None, stop: bool = False):
        super().__init__()
        self.n, self.e, self.k = int(n), int(num_experts), int(top_k)
        self.forced, self.forced_rows, self.shift, self.stop = forced, forced_rows, shift, stop
        self.logits: torch.Tensor | None = None
        self.shifted: torch.Tensor | None = None
        self.own: torch.Tensor | None = None
        self.used: torch.Tensor | None = None
        self._unmasked: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.bs: tuple[int, int] = (1, self.n)  # [B, s] layout of the call, set by the controller
        self.modified = forced is not None or shift is not None
        self.own_probe: "TopKIntercept | None" = None  # unshifted, unforced pass that gives the router's own choice

    def _is_expert_topk(self, x, k, dim) -> bool:
        return (isinstance(x, torch.Tensor) and x.dim() >= 2 and int(k) == self.k and x.shape[-1] == self.e
                and x.numel() == self.n * self.e and dim in (-1, x.dim() - 1))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _TOPK:
            x = args[0]
            k = args[1] if len(args) > 1 else kwargs.get("k")
            dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
            if self._is_expert_topk(x, k, dim):
                return self._topk(func, x, args, kwargs)
        out = func(*args, **kwargs)
        if (self.logits is None and func in _LINEAR and isinstance(out, torch.Tensor) and out.is_floating_point()
                and out.dim() >= 2 and out.shape[-1] == self.e and out.numel() == self.n * self.e):
            self.logits = out
            if self.shift is not None:
                out = (out.float() + self.shift.reshape(out.shape).float()).to(out.dtype)
                self.shifted = out
        elif func in _MASKED and isinstance(out, torch.Tensor):
            self._unmasked[id(out)] = (out, args[0])
        return out

    def _source(self, x: torch.Tensor) -> torch.Tensor:
        while id(x) in self._unmasked and self._unmasked[id(x)][0] is x:
            x = self._unmasked[id(x)][1]
        return x

    def _topk(self, func, x, args, kwargs):
        real = func(*args, **kwargs)
        own = real[1].reshape(self.n, self.k)
        self.own = own
        if self.forced is None:
            self.used = own
            if self.stop:
                raise SelectionSeen
            return real
        forced = self.forced.to(own.device, own.dtype).reshape(self.n, self.k)
        if self.forced_rows is not None:
            forced = torch.where(self.forced_rows.to(own.device).reshape(self.n, 1), forced, own)
        idx = forced.reshape(x.shape[:-1] + (self.k,))
        values = self._source(x).gather(-1, idx)
        self.used = forced
        return torch.return_types.topk((values, idx))
