"""RoutingController: record, replay and shift the expert routing of a Hugging Face MoE model.

Hooks are installed when the first context opens and removed when the last one closes (also on exceptions); nothing
is patched at class level.  A router with a family adapter gets a forward hook that rewrites its output
(``AdapterRule``); any other router runs its own forward with its top-k intercepted (``GenericRule``).  A hook on
each MoE block gives the call's ``[B, s]`` and detects a block that bypasses its router (a hub kernel).  The contexts
(record, replay: R3 arXiv:2510.11370 / R2 arXiv:2507.18071, offsets: PR2 arXiv:2606.00395, logit noise, capture)
nest freely and set one :class:`~offpolicy_moe.routing.state.RoutingState`, which the rules read.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

from .adapter_rule import AdapterRule
from .adapters import UnsupportedRouterError
from .aux import load_balancing_loss
from .capture import Recorder, RouterCapture
from .checkpointing import checkpoint_contexts
from .discovery import Slot, discover_slots, hidden_size_of, parse_layer_id
from .generation import GenerateGuard, UnsupportedGenerationError, check_generate_kwargs
from .generic import GenericRule
from .pr2 import FeatureCache, PR2Predictors
from .state import ModelShape, NoisePlan, OffsetPlan, ReplayPlan, RouterBypassError, RoutingState
from .trace import RouteTrace, TraceValidationError

__all__ = ["RoutingController", "RouterBypassError", "UnsupportedGenerationError"]


class RoutingController:
    """Record / replay / offset the routing of a Hugging Face MoE model through router forward hooks.

    Router modules are the class named by ``model._can_record_outputs["router_logits"]``, else modules whose class
    name looks like a router. Unknown router -> :class:`UnsupportedRouterError` naming the class; no router (dense
    model) -> ValueError; a kernelized model (``use_kernels``) -> UnsupportedRouterError.

    ``layer_ids`` maps MoE-layer index -> decoder-layer index; ``unreplayed`` lists the routers left to themselves;
    ``shape`` is the frozen :class:`ModelShape`.
    """

    def __init__(self, model: nn.Module):
        self.model = model
        if getattr(model, "_use_kernels", False) or getattr(model, "use_kernels", False) is True:
            raise UnsupportedRouterError(
                "the model was kernelized (use_kernels=True): hub kernels replace MoE blocks and bypass the router, so "
                "routes cannot be recorded or replayed; load the model without use_kernels")
        self._slots, skipped = discover_slots(model)
        #: routers left to themselves, never recorded or replayed: ``(module name, router class)`` (DeepSeek-V4's
        #: hash-routed layers, whose experts are a function of the token id)
        self.unreplayed: tuple[tuple[str, str], ...] = skipped
        a = self._slots[0]
        for s in self._slots:
            if (s.num_experts, s.top_k) != (a.num_experts, a.top_k):
                raise UnsupportedRouterError(f"router {s.name} has (num_experts, top_k) = {(s.num_experts, s.top_k)} "
                                             f"but {a.name} has {(a.num_experts, a.top_k)}: mixed router shapes are "
                                             f"unsupported")
        self.num_experts, self.top_k = a.num_experts, a.top_k
        self.hidden_size = hidden_size_of(model, a.router)
        self.layer_ids: tuple[int, ...] = tuple(s.layer_id for s in self._slots)
        self.router_names: tuple[str, ...] = tuple(s.name for s in self._slots)
        self.families: tuple[str, ...] = tuple(sorted({s.adapter.family if s.adapter is not None else "generic"
                                                       for s in self._slots}))
        self.shape = ModelShape(self.num_experts, self.top_k, self.layer_ids)
        self.state = RoutingState(self.shape)
        self._adapter_rule = AdapterRule(self.state)
        self._generic_rule = GenericRule(self.state)
        self._guard = GenerateGuard(model, self.state)
        self._handles: list = []
        self._users = 0

    @property
    def unreplayed_layer_ids(self) -> tuple[int, ...]:
        """Decoder-layer indices of the routers in :attr:`unreplayed` (for ``RouteTrace.from_vllm`` /
        ``from_sglang`` on all-layer engine payloads, where those layers hold real expert ids)."""
        return tuple(parse_layer_id(name) for name, _ in self.unreplayed)

    @property
    def num_moe_layers(self) -> int:
        return len(self._slots)

    @property
    def routers(self) -> list[nn.Module]:
        return [s.router for s in self._slots]

    def _rule(self, s: Slot) -> AdapterRule | GenericRule:
        return self._adapter_rule if s.adapter is not None else self._generic_rule

    # ------------------------------------------------------------------------------------------ hook life
    @property
    def active(self) -> bool:
        """True while hooks are installed."""
        return bool(self._handles)

    def _acquire(self) -> None:
        if self._users == 0:
            try:
                self._handles.append(self.model.register_forward_pre_hook(self._model_pre, with_kwargs=True))
                for s in self._slots:
                    self._handles.append(s.block.register_forward_pre_hook(self._block_pre(s.index),
                                                                           with_kwargs=True))
                    self._handles.append(s.block.register_forward_hook(self._block_post(s)))
                    self._handles.extend(self._rule(s).install(s))
            except Exception:
                self._remove_hooks()
                raise
        self._users += 1

    def _release(self) -> None:
        self._users -= 1
        if self._users == 0:
            self._remove_hooks()

    def _remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._generic_rule.close()
        self.state.clear_forward()

    @contextlib.contextmanager
    def _session(self):
        self._acquire()
        try:
            yield
        finally:
            self._release()

    @contextlib.contextmanager
    def _setting(self, name: str, value, context: str, guard: bool = False):
        """Hooks on while the block runs, with ``state.<name> = value`` (None again after); contexts of one kind do
        not nest. ``guard``: ``model.generate`` refuses what cannot be recorded (``routing/generation.py``)."""
        if getattr(self.state, name) is not None:
            raise RuntimeError(f"{context} contexts cannot be nested")
        with self._session(), self._guard() if guard else contextlib.nullcontext():
            setattr(self.state, name, value)
            try:
                yield value
            finally:
                setattr(self.state, name, None)

    @contextlib.contextmanager
    def _joining(self, name: str, member, guard: bool = False):
        """Hooks on while the block runs, with ``member`` in the list ``state.<name>`` (recorders, captures)."""
        with self._session(), self._guard() if guard else contextlib.nullcontext():
            getattr(self.state, name).append(member)
            try:
                yield member
            finally:
                getattr(self.state, name).remove(member)

    def _block_pre(self, i: int):
        state = self.state

        def pre(module, args, kwargs=None):
            x = args[0] if args else None
            if x is None and kwargs:
                x = kwargs.get("hidden_states")
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"MoE block of layer {i} was called without a hidden_states tensor")
            if x.dim() == 3:
                state.block_shape[i] = state.last_shape = (int(x.shape[0]), int(x.shape[1]))
            else:  # a block fed flattened tokens: the batch layout of the last 3-D block call, when it fits
                n = x.numel() // x.shape[-1]
                last = state.last_shape
                state.block_shape[i] = last if last is not None and last[0] * last[1] == n else (1, n)
            state.fired[i] = False
            return None
        return pre

    def _block_post(self, s: Slot):
        state = self.state

        def post(module, args, output):
            if not state.fired.get(s.index, True):
                raise RouterBypassError(f"MoE block {s.name.rsplit('.', 1)[0]} ({type(s.block).__name__}) ran without "
                                        f"calling its router {type(s.router).__name__}: a hub kernel or replaced "
                                        f"forward bypasses routing, so it cannot be recorded or replayed")
            return None
        return post

    def _model_pre(self, module, args, kwargs):
        """Model-level pre-hook: the batch layout of this forward, the token check of a replayed trace, and the
        token ids recorders tie their routes to."""
        state = self.state
        ids = args[0] if args and isinstance(args[0], torch.Tensor) else kwargs.get("input_ids")
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
            emb = kwargs.get("inputs_embeds")
            state.last_shape = tuple(int(d) for d in emb.shape[:2]) if isinstance(emb, torch.Tensor) else None
            for r in state.recorders:
                r.untie_tokens()
            return None
        state.last_shape = (int(ids.shape[0]), int(ids.shape[1]))
        if state.replay is not None and state.replay.trace.tokens is not None and not state.recomputing:
            state.replay.trace.check_tokens(ids)
        for r in state.recorders:
            r.add_tokens(ids)
        return None

    def load_balancing_loss(self, token_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Aux loss ``E * sum_e f_e P_e`` (``routing/aux.py``) of the experts actually used in the router calls since
        the last call (under ``replay(aux_from_used=True)``), pooled over MoE layers; ``token_mask[B, S]`` marks the
        real tokens (applied to calls laid out ``[B, S]``). Consumes the stored calls."""
        if not self.state.aux:
            raise RuntimeError("no router calls stored: run the forward inside `with ctl.replay(trace):` "
                               "(aux_from_used=True) before load_balancing_loss()")
        entries, self.state.aux[:] = list(self.state.aux), []
        masks = None
        if token_mask is not None:
            flat = token_mask.reshape(-1).bool()
            masks = [flat if flat.numel() == lg.shape[0] else None for lg, _ in entries]
        return load_balancing_loss([e[0] for e in entries], [e[1] for e in entries], self.num_experts, masks)

    # ------------------------------------------------------------------------------------------- contexts
    @contextlib.contextmanager
    def record(self, which: str = "used") -> Iterator[Recorder]:
        """Record routes while the block runs: ``with ctl.record() as rec: out = model.generate(...)``.

        ``which="used"``: the ids the experts actually received (after replay/offsets/noise); ``"own"``: the
        router's native top-k. Inside the block ``model.generate`` refuses beam search, assisted decoding and
        ``use_cache=False``. One generate (or one forward / chunked forwards of the same batch) per block.
        """
        if which not in ("used", "own"):
            raise ValueError(f"which must be 'used' or 'own', got {which!r}")
        with self._joining("recorders", Recorder(self.shape, which), guard=True) as rec:
            yield rec

    @contextlib.contextmanager
    def replay(self, trace: RouteTrace, validate: bool = True, aux_from_used: bool = True) -> Iterator[None]:
        """Force the selection to ``trace`` (R3 / R2) where recorded; the router's own choice on sentinel rows.

        The trace must be laid out exactly like the forward's ``input_ids`` ``[B, S]``; a trace tied to its tokens is
        checked against them (:meth:`RouteTrace.check_tokens`). Weights come from the current router's logits with the
        model's rule, gathered from the full distribution; router gradients flow. ``validate`` checks ids range,
        duplicates, partial rows and all-zero layers first (not the missing fraction:
        ``trace.validate(max_missing=...)``).

        ``aux_from_used``: keep each router call's logits and the ids used, for :meth:`load_balancing_loss`
        (transformers' own ``aux_loss`` re-derives the router's top-k, i.e. balances experts that did not run).
        """
        if not isinstance(trace, RouteTrace):
            raise TypeError(f"replay expects a RouteTrace, got {type(trace).__name__}")
        got = (trace.num_layers, trace.num_experts, trace.top_k)
        want = (self.num_moe_layers, self.num_experts, self.top_k)
        if got != want:
            raise TraceValidationError(f"trace has (L_moe, num_experts, top_k) = {got} but the model has {want}")
        if trace.layer_ids != self.layer_ids:
            raise TraceValidationError(f"trace layer_ids {trace.layer_ids} differ from the model's {self.layer_ids}")
        if validate:
            trace.validate(max_missing=1.0)
        with self._setting("replay", ReplayPlan(trace), "replay"):
            self.state.aux = [] if aux_from_used else None
            yield

    @contextlib.contextmanager
    def offsets(self, predictors: PR2Predictors, in_weights: bool = True,
                feature_cache: FeatureCache | None = None, fixed: PR2Predictors | None = None) -> Iterator[None]:
        """PR2 rollout: select on ``logits + predictors(layer, h)``; weights too when ``in_weights`` (paper default).

        With ``feature_cache`` the router inputs and (unshifted) logits of a sample of sequences are stored, and
        ``model.generate`` is guarded as in :meth:`record`. ``fixed`` stands for a change of the router itself
        (``routing/perturb.py``): ``f = fixed(layer, h)`` enters the selection AND the weights whatever ``in_weights``
        says, and the feature cache stores ``logits + f``.
        """
        for name, mod in (("predictors", predictors),) + ((("fixed", fixed),) if fixed is not None else ()):
            if not isinstance(mod, PR2Predictors):
                raise TypeError(f"offsets expects PR2Predictors, got {type(mod).__name__} ({name})")
            if (mod.num_layers, mod.num_experts, mod.hidden_size) != (
                    self.num_moe_layers, self.num_experts, self.hidden_size):
                raise ValueError(f"{name} have (L, E, H) = {(mod.num_layers, mod.num_experts, mod.hidden_size)}"
                                 f" but the model has {(self.num_moe_layers, self.num_experts, self.hidden_size)}")
        if feature_cache is not None and feature_cache.has_data and self.state.offsets is None:
            raise ValueError("feature_cache already holds features: call cache.reset() or use a new FeatureCache")
        with self._setting("offsets", OffsetPlan(predictors, in_weights, feature_cache, fixed), "offsets",
                           guard=feature_cache is not None):
            yield

    @contextlib.contextmanager
    def logit_noise(self, sigma: float, generator: torch.Generator | None = None) -> Iterator[None]:
        """Add ``N(0, sigma^2)`` to the router logits for selection and weights (engine-side mismatch knob);
        ``generator`` must live on the model's device."""
        if not (sigma >= 0.0):
            raise ValueError(f"sigma must be >= 0, got {sigma}")
        with self._setting("noise", NoisePlan(float(sigma), generator), "logit_noise"):
            yield

    @contextlib.contextmanager
    def capture_router_logits(self, positions) -> Iterator[RouterCapture]:
        """Capture detached router logits ``[M, L, E]`` and the router's own top-k ``[M, L, K]`` at tokens.

        ``positions``: ``(batch_index[M], position[M])`` or a :class:`PR2Features`, laid out like the forward's
        ``input_ids``; PR2's update forward uses it under ``replay``.
        """
        if hasattr(positions, "positions"):
            positions = positions.positions()
        bi, pos = positions
        with self._joining("captures", RouterCapture(self.shape, torch.as_tensor(bi), torch.as_tensor(pos))) as cap:
            yield cap

    # ------------------------------------------------------------------------------ gradient checkpointing
    def checkpoint_context_fn(self):
        """``context_fn`` for ``torch.utils.checkpoint.checkpoint`` (non-reentrant): the recompute during
        ``backward()`` uses exactly the forward's routes, even after the ``with`` block closed
        (``routing/checkpointing.py``)."""
        return checkpoint_contexts(self.state, lambda: self.active, self._acquire, self._release)

    def enable_gradient_checkpointing(self, model: nn.Module | None = None) -> None:
        """Turn on HF activation checkpointing (non-reentrant) with :meth:`checkpoint_context_fn`."""
        model = self.model if model is None else model
        kwargs = {"use_reentrant": False, "context_fn": self.checkpoint_context_fn}
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)

    # ---------------------------------------------------------------------------------------- helpers
    def generate(self, model: nn.Module | None = None, **kwargs):
        """``model.generate(**kwargs)`` after refusing the modes whose routes cannot be recorded (beam search,
        assisted decoding, ``use_cache=False``: ``routing.generation.check_generate_kwargs``)."""
        model = self.model if model is None else model
        check_generate_kwargs(model, kwargs)
        return model.generate(**kwargs)
