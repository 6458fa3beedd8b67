"""The routing state a :class:`~offpolicy_moe.routing.controller.RoutingController` owns, made explicit: what its
contexts switch on and off and what a forward's hooks learn on the way.  The two routing rules receive this object;
recorders and captures receive only the frozen :class:`ModelShape`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from einops import rearrange

from .pr2 import FeatureCache, PR2Predictors
from .trace import RouteTrace

__all__ = ["ModelShape", "ReplayPlan", "OffsetPlan", "NoisePlan", "RoutingState", "RouterBypassError",
           "OWN_CHOICE"]

#: ``RoutingState.tape_replay`` marker of a checkpoint recompute whose forward ran without hooks: every router uses
#: its own choice
OWN_CHOICE = object()


class RouterBypassError(RuntimeError):
    """An MoE block ran without calling its router (hub kernel / ``use_kernels``): hooks cannot see the routing."""


@dataclass(frozen=True)
class ModelShape:
    """What a route trace of this model looks like: ``E`` experts, ``K`` per token, the decoder-layer index of each
    MoE layer."""

    num_experts: int
    top_k: int
    layer_ids: tuple[int, ...]

    @property
    def num_moe_layers(self) -> int:
        return len(self.layer_ids)


@dataclass
class ReplayPlan:
    """The trace a ``replay`` context forces, cached per device as int64 ids and recorded-row flags."""

    trace: RouteTrace
    by_device: dict = field(default_factory=dict)

    def rows(self, device) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(ids[B, S, L, K] int64, recorded[B, S] bool or None when every row is recorded)`` on ``device``."""
        key = str(device)
        if key not in self.by_device:
            t = self.trace.to(device)
            rec = t.recorded_mask()
            self.by_device[key] = (t.ids.long(), None if bool(rec.all()) else rec)
        return self.by_device[key]

    def layer(self, i: int, b: int, s: int, device) -> tuple[torch.Tensor, torch.Tensor | None]:
        """MoE layer ``i``'s replayed ids ``[B*s, K]`` and recorded flags ``[B*s]`` (None: all recorded) for a router
        call that saw ``[B, s] = (b, s)`` tokens; a trace laid out differently is a ``ValueError``."""
        ids, rec = self.rows(device)
        if tuple(ids.shape[:2]) != (b, s):
            raise ValueError(f"replay trace has [B, S] = {tuple(ids.shape[:2])} but the forward's MoE layer {i} saw "
                             f"[B, s] = {(b, s)}: lay the trace out exactly like the input_ids")
        flat_rec = None if rec is None else rearrange(rec, "b s -> (b s)")
        return rearrange(ids[:, :, i], "b s k -> (b s) k"), flat_rec


@dataclass
class OffsetPlan:
    """PR2 offsets (``predictors``), optionally a fixed router-weight perturbation (``fixed``) and a feature cache."""

    predictors: PR2Predictors
    in_weights: bool
    feature_cache: FeatureCache | None
    fixed: PR2Predictors | None = None

    def shifts(self, layer: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """``(d_sel, d_w, f)`` for router inputs ``h[N, H]`` of MoE layer ``layer``, float32 ``[N, E]``:
        ``d_sel = p + f`` (selection), ``d_w = p + f`` when ``in_weights`` else ``f`` (gating weights), with
        ``p = predictors(layer, h)`` and ``f = fixed(layer, h)`` (None without ``fixed``)."""
        with torch.no_grad():
            d = self.predictors(layer, h).float()
            f = None if self.fixed is None else self.fixed(layer, h).float()
        d_sel = d if f is None else d + f
        return d_sel, (d_sel if self.in_weights else f), f


@dataclass
class NoisePlan:
    """Gaussian logit noise ``N(0, sigma^2)`` drawn from ``generator`` (the default generator when None)."""

    sigma: float
    generator: torch.Generator | None

    def draw(self, shape, device) -> torch.Tensor:
        """``sigma * z``, ``z ~ N(0, 1)`` float32 of ``shape`` on ``device`` (drawn on the generator's device)."""
        z = torch.randn(shape, generator=self.generator, dtype=torch.float32,
                        device=device if self.generator is None else self.generator.device)
        return z.to(device) * self.sigma


@dataclass
class RoutingState:
    """Everything the routing rules read and write during a forward (see the module docstring).

    Context state (set by the controller's contexts): ``replay``, ``offsets``, ``noise``, ``recorders``,
    ``captures``, ``aux`` (router calls kept for the used-experts aux loss), ``tape`` (routes used inside a
    checkpointed layer, in call order), ``tape_replay``/``tape_pos`` (the recompute of one). Forward state (set by the
    hooks): ``block_shape`` (``[B, s]`` each MoE block saw), ``fired`` (whether its router ran), ``last_shape`` (the
    ``[B, S]`` of the last 3-D call)."""

    shape: ModelShape
    replay: ReplayPlan | None = None
    offsets: OffsetPlan | None = None
    noise: NoisePlan | None = None
    recorders: list = field(default_factory=list)
    captures: list = field(default_factory=list)
    aux: list | None = None
    tape: list | None = None
    tape_replay: object = None
    tape_pos: int = 0
    block_shape: dict[int, tuple[int, int]] = field(default_factory=dict)
    fired: dict[int, bool] = field(default_factory=dict)
    last_shape: tuple[int, int] | None = None

    def clear_forward(self) -> None:
        """Forget what the hooks learned (when the hooks are removed)."""
        self.block_shape.clear()
        self.fired.clear()

    @property
    def recomputing(self) -> bool:
        """Inside the recompute of a checkpointed layer: routers use the tape, nothing is recorded."""
        return self.tape_replay is not None

    def tape_next(self):
        """The next forward-time route of a checkpointed layer's recompute (gradient checkpointing replays exactly
        what the forward used); more router calls than the forward made is an error."""
        if self.tape_pos >= len(self.tape_replay):
            raise RuntimeError("gradient-checkpoint recompute called more routers than the forward did")
        entry = self.tape_replay[self.tape_pos]
        self.tape_pos += 1
        return entry

    def call_shape(self, i: int, h: torch.Tensor, n: int) -> tuple[int, int]:
        """``[B, s]`` of a router call on ``n`` tokens: the router input's own when 3-D, else its block's, else the
        forward's, else ``(1, n)``."""
        if h.dim() == 3:
            return int(h.shape[0]), int(h.shape[1])
        for shape in (self.block_shape.get(i), self.last_shape):
            if shape is not None and shape[0] * shape[1] == n:
                return shape
        return 1, n

    def offset_shifts(self, i: int, h: torch.Tensor | None
                      ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """``(d_sel, d_w, f)`` of the PR2 offsets for MoE layer ``i``'s router inputs ``h[N, H]`` (see
        :meth:`OffsetPlan.shifts`); all None outside ``offsets``."""
        if self.offsets is None:
            return None, None, None
        return self.offsets.shifts(i, h)

    def with_noise(self, d_sel: torch.Tensor | None, d_w: torch.Tensor | None, n: int, num_experts: int, device
                   ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The selection and weight shifts plus one draw of the logit noise ``[n, E]`` (unchanged outside
        ``logit_noise``)."""
        if self.noise is None:
            return d_sel, d_w
        z = self.noise.draw((n, num_experts), device)
        return (z if d_sel is None else d_sel + z), (z if d_w is None else d_w + z)

    def replayed(self, i: int, b: int, s: int, device) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """MoE layer ``i``'s replayed ids and recorded rows for a ``[b, s]`` call, or None outside ``replay``."""
        return None if self.replay is None else self.replay.layer(i, b, s, device)

    def observe(self, i: int, used: torch.Tensor, own: torch.Tensor, b: int, s: int, logits: torch.Tensor | None,
                own_logits: torch.Tensor | None, taped) -> None:
        """Hand one router call of MoE layer ``i`` on; ids ``[b*s, K]``: ``used`` and the router's ``own`` to the
        recorders, ``(logits, used)`` to the aux-loss store, the unshifted ``own_logits`` and ``own`` to the captures,
        ``taped`` (the route and weight shift, or None: the router's own) to the checkpoint tape."""
        for r in self.recorders:
            r.add(i, used if r.which == "used" else own, b, s)
        if self.aux is not None and logits is not None:
            self.aux.append((rearrange(logits, "... e -> (...) e"), used))
        for c in self.captures:
            c.add(i, rearrange(own_logits, "... e -> (...) e"), own, b, s)
        if self.tape is not None:
            self.tape.append(taped)
