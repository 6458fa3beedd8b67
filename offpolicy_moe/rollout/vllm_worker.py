"""What runs INSIDE vLLM's worker process: the route recorder and the weight loader, reached with
``LLM.collective_rpc`` (functions pickled by name; this module imports nothing of the trainer).

Routes: :func:`install_route_recorder` hooks every MoE layer's ``gate`` and the model's forward.  A forward runs
``N`` scheduled tokens of several requests, flattened: request ``r`` owns rows ``query_start_loc[r] :
query_start_loc[r + 1]`` in the order of the runner's ``input_batch.req_ids``, at the ``positions`` the model
receives.  On the CPU the recorder wraps vLLM's fused-MoE selection (``cpu_fused_moe.select_experts``) and so sees
the ids the kernel runs; elsewhere it chooses from the router logits by the layer's rule
(:mod:`offpolicy_moe.rollout.expert_choice`).  The ids are filed under ``(request, position)``: what the engine
computed while it sampled, nothing recomputed by the trainer.
"""
from __future__ import annotations

import re
from typing import Any, Optional

import numpy as np
import torch
from safetensors.torch import load_file

from offpolicy_moe.rollout.expert_choice import ExpertRule, choose_experts, moe_layer_settings, rule_of

__all__ = ["ROUTER_NAME", "RouteRecorder", "install_route_recorder", "take_routes", "decode_routes", "load_weights",
           "router_layers", "moe_layer_ids", "use_kernel_selection", "expert_kernels"]

# the router linear of a decoder layer's MoE block in vLLM's models: layers.<i>.<block>.gate
ROUTER_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:mlp|block_sparse_moe|feed_forward|moe)\.gate$")


def router_layers(model: torch.nn.Module) -> list[tuple[int, torch.nn.Module]]:
    """``(decoder layer index, router module)`` of every MoE layer of a vLLM model, by layer index."""
    found = []
    for name, module in model.named_modules():
        m = ROUTER_NAME.search(name)
        if m:
            found.append((int(m.group(1)), module))
    return sorted(found, key=lambda t: t[0])


class RouteRecorder:
    """Hooks on a vLLM model runner's model: the router logits of each forward, filed per request and position."""

    def __init__(self, runner: Any, top_k: int):
        self.runner = runner
        self.top_k = int(top_k)
        model = runner.model
        self.layers = router_layers(model)
        if not self.layers:
            raise RuntimeError(f"no MoE router (layers.<i>.mlp.gate) found in vLLM's {type(model).__name__}")
        self._step: Optional[tuple[list[str], np.ndarray, torch.Tensor]] = None
        self._logits: list[Optional[torch.Tensor]] = [None] * len(self.layers)
        self._selected: list[torch.Tensor] = []          # the kernel's own top-k ids, one per MoE layer call
        self.from_kernel = 0                              # forwards whose ids came from the kernel's selection
        self.kernel_ids = True                            # False: ignore the kernel's ids (tests force the fallback)
        settings = moe_layer_settings(model)
        family = type(model).__name__
        # each MoE layer's own choice from its router logits (the fallback), and the layer it reads its bias from
        self.rules: list[ExpertRule] = []
        self._experts: list[Any] = []
        for i, _ in self.layers:
            experts, router = settings.get(i, (None, None))
            self._experts.append(experts)
            self.rules.append(rule_of(experts, router, family) if experts is not None else
                              ExpertRule(self.top_k, refused=f"{family}'s MoE layer {i} shows no routed-experts "
                                                             "settings (top_k, scoring_func) to choose by"))
        self.routes: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
        self._handles = [model.register_forward_pre_hook(self._before, with_kwargs=True),
                         model.register_forward_hook(self._after, with_kwargs=True)]
        for j, (_, gate) in enumerate(self.layers):
            self._handles.append(gate.register_forward_hook(self._router_hook(j)))

    def remove(self) -> None:
        """Take the recorder's hooks off the model."""
        for h in self._handles:
            h.remove()
        self._handles = []

    @property
    def layer_ids(self) -> list[int]:
        """Decoder-layer index of each recorded MoE layer."""
        return [i for i, _ in self.layers]

    def _before(self, module: Any, args: tuple, kwargs: dict) -> None:
        batch = self.runner.input_batch
        n = int(batch.num_reqs)
        positions = kwargs.get("positions", args[1] if len(args) > 1 else None)
        if n == 0 or positions is None:
            self._step = None
            return
        starts = np.asarray(self.runner.query_start_loc.np[:n + 1], dtype=np.int64).copy()
        self._step = (list(batch.req_ids[:n]), starts, positions[:int(starts[-1])].detach().to("cpu", copy=True))
        self._logits = [None] * len(self.layers)
        self._selected = []

    @property
    def refused(self) -> str:
        """Why the fallback cannot reproduce some layer's choice ("" when it can for every layer)."""
        return next((r.refused for r in self.rules if r.refused), "")

    def selected(self, topk_ids: torch.Tensor) -> None:
        """Called with the ids a fused-MoE kernel selected (``[N, K]``), layer by layer within a forward."""
        if self._step is not None and self.kernel_ids:
            self._selected.append(topk_ids.detach().to("cpu", copy=True))

    def _router_hook(self, j: int):
        def hook(module: Any, inputs: Any, output: Any) -> None:
            logits = output[0] if isinstance(output, tuple) else output
            self._logits[j] = logits.detach()
        return hook

    def _after(self, module: Any, args: tuple, kwargs: dict, output: Any) -> None:
        if self._step is None:
            return
        req_ids, starts, positions = self._step
        self._step = None
        n = int(starts[-1])
        if len(self._selected) == len(self.layers):
            ids = torch.stack([s[:n] for s in self._selected], 1)
            self.from_kernel += 1
        elif any(lg is None for lg in self._logits):
            missing = [self.layers[j][0] for j, lg in enumerate(self._logits) if lg is None]
            raise RuntimeError(f"route recorder: the routers of layers {missing} did not run in this forward")
        else:
            ids = torch.stack([self._choose(j, lg[:n]) for j, lg in enumerate(self._logits)], 1)
        self._selected = []
        ids = ids.to(torch.int16).numpy()                                       # [N, L, K]
        pos = positions.numpy().astype(np.int64)
        for r, rid in enumerate(req_ids):
            a, b = int(starts[r]), int(starts[r + 1])
            if b > a:
                self.routes.setdefault(rid, []).append((pos[a:b], ids[a:b]))
        self._logits = [None] * len(self.layers)

    def _choose(self, j: int, logits: torch.Tensor) -> torch.Tensor:
        """MoE layer ``j``'s own choice from its router ``logits`` (its bias read now: a weight sync replaces it)."""
        rule = self.rules[j]
        if rule.refused:
            raise RuntimeError(f"route recorder: {rule.refused}; use rollout.engine=hf or a vLLM that returns "
                               "routed experts")
        bias = getattr(self._experts[j], "e_score_correction_bias", None) if rule.biased else None
        return choose_experts(logits, rule, bias)

    def take(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """``{request id: (positions [n], expert ids [n, L, K] int16)}`` of everything recorded since the last take
        (a position recorded twice, as after a preemption, keeps its last forward's routes)."""
        out = {}
        for rid, parts in self.routes.items():
            out[rid] = (np.concatenate([p for p, _ in parts]), np.concatenate([i for _, i in parts]))
        self.routes = {}
        return out


def _watch_kernel_selection(rec: RouteRecorder) -> bool:
    """Wrap vLLM's CPU fused-MoE expert selection so that ``rec`` sees the ids the kernel runs; False off the CPU
    (GPU builds carry the same module, but their kernels never call it) and where this vLLM has no such function
    (the recorder then chooses from the router logits)."""
    try:
        from vllm.model_executor.layers.fused_moe import cpu_fused_moe
        from vllm.platforms import current_platform
    except ImportError:
        return False
    if not current_platform.is_cpu():
        return False
    own = getattr(cpu_fused_moe, "select_experts", None)
    if own is None:
        return False

    def select_experts(*args: Any, **kwargs: Any) -> Any:
        weights, ids = own(*args, **kwargs)
        rec.selected(ids)
        return weights, ids

    cpu_fused_moe.select_experts = select_experts
    return True


def install_route_recorder(worker: Any, top_k: int) -> list[int]:
    """Install a :class:`RouteRecorder` on ``worker``'s model runner (once); returns the MoE layer indices.  Where
    no kernel selection can be watched, a family whose choice the fallback cannot reproduce is refused here, in
    one line, before any generation."""
    runner = worker.model_runner
    rec = getattr(runner, "_offpolicy_moe_routes", None)
    if rec is None:
        rec = RouteRecorder(runner, top_k)
        if not _watch_kernel_selection(rec) and rec.refused:
            rec.remove()
            raise RuntimeError(f"route recorder: {rec.refused}; use rollout.engine=hf or a vLLM that returns "
                               "routed experts")
        runner._offpolicy_moe_routes = rec
    return rec.layer_ids


def use_kernel_selection(worker: Any, on: bool) -> None:
    """Whether the installed recorder keeps the kernel's own ids (``on``, the default) or always chooses from the
    router logits (the fallback a kernel that selects internally gets; tests compare the two)."""
    rec = getattr(worker.model_runner, "_offpolicy_moe_routes", None)
    if rec is None:
        raise RuntimeError("route recorder: not installed in this vLLM worker")
    rec.kernel_ids = bool(on)


def moe_layer_ids(worker: Any) -> list[int]:
    """Decoder-layer index of every MoE layer of ``worker``'s model (no hook installed): what a trace of vLLM's
    native ``routed_experts`` (all hidden layers) is reduced to."""
    return [i for i, _ in router_layers(worker.model_runner.get_model())]


def kernel_selected_forwards(worker: Any) -> int:
    """How many recorded forwards took their ids from the kernel's own selection (not the router logits)."""
    rec = getattr(worker.model_runner, "_offpolicy_moe_routes", None)
    return 0 if rec is None else int(rec.from_kernel)


def take_routes(worker: Any) -> dict[str, tuple[bytes, bytes, tuple[int, ...]]]:
    """The routes recorded in ``worker`` since the last call (see :meth:`RouteRecorder.take`), as raw bytes
    ``(positions int64, ids int16, ids shape)`` per request, which vLLM's RPC carries unchanged
    (:func:`decode_routes` reads them)."""
    rec = getattr(worker.model_runner, "_offpolicy_moe_routes", None)
    if rec is None:
        raise RuntimeError("route recorder: not installed in this vLLM worker")
    return {rid: (pos.astype(np.int64).tobytes(), ids.astype(np.int16).tobytes(), tuple(ids.shape))
            for rid, (pos, ids) in rec.take().items()}


def decode_routes(raw: dict) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Inverse of :func:`take_routes`' encoding: ``{request id: (positions [n], ids [n, L, K])}``."""
    return {rid: (np.frombuffer(p, dtype=np.int64), np.frombuffer(i, dtype=np.int16).reshape(tuple(shape)))
            for rid, (p, i, shape) in raw.items()}


def load_weights(worker: Any, path: str) -> list[str]:
    """Load the checkpoint-named tensors of the safetensors file ``path`` into ``worker``'s model in place; returns
    the names of the model's parameters that no tensor filled (empty: a complete load).

    Every tensor goes through vLLM's own in-place reload (``model_runner.reload_weights``): parameters are put back as
    before the kernels processed them, loaded by name, and processed again (e.g. the CPU MoE prepacking), so every
    kernel path gets its own layout.  A file crosses the process boundary, not the tensors (vLLM's RPC pickles)."""
    runner = worker.model_runner
    model = runner.get_model()
    tensors = load_file(path)
    filled: set[str] = set()
    own_load = model.load_weights

    def counted(weights: Any) -> Any:
        loaded = own_load(weights)
        filled.update(loaded or ())
        return loaded

    model.load_weights = counted
    try:
        runner.reload_weights(weights_iterator=iter(tensors.items()), is_checkpoint_format=True)
    finally:
        del model.load_weights
    return _unfilled(model, filled)


def expert_kernels(worker: Any) -> list[str]:
    """Which CPU kernel each MoE layer of ``worker``'s model runs: ``"grouped_gemm:<isa>"`` (prepacked experts:
    ``vec`` on AVX-512, ``amx`` on AMX) or ``"torch_loop"`` (per-expert matrix products, AVX2); ``"other"`` off the
    CPU."""
    kinds = []
    for _, module in worker.model_runner.get_model().named_modules():
        cpu = getattr(getattr(module, "quant_method", None), "cpu_fused_moe", None)
        if cpu is None:
            continue
        method = getattr(getattr(cpu, "forward_method", None), "__name__", "")
        if method == "forward_grouped_gemm":
            kinds.append(f"grouped_gemm:{getattr(cpu, 'isa', '?')}")
        elif method == "forward_torch":
            kinds.append("torch_loop")
        else:
            kinds.append("other")
    return kinds


def _unfilled(model: torch.nn.Module, filled: set[str]) -> list[str]:
    """Parameters of ``model`` that none of the ``filled`` names reaches.  A loader may name a parameter by a
    shorter module path (vLLM's fused-MoE wrapper answers for ``...experts.routed_experts.w13_weight`` as
    ``...experts.w13_weight``): a name reaches a parameter when its parts are the parameter's parts with some
    inner module names left out."""
    full = {n.split(".")[0] + "|" + n.split(".")[-1]: [] for n in filled}
    for n in filled:
        full[n.split(".")[0] + "|" + n.split(".")[-1]].append(n.split("."))
    missing = []
    for name, _ in model.named_parameters():
        if name in filled:
            continue
        parts = name.split(".")
        if not any(_is_subsequence(f, parts) for f in full.get(parts[0] + "|" + parts[-1], ())):
            missing.append(name)
    return sorted(missing)


def _is_subsequence(short: list[str], long: list[str]) -> bool:
    it = iter(long)
    return all(part in it for part in short)
