"""Routes returned by inference engines, laid out per token: the layouts of vLLM and SGLang.

Pure layout functions (no model): each returns int64 ``[S, L_moe, K]`` route ids for one sequence of ``S`` tokens
(prompt then completion), -1 where a position was not recorded. ``RouteTrace.from_vllm`` / ``from_sglang`` wrap
them into a trace tied to the token ids.

* vLLM (``enable_return_routed_experts``): int16 ``prompt_routed_experts [P, L, K]`` on the prompt output plus
  ``routed_experts [T', L, K]`` on each completion, ``L`` = MoE layers; earlier versions gave one
  ``routed_experts [S', L_all, K]`` over all hidden layers. The last sampled token is never fed to the model, so a
  completion part may be one position short (``T' = T - 1``; ``S' = S - 1``).
* SGLang (``--enable-return-routed-experts``): base64 of int32 ``[N, L, K]`` in ``meta_info["routed_experts"]``
  covering positions ``[0, S - 1)`` (one position short: the last token is not fed).

Layers: an array with ``len(layer_ids)`` layers is taken as the MoE layers; one with ``num_hidden_layers`` layers
(dense first layers included) is reduced to the rows ``layer_ids``. Anything else is refused, naming both counts.
"""
from __future__ import annotations

import base64
from typing import Sequence

import numpy as np
import torch

__all__ = ["as_int_tensor", "decode_sglang", "moe_layers", "vllm_routes", "sglang_routes"]


def as_int_tensor(x, name: str) -> torch.Tensor:
    """``x`` (numpy array, torch tensor or nested list) as an int64 tensor; floats are refused by name."""
    t = torch.from_numpy(np.asarray(x)) if not isinstance(x, torch.Tensor) else x
    if t.is_floating_point() or t.dtype == torch.bool:
        raise TypeError(f"{name} must hold integer expert ids, got {t.dtype}")
    return t.long()


def moe_layers(routes: torch.Tensor, layer_ids: Sequence[int], num_hidden_layers: int | None, name: str
               ) -> torch.Tensor:
    """``routes[N, L, K]`` reduced to the MoE layers ``layer_ids`` (see the module docstring)."""
    if routes.dim() != 3:
        raise ValueError(f"{name} must be [positions, layers, top_k], got shape {tuple(routes.shape)}")
    n_layers = routes.shape[1]
    if n_layers == len(layer_ids):
        return routes
    if num_hidden_layers is not None and n_layers == num_hidden_layers:
        if max(layer_ids) >= num_hidden_layers:
            raise ValueError(f"layer_ids {tuple(layer_ids)} exceed num_hidden_layers={num_hidden_layers}")
        return routes[:, list(layer_ids)]
    raise ValueError(f"{name} has {n_layers} layers; expected {len(layer_ids)} MoE layers"
                     + (f" or {num_hidden_layers} hidden layers" if num_hidden_layers is not None else
                        " (pass num_hidden_layers for an all-layers layout)"))


def _fit(routes: torch.Tensor, length: int, name: str, what: str) -> torch.Tensor:
    """``routes`` of ``length`` or ``length - 1`` positions padded with -1 to ``length``."""
    n = routes.shape[0]
    if n not in (length, length - 1):
        raise ValueError(f"{name} has {n} positions but the {what} has {length} tokens (expected {length} or "
                         f"{length - 1}: the last token is never fed)")
    if n == length:
        return routes
    pad = torch.full((1,) + tuple(routes.shape[1:]), -1, dtype=routes.dtype)
    return torch.cat([routes, pad], 0)


def vllm_routes(prompt_len: int, completion_len: int, routed_experts, prompt_routed_experts=None,
                layer_ids: Sequence[int] = (), num_hidden_layers: int | None = None) -> torch.Tensor:
    """vLLM routes of one completion as ``[P + T, L_moe, K]`` int64, -1 where not recorded.

    With ``prompt_routed_experts`` (``[P, L, K]``): ``routed_experts`` covers the completion (``T`` or ``T - 1``
    positions). Without it (older versions): ``routed_experts`` covers the whole sequence (``S`` or ``S - 1``).
    """
    gen = moe_layers(as_int_tensor(routed_experts, "routed_experts"), layer_ids, num_hidden_layers,
                     "routed_experts")
    if prompt_routed_experts is None:
        return _fit(gen, prompt_len + completion_len, "routed_experts", "sequence (prompt + completion)")
    pr = moe_layers(as_int_tensor(prompt_routed_experts, "prompt_routed_experts"), layer_ids, num_hidden_layers,
                    "prompt_routed_experts")
    if pr.shape[0] != prompt_len:
        raise ValueError(f"prompt_routed_experts has {pr.shape[0]} positions but the prompt has {prompt_len} tokens")
    if pr.shape[1:] != gen.shape[1:]:
        raise ValueError(f"prompt_routed_experts [P, L, K] = {tuple(pr.shape)} and routed_experts "
                         f"{tuple(gen.shape)} disagree on [L, K]")
    if completion_len == 0:
        if gen.shape[0]:
            raise ValueError(f"routed_experts has {gen.shape[0]} positions but the completion is empty")
        return pr
    return torch.cat([pr, _fit(gen, completion_len, "routed_experts", "completion")], 0)


def decode_sglang(payload, num_layers: int, top_k: int) -> torch.Tensor:
    """SGLang's ``meta_info["routed_experts"]`` (base64 string/bytes of int32, or an array) as ``[N, L, K]``."""
    if isinstance(payload, (str, bytes)):
        raw = base64.b64decode(payload, validate=True)
        if len(raw) % 4:
            raise ValueError(f"SGLang routed_experts decodes to {len(raw)} bytes, not a whole number of int32")
        flat = torch.from_numpy(np.frombuffer(raw, dtype="<i4").copy()).long()
    else:
        flat = as_int_tensor(payload, "routed_experts").reshape(-1)
    if flat.numel() % (num_layers * top_k):
        raise ValueError(f"SGLang routed_experts holds {flat.numel()} ids, not a multiple of layers x top_k = "
                         f"{num_layers} x {top_k}")
    return flat.reshape(-1, num_layers, top_k)


def sglang_routes(seq_len: int, payload, top_k: int, layer_ids: Sequence[int],
                  num_hidden_layers: int | None = None) -> torch.Tensor:
    """SGLang routes of one request as ``[S, L_moe, K]`` int64 (position ``S - 1`` not recorded).

    The layer count of the payload is found from its size: ``S - 1`` positions of either ``len(layer_ids)`` MoE
    layers or ``num_hidden_layers`` layers; a payload that fits neither (or both) is refused."""
    if isinstance(payload, (str, bytes)):
        n_ids = len(base64.b64decode(payload, validate=True)) // 4
    else:
        n_ids = int(np.prod(np.asarray(payload).shape)) if not isinstance(payload, torch.Tensor) else payload.numel()
    fits = [l for l in dict.fromkeys([len(layer_ids)] + ([num_hidden_layers] if num_hidden_layers else []))
            if n_ids == (seq_len - 1) * l * top_k]
    if len(fits) != 1:
        raise ValueError(f"SGLang routed_experts holds {n_ids} ids; {seq_len} tokens need (S - 1) x layers x top_k "
                         f"= {seq_len - 1} x {len(layer_ids)} (MoE layers)"
                         + (f" or x {num_hidden_layers} (all layers)" if num_hidden_layers else "")
                         + f" x {top_k}" + (" (ambiguous)" if len(fits) > 1 else ""))
    routes = moe_layers(decode_sglang(payload, fits[0], top_k), layer_ids, num_hidden_layers, "routed_experts")
    return _fit(routes, seq_len, "SGLang routed_experts", "sequence")
