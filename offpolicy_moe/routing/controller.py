"""RoutingController: record, replay and shift the expert routing of a Hugging Face MoE model.

Mechanism: one forward hook per router module rewrites the router's output tuple
``(logits, weights, indices)`` (transformers 5.x contract), plus a pre-/post-hook on the router's parent MoE block
(the block sees ``hidden[B, s, H]``, which gives each call's batch and sequence shape, and lets us detect a block
whose forward bypasses the router, e.g. a hub kernel). Hooks are installed when the first context opens and removed
when the last one closes, also on exceptions. Nothing is patched at class level.

Contexts (they nest freely; state is plain attributes, so autograd threads see it):
  * ``record(which="used")``: routes actually used (after replay/offsets/noise), or ``which="own"``: the router's
    native top-k. ``rec.trace()`` -> :class:`RouteTrace` aligned with ``generate``'s ``sequences`` (last row "not
    recorded": that token is never fed back) or with a forward's ``input_ids``.
  * ``replay(trace)``: R3 (arXiv:2510.11370) / R2 (arXiv:2507.18071): selection forced to the trace where
    recorded; weights recomputed from the training router's logits with the model's own rule, gathered from the
    full distribution; router gradients flow.
  * ``offsets(predictors, in_weights=True, feature_cache=None, fixed=None)``: PR2 rollout (arXiv:2606.00395):
    selection on ``logits + h W_p`` (and weights too when ``in_weights``); ``fixed``: a fixed router-weight
    perturbation ``h dW^T`` (``routing/perturb.py``) added to selection, weights and the cached logits.
  * ``logit_noise(sigma)``: Gaussian noise on the router logits (selection and weights): a controllable
    engine/trainer mismatch.
  * ``capture_router_logits(positions)``: detached router logits and the router's own top-k at given tokens
    (PR2 predictor targets).
Gradient checkpointing: pass ``context_fn=ctl.checkpoint_context_fn`` (non-reentrant) or call
``ctl.enable_gradient_checkpointing()``: every router call inside a checkpointed layer stores the route it used
(and the logit shift of the weights), and the recompute in backward uses exactly those, so gradients are exact
even after the ``with`` block closed.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch import nn

from .adapters import RouterAdapter, UnsupportedRouterError
from .aux import load_balancing_loss
from .capture import Recorder, RouterCapture
from .discovery import Slot, discover_slots, hidden_size_of
from .generic import _OWN, GenericRuleHooks, RouterBypassError
from .intercept import TopKIntercept
from .pr2 import FeatureCache, PR2Predictors
from .trace import RouteTrace, TraceValidationError

__all__ = ["RoutingController", "RouterBypassError", "UnsupportedGenerationError"]



class UnsupportedGenerationError(ValueError):
    """A generation mode whose routes cannot be recorded faithfully (beam search, assisted decoding, no cache)."""



@dataclass
class _Replay:
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
        return ids[:, :, i].reshape(b * s, -1), (None if rec is None else rec.reshape(b * s))


@dataclass
class _Offsets:
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
class _Noise:
    sigma: float
    generator: torch.Generator | None


class RoutingController(GenericRuleHooks):
    """Record / replay / offset the routing of a Hugging Face MoE model through router forward hooks.

    ``RoutingController(model)`` discovers every router module (the class named by
    ``model._can_record_outputs["router_logits"]``, else modules whose class name looks like a router) and its
    family adapter. Unknown router -> :class:`UnsupportedRouterError` naming the class; no router (dense model) ->
    ValueError; a kernelized model (``use_kernels``) -> UnsupportedRouterError.

    Attributes: ``num_moe_layers``, ``num_experts``, ``top_k``, ``hidden_size``, ``layer_ids`` (MoE-layer index ->
    decoder-layer index), ``router_names``.
    """

    def __init__(self, model: nn.Module):
        self.model = model
        if getattr(model, "_use_kernels", False) or getattr(model, "use_kernels", False) is True:
            raise UnsupportedRouterError(
                "the model was kernelized (use_kernels=True): hub kernels replace MoE blocks and bypass the router, so "
                "routes cannot be recorded or replayed; load the model without use_kernels")
        self._slots, skipped = self._discover(model)
        #: routers left to themselves, never recorded or replayed: ``(module name, router class)`` (DeepSeek-V4's
        #: hash-routed layers, whose experts are a function of the token id)
        self.unreplayed: tuple[tuple[str, str], ...] = skipped
        a = self._slots[0]
        self.num_experts, self.top_k = a.num_experts, a.top_k
        for s in self._slots:
            ek = (s.num_experts, s.top_k)
            if ek != (self.num_experts, self.top_k):
                raise UnsupportedRouterError(f"router {s.name} has (num_experts, top_k) = {ek} but {a.name} has "
                                             f"{(self.num_experts, self.top_k)}: mixed router shapes are unsupported")
        self.hidden_size = hidden_size_of(model, a.router)
        self.layer_ids: tuple[int, ...] = tuple(s.layer_id for s in self._slots)
        self.router_names: tuple[str, ...] = tuple(s.name for s in self._slots)
        self.families: tuple[str, ...] = tuple(sorted({s.adapter.family if s.adapter is not None else "generic"
                                                       for s in self._slots}))
        # mutable state, only changed inside context managers
        self._handles: list = []
        self._users = 0
        self._replay: _Replay | None = None
        self._offsets: _Offsets | None = None
        self._noise: _Noise | None = None
        self._recorders: list[Recorder] = []
        self._captures: list[RouterCapture] = []
        self._tape: list | None = None  # forward of a checkpointed layer: routes used, in call order
        self._tape_replay: list | None = None  # recompute of a checkpointed layer
        self._tape_pos = 0
        self._shape: dict[int, tuple[int, int]] = {}
        self._fired: dict[int, bool] = {}
        self._modes: dict[int, TopKIntercept] = {}
        self._last_shape: tuple[int, int] | None = None
        self._aux: list | None = None  # (logits, used ids) of each router call under replay(aux_from_used=True)
        self._gen_guard_users = 0
        self._had_generate_attr = False
        self._orig_generate: Any = None

    # ------------------------------------------------------------------------------------------- discovery
    _discover = staticmethod(discover_slots)

    @property
    def num_moe_layers(self) -> int:
        return len(self._slots)

    @property
    def routers(self) -> list[nn.Module]:
        return [s.router for s in self._slots]

    def adapter(self, layer: int) -> RouterAdapter:
        """Family adapter of MoE layer ``layer``."""
        return self._slots[layer].adapter

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
                    self._handles.append(s.block.register_forward_pre_hook(self._make_block_pre(s.index), with_kwargs=True))
                    self._handles.append(s.block.register_forward_hook(self._make_block_post(s)))
                    if s.adapter is not None:
                        self._handles.append(s.router.register_forward_hook(self._make_router_hook(s)))
                        continue
                    self._handles.append(s.router.register_forward_pre_hook(self._make_fired(s.index)))
                    self._handles.append(s.scope.register_forward_pre_hook(self._make_scope_pre(s),
                                                                           with_kwargs=True))
                    self._handles.append(s.scope.register_forward_hook(self._make_scope_post(s), always_call=True))
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
        for mode in self._modes.values():
            if mode is not None:
                mode.__exit__(None, None, None)
        self._modes.clear()
        self._shape.clear()
        self._fired.clear()

    @contextlib.contextmanager
    def _session(self):
        self._acquire()
        try:
            yield
        finally:
            self._release()

    def _make_block_pre(self, i: int):
        def pre(module, args, kwargs=None):
            x = args[0] if args else None
            if x is None and kwargs:
                x = kwargs.get("hidden_states")
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"MoE block of layer {i} was called without a hidden_states tensor")
            if x.dim() == 3:
                self._shape[i] = self._last_shape = (int(x.shape[0]), int(x.shape[1]))
            else:  # a block fed flattened tokens: the batch layout of the last 3-D block call, when it fits
                n = int(x.reshape(-1, x.shape[-1]).shape[0])
                last = self._last_shape
                self._shape[i] = last if last is not None and last[0] * last[1] == n else (1, n)
            self._fired[i] = False
            return None
        return pre

    def _make_block_post(self, s: Slot):
        def post(module, args, output):
            if not self._fired.get(s.index, True):
                raise RouterBypassError(f"MoE block {s.name.rsplit('.', 1)[0]} ({type(s.block).__name__}) ran without "
                                        f"calling its router {type(s.router).__name__}: a hub kernel or replaced "
                                        f"forward bypasses routing, so it cannot be recorded or replayed")
            return None
        return post

    # -------------------------------------------------------------------------------------------- the hook
    def _make_router_hook(self, s: Slot):
        i, ad, router = s.index, s.adapter, s.router

        def hook(module, args, output):
            self._fired[i] = True
            if not isinstance(output, tuple) or len(output) < 3:
                raise UnsupportedRouterError(f"router {type(module).__name__} did not return (logits, weights, "
                                             f"indices)")
            logits, w_own, own = output[0], output[1], output[2]
            n = logits.shape[0]
            b, sl = self._shape.get(i, (1, n))
            if b * sl != n:
                raise ValueError(f"router of MoE layer {i} saw {n} tokens but its block saw [B, s] = {(b, sl)}")
            # ---- recompute of a checkpointed layer: use exactly the forward-time routes
            if self._tape_replay is _OWN:
                return None
            if self._tape_replay is not None:
                entry = self._tape_next()
                if entry is None:
                    return None
                idx, dw = entry
                lw = logits if dw is None else (logits.float() + dw).to(logits.dtype)
                return (logits, ad.weights(router, lw, idx), idx) + tuple(output[3:])
            # ---- normal forward
            h = args[0] if args else None
            d_sel = d_w = None
            if self._offsets is not None:
                d_sel, d_w, f = self._offsets.shifts(i, h.reshape(n, -1))
                if self._offsets.feature_cache is not None:      # the engine's logits: with the fixed shift
                    lf = logits if f is None else (logits.detach().float() + f).to(logits.dtype)
                    self._offsets.feature_cache.add(i, h.reshape(n, -1), lf, b, sl)
            if self._noise is not None:
                z = torch.randn(logits.shape, generator=self._noise.generator, dtype=torch.float32,
                                device=logits.device if self._noise.generator is None else self._noise.generator.device)
                z = z.to(logits.device) * self._noise.sigma
                d_sel = z if d_sel is None else d_sel + z
                d_w = z if d_w is None else d_w + z
            idx = own
            if d_sel is not None:
                idx = ad.select(router, (logits.detach().float() + d_sel).to(logits.dtype))
            if self._replay is not None:
                rep, rec = self._replay.layer(i, b, sl, logits.device)
                idx = rep if rec is None else torch.where(rec[:, None], rep, idx)
            modified = d_sel is not None or self._replay is not None
            if modified:
                lw = logits if d_w is None else (logits.float() + d_w).to(logits.dtype)
                weights = ad.weights(router, lw, idx)
            for r in self._recorders:
                r._add(i, idx if r.which == "used" else own, b, sl)
            if self._aux is not None:
                self._aux.append((logits, idx))
            for c in self._captures:
                c._add(i, logits, own, b, sl)
            if self._tape is not None:
                self._tape.append((idx.detach(), None if d_w is None else d_w.detach()) if modified else None)
            if not modified:
                return None
            return (logits, weights, idx) + tuple(output[3:])

        return hook

    def _model_pre(self, module, args, kwargs):
        """Model-level pre-hook: the batch layout of this forward, the token check of a replayed trace, and the
        token ids recorders tie their routes to."""
        ids = args[0] if args and isinstance(args[0], torch.Tensor) else kwargs.get("input_ids")
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
            emb = kwargs.get("inputs_embeds")
            self._last_shape = tuple(int(d) for d in emb.shape[:2]) if isinstance(emb, torch.Tensor) else None
            for r in self._recorders:
                r._tokens_ok = False
            return None
        self._last_shape = (int(ids.shape[0]), int(ids.shape[1]))
        if self._replay is not None and self._replay.trace.tokens is not None and self._tape_replay is None:
            self._replay.trace.check_tokens(ids)
        for r in self._recorders:
            r._add_tokens(ids)
        return None

    # the generic rule's hooks: GenericRuleHooks (routing/generic.py)

    def load_balancing_loss(self, token_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Aux loss of the experts actually used in the router calls since the last call (under
        ``replay(aux_from_used=True)``), pooled over MoE layers: ``E * sum_e f_e P_e`` (``routing/aux.py``).

        ``token_mask``: bool/int ``[B, S]`` of real tokens of the forward (applied to calls laid out ``[B, S]``).
        Consumes the stored calls."""
        if not self._aux:
            raise RuntimeError("no router calls stored: run the forward inside `with ctl.replay(trace):` "
                               "(aux_from_used=True) before load_balancing_loss()")
        entries, self._aux[:] = list(self._aux), []
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
        router's native top-k (to compare a replayed trace with the model's current routing). Inside the block
        ``model.generate`` refuses beam search, assisted decoding and ``use_cache=False``. One generate (or one
        forward / a sequence of chunked forwards of the same batch) per block.
        """
        if which not in ("used", "own"):
            raise ValueError(f"which must be 'used' or 'own', got {which!r}")
        rec = Recorder(self, which)
        with self._session(), self._generate_guard():
            self._recorders.append(rec)
            try:
                yield rec
            finally:
                self._recorders.remove(rec)

    @contextlib.contextmanager
    def replay(self, trace: RouteTrace, validate: bool = True, aux_from_used: bool = True) -> Iterator[None]:
        """Force the selection to ``trace`` (R3 / R2) where recorded; the router's own choice on sentinel rows.

        The trace must be laid out exactly like the forward's ``input_ids`` ``[B, S]``. Weights come from the
        current router's logits with the model's rule, gathered from the full distribution; router gradients flow.
        ``validate`` checks ids range, duplicates, partial rows and all-zero layers first (not the missing fraction:
        call ``trace.validate(mask=..., max_missing=...)`` for that). A trace tied to its tokens (``trace.tokens``)
        is checked against each forward's ``input_ids`` first (:meth:`RouteTrace.check_tokens`).

        ``aux_from_used``: keep each router call's logits and the ids actually used, so that
        :meth:`load_balancing_loss` gives the aux loss of the replayed experts (transformers' own ``aux_loss``
        re-derives the router's top-k, i.e. balances experts that did not run).
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
        if self._replay is not None:
            raise RuntimeError("replay contexts cannot be nested")
        with self._session():
            self._replay = _Replay(trace)
            self._aux = [] if aux_from_used else None
            try:
                yield
            finally:
                self._replay = None

    @contextlib.contextmanager
    def offsets(self, predictors: PR2Predictors, in_weights: bool = True,
                feature_cache: FeatureCache | None = None, fixed: PR2Predictors | None = None) -> Iterator[None]:
        """PR2 rollout: select on ``logits + predictors(layer, h)``; weights too when ``in_weights`` (paper default).

        With ``feature_cache`` the router inputs and (unshifted) logits of a sample of sequences are stored; then
        ``model.generate`` refuses beam search / assisted decoding as in :meth:`record`.

        ``fixed``: a second offset module that stands for a change of the router itself (the engine's fixed
        router-weight perturbation, ``routing/perturb.py``): ``f = fixed(layer, h)`` enters the selection AND the
        weights whatever ``in_weights`` says, and the feature cache stores ``logits + f`` (the perturbed router's
        logits).  So the selection runs on ``logits + f + predictors(layer, h)``.
        """
        for name, mod in (("predictors", predictors), ("fixed", fixed)):
            if mod is None and name == "fixed":
                continue
            if not isinstance(mod, PR2Predictors):
                raise TypeError(f"offsets expects PR2Predictors, got {type(mod).__name__} ({name})")
            if (mod.num_layers, mod.num_experts, mod.hidden_size) != (
                    self.num_moe_layers, self.num_experts, self.hidden_size):
                raise ValueError(f"{name} have (L, E, H) = {(mod.num_layers, mod.num_experts, mod.hidden_size)}"
                                 f" but the model has {(self.num_moe_layers, self.num_experts, self.hidden_size)}")
        if self._offsets is not None:
            raise RuntimeError("offsets contexts cannot be nested")
        if feature_cache is not None and feature_cache.has_data:
            raise ValueError("feature_cache already holds features: call cache.reset() or use a new FeatureCache")
        guard = self._generate_guard() if feature_cache is not None else contextlib.nullcontext()
        with self._session(), guard:
            self._offsets = _Offsets(predictors, in_weights, feature_cache, fixed)
            try:
                yield
            finally:
                self._offsets = None

    @contextlib.contextmanager
    def logit_noise(self, sigma: float, generator: torch.Generator | None = None) -> Iterator[None]:
        """Add ``N(0, sigma^2)`` to the router logits for selection and weights (engine-side mismatch knob).

        ``generator`` must live on the model's device. The routes are re-derived with the family's own rule.
        """
        if not (sigma >= 0.0):
            raise ValueError(f"sigma must be >= 0, got {sigma}")
        if self._noise is not None:
            raise RuntimeError("logit_noise contexts cannot be nested")
        with self._session():
            self._noise = _Noise(float(sigma), generator)
            try:
                yield
            finally:
                self._noise = None

    @contextlib.contextmanager
    def capture_router_logits(self, positions) -> Iterator[RouterCapture]:
        """Capture detached router logits ``[M, L, E]`` and the router's own top-k ``[M, L, K]`` at tokens.

        ``positions``: ``(batch_index[M], position[M])`` or a :class:`PR2Features` (its ``positions()``), laid out
        like the forward's ``input_ids``. Use with replay in the PR2 update forward:
        ``with ctl.replay(trace), ctl.capture_router_logits(feats) as cap: ...; cap.logits()``.
        """
        if hasattr(positions, "positions"):
            positions = positions.positions()
        bi, pos = positions
        cap = RouterCapture(self, torch.as_tensor(bi), torch.as_tensor(pos))
        with self._session():
            self._captures.append(cap)
            try:
                yield cap
            finally:
                self._captures.remove(cap)

    # ------------------------------------------------------------------------------------ generate guard
    @staticmethod
    def check_generate_kwargs(model: nn.Module, kwargs: dict) -> None:
        """Raise :class:`UnsupportedGenerationError` for generation modes whose routes cannot be recorded.

        Beam search (``num_beams > 1``) and group beam search reorder the cache; assisted / prompt-lookup decoding
        feed drafts and crop the cache; ``use_cache=False`` re-feeds the whole sequence each step.
        """
        gc = kwargs.get("generation_config") or getattr(model, "generation_config", None)

        def get(key, default=None):
            if key in kwargs:
                return kwargs[key]
            return getattr(gc, key, default) if gc is not None else default

        if (get("num_beams", 1) or 1) > 1:
            raise UnsupportedGenerationError(f"beam search (num_beams={get('num_beams')}) reorders the KV cache: "
                                             f"its routes cannot be recorded; use sampling or greedy decoding")
        if (get("num_beam_groups", 1) or 1) > 1:
            raise UnsupportedGenerationError("group beam search cannot be recorded")
        for key in ("assistant_model", "prompt_lookup_num_tokens", "assistant_early_exit"):
            if get(key) is not None:
                raise UnsupportedGenerationError(f"assisted decoding ({key}) feeds draft tokens and crops the cache: "
                                                 f"its routes cannot be recorded")
        if get("use_cache", True) is False:
            raise UnsupportedGenerationError("use_cache=False re-feeds the whole sequence at every step; record with "
                                             "the KV cache on")
        if kwargs.get("custom_generate") is not None:
            raise UnsupportedGenerationError("custom_generate cannot be recorded faithfully")

    @contextlib.contextmanager
    def _generate_guard(self):
        """While recording, wrap ``model.generate`` (instance attribute, removed on exit) to refuse unsupported modes
        and to tell recorders the length of ``sequences``."""
        model = self.model
        gen = getattr(model, "generate", None)
        if gen is None or self._gen_guard_users > 0:
            self._gen_guard_users += 1
            try:
                yield
            finally:
                self._gen_guard_users -= 1
            return
        had = "generate" in model.__dict__
        orig = gen

        def guarded_generate(*args, **kwargs):
            self.check_generate_kwargs(model, kwargs)
            for r in self._recorders:
                if r.num_calls:
                    raise ValueError("this record() block already holds routes: use one record() block per generate")
            out = orig(*args, **kwargs)
            seq = out if isinstance(out, torch.Tensor) else getattr(out, "sequences", None)
            if seq is not None:
                for r in self._recorders:
                    r.final_len = int(seq.shape[1])
            return out

        self._gen_guard_users += 1
        model.generate = guarded_generate
        try:
            yield
        finally:
            self._gen_guard_users -= 1
            if had:
                model.generate = orig
            else:
                try:
                    del model.generate
                except AttributeError:
                    pass

    # ------------------------------------------------------------------------------ gradient checkpointing
    def checkpoint_context_fn(self):
        """``context_fn`` for ``torch.utils.checkpoint.checkpoint`` (non-reentrant).

        Returns ``(forward_ctx, recompute_ctx)``: the forward context stores, in call order, the route each router
        used inside the checkpointed layer (``None`` = router's own choice) and the logit shift of its weights; the
        recompute context re-installs the hooks if needed and makes each router use exactly that route, so the
        recompute during ``backward()`` (after the ``with`` block closed) matches the forward bit for bit.
        """
        tape: list = []
        state = {"active": False}
        ctl = self

        @contextlib.contextmanager
        def forward_ctx():
            state["active"] = ctl.active
            prev = ctl._tape
            ctl._tape = tape if ctl.active else None
            try:
                yield
            finally:
                ctl._tape = prev

        @contextlib.contextmanager
        def recompute_ctx():
            if not state["active"] or not tape:
                # hooks were off during the forward: the router's own deterministic choice; make sure nothing
                # that is open now (another replay) changes it
                prev = (ctl._tape_replay, ctl._tape_pos)
                ctl._tape_replay, ctl._tape_pos = _OWN, 0
                try:
                    yield
                finally:
                    ctl._tape_replay, ctl._tape_pos = prev
                return
            prev = (ctl._tape_replay, ctl._tape_pos, ctl._tape)
            ctl._acquire()
            ctl._tape_replay, ctl._tape_pos, ctl._tape = tape, 0, None
            try:
                yield
            finally:
                ctl._tape_replay, ctl._tape_pos, ctl._tape = prev
                ctl._release()

        return forward_ctx(), recompute_ctx()

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
        """``model.generate(**kwargs)`` after checking the mode can be recorded (see :meth:`check_generate_kwargs`)."""
        model = self.model if model is None else model
        self.check_generate_kwargs(model, kwargs)
        return model.generate(**kwargs)

    def empty_trace(self, batch: int, seq_len: int, device=None) -> RouteTrace:
        """An all-"not recorded" trace for this model."""
        return RouteTrace.empty(batch, seq_len, self.num_moe_layers, self.top_k, self.num_experts, self.layer_ids,
                                device)
