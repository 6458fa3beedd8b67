"""Routes returned by inference engines, decoded and laid out per token: every payload form of vLLM and SGLang.

Pure layout functions (no model): each returns int64 ``[S, L_moe, K]`` route ids for one sequence of ``S`` tokens
(prompt then completion), -1 where a position was not recorded. ``RouteTrace.from_vllm`` / ``from_sglang`` wrap
them into a trace tied to the token ids.

What the engines send, by version (payload, rows, layers, dtype), is tabulated in docs/routing.md ("Routes from
inference engines"), read from https://github.com/vllm-project/vllm/blob/main/docs/features/routed_experts.md,
https://github.com/vllm-project/vllm/blob/main/tests/entrypoints/openai/test_return_routed_experts.py and
https://github.com/sgl-project/sglang/blob/main/python/sglang/srt/layers/moe/routed_experts_capturer.py.
"""
from __future__ import annotations

import base64
import binascii
import io
from typing import Sequence

import numpy as np
import torch
from einops import rearrange

__all__ = ["NPY_MAGIC", "as_int_tensor", "decode_routes", "moe_layers", "place_rows",
           "vllm_routes", "sglang_routes"]

NPY_MAGIC = b"\x93NUMPY"


def _no_routes(name: str) -> ValueError:
    return ValueError(f"{name} is None: the engine returned no routes for this request (vLLM 0.21 drops them after "
                      f"a preemption; check the engine runs with --enable-return-routed-experts)")


def as_int_tensor(x, name: str) -> torch.Tensor:
    """``x`` (numpy array, torch tensor or nested list, any integer dtype incl. uint16) as an int64 tensor;
    ``None``, floats and bools are refused by name."""
    if x is None:
        raise _no_routes(name)
    if isinstance(x, torch.Tensor):
        if x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
            raise TypeError(f"{name} must hold integer expert ids, got {x.dtype}")
        return x.detach().cpu().to(torch.int64)
    a = np.asarray(x)
    if a.size == 0 and a.dtype.kind not in "iu":
        a = a.astype(np.int64)
    if a.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integer expert ids, got {a.dtype}")
    return torch.from_numpy(a.astype(np.int64))


def _b64(payload, name: str) -> bytes:
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"{name} is a string but not valid base64 ({exc})") from None


def decode_routes(payload, name: str = "routed_experts") -> torch.Tensor:
    """Any engine payload as int64: ``[N, L, K]`` when the payload carries its shape (base64 of an ``.npy`` file,
    read without pickle; an array or tensor of any integer dtype; nested lists), flat ``[N * L * K]`` for SGLang's
    base64 of raw little-endian int32. ``None`` is refused: the engine returned no routes."""
    if payload is None:
        raise _no_routes(name)
    if isinstance(payload, (str, bytes, bytearray)):
        raw = _b64(payload, name)
        if raw.startswith(NPY_MAGIC):
            try:
                arr = np.load(io.BytesIO(raw), allow_pickle=False)
            except ValueError as exc:
                raise ValueError(f"{name} holds an .npy file that cannot be read without pickle ({exc})") from None
            return as_int_tensor(arr, name)
        if len(raw) % 4:
            raise ValueError(f"{name} decodes to {len(raw)} bytes: neither an .npy file nor whole int32 values")
        return torch.from_numpy(np.frombuffer(raw, dtype="<i4").astype(np.int64))
    return as_int_tensor(payload, name)


def moe_layers(routes: torch.Tensor, layer_ids: Sequence[int], num_hidden_layers: int | None, name: str,
               unreplayed: Sequence[int] = ()) -> torch.Tensor:
    """``routes[N, L, K]`` reduced to the MoE layers ``layer_ids``: ``L = len(layer_ids)`` is kept as is,
    ``L = num_hidden_layers`` is cut to the rows ``layer_ids``, where the dropped (dense) layers must hold the zeros
    the engines write there, except ``unreplayed`` (routed layers the controller leaves to themselves, e.g.
    hash-routed); any other ``L`` is refused, naming ``num_hidden_layers``."""
    if routes.dim() != 3:
        raise ValueError(f"{name} must be [positions, layers, top_k], got shape {tuple(routes.shape)}")
    n_layers = routes.shape[1]
    if n_layers == len(layer_ids):
        return routes
    if num_hidden_layers is not None and n_layers == num_hidden_layers:
        if max(layer_ids) >= num_hidden_layers:
            raise ValueError(f"layer_ids {tuple(layer_ids)} exceed num_hidden_layers={num_hidden_layers}")
        dense = [i for i in range(n_layers) if i not in set(layer_ids) | set(unreplayed)]
        bad = [i for i in dense if bool((routes[:, i] > 0).any())]
        if bad:
            raise ValueError(f"{name} layer {bad[0]} is not an MoE layer of the model (layer_ids "
                             f"{tuple(layer_ids)}) but holds non-zero expert ids: layer_ids do not match the engine's "
                             f"model, or it is a routed layer the controller does not replay (pass "
                             f"unreplayed_layer_ids=ctl.unreplayed_layer_ids)")
        return routes[:, list(layer_ids)]
    hint = (f" or num_hidden_layers={num_hidden_layers} (all layers)" if num_hidden_layers is not None else
            "; an engine that returns every hidden layer needs num_hidden_layers=config.num_hidden_layers")
    raise ValueError(f"{name} has {n_layers} layers; expected {len(layer_ids)} MoE layers{hint}")


def place_rows(routes: torch.Tensor, length: int, start: int, name: str, what: str) -> torch.Tensor:
    """``routes[N, L, K]`` covering positions ``[start, start + N)`` laid into ``[length, L, K]`` (-1 elsewhere);
    ``N`` must be ``length - start - 1`` (the last token is never fed) or ``length - start``."""
    if not 0 <= start < max(length, 1):
        raise ValueError(f"start={start} is outside the {what} of {length} tokens")
    n, want = routes.shape[0], length - start
    if n not in (want, want - 1):
        raise ValueError(f"{name} has {n} positions but the {what} has {length} tokens from start={start} "
                         f"(expected {want - 1} or {want}: the last token is never fed)")
    out = torch.full((length,) + tuple(routes.shape[1:]), -1, dtype=torch.int64)
    out[start:start + n] = routes
    return out


def vllm_routes(prompt_len: int, completion_len: int, routed_experts, prompt_routed_experts=None,
                layer_ids: Sequence[int] = (), num_hidden_layers: int | None = None, start: int = 0,
                unreplayed: Sequence[int] = ()) -> torch.Tensor:
    """vLLM routes of one completion as ``[P + T, L_moe, K]`` int64, -1 where not recorded.

    Without ``prompt_routed_experts`` (vLLM <= 0.20 and >= 0.22): ``routed_experts`` covers ``[start, S - 1)`` (or
    ``[start, S)``). With it (vLLM 0.21): ``prompt_routed_experts [P, L, K]`` plus a completion part of ``T`` or
    ``T - 1`` positions."""
    gen = moe_layers(_shaped(routed_experts, "routed_experts"), layer_ids, num_hidden_layers, "routed_experts",
                     unreplayed)
    if prompt_routed_experts is None:
        if not start and gen.shape[0] in (completion_len, completion_len - 1) and prompt_len > 1:
            raise ValueError(f"routed_experts has {gen.shape[0]} positions: the completion's part alone (vLLM 0.21 "
                             f"split layout), but prompt_routed_experts is None; pass the response's "
                             f"prompt_routed_experts, or use vLLM >= 0.22 (one array over prompt + completion)")
        return place_rows(gen, prompt_len + completion_len, start, "routed_experts", "sequence (prompt + completion)")
    if start:
        raise ValueError("start applies to the single-array layout (vLLM >= 0.22); vLLM 0.21's split layout has none")
    pr = moe_layers(_shaped(prompt_routed_experts, "prompt_routed_experts"), layer_ids, num_hidden_layers,
                    "prompt_routed_experts", unreplayed)
    if pr.shape[0] != prompt_len:
        raise ValueError(f"prompt_routed_experts has {pr.shape[0]} positions but the prompt has {prompt_len} tokens")
    if pr.shape[1:] != gen.shape[1:]:
        raise ValueError(f"prompt_routed_experts [P, L, K] = {tuple(pr.shape)} and routed_experts "
                         f"{tuple(gen.shape)} disagree on [L, K]")
    if completion_len == 0:
        if gen.shape[0]:
            raise ValueError(f"routed_experts has {gen.shape[0]} positions but the completion is empty")
        return pr
    return torch.cat([pr, place_rows(gen, completion_len, 0, "routed_experts", "completion")], 0)


def _shaped(payload, name: str) -> torch.Tensor:
    routes = decode_routes(payload, name)
    if routes.dim() != 3:
        raise ValueError(f"{name} must be [positions, layers, top_k] (an .npy file, an array or nested lists), got "
                         f"shape {tuple(routes.shape)}")
    return routes


def sglang_routes(seq_len: int, payload, top_k: int, layer_ids: Sequence[int],
                  num_hidden_layers: int | None = None, start: int = 0, unreplayed: Sequence[int] = ()
                  ) -> torch.Tensor:
    """SGLang routes of one request as ``[S, L_moe, K]`` int64 (rows ``[start, S - 1)``; ``[start, S)`` accepted).

    A flat payload's layer count is found from its size: ``S - start - 1`` (or ``S - start``) rows of either
    ``len(layer_ids)`` MoE layers or ``num_hidden_layers`` layers; a size that fits neither (or two ways) is refused,
    naming ``num_hidden_layers``."""
    routes = decode_routes(payload, "routed_experts")
    if routes.dim() != 3:
        n_ids = routes.numel()
        layers = [len(layer_ids)] + ([num_hidden_layers] if num_hidden_layers else [])
        fits = {(r, l) for l in layers for r in (seq_len - start - 1, seq_len - start) if n_ids == r * l * top_k}
        if len(fits) != 1:
            raise ValueError(
                f"SGLang routed_experts holds {n_ids} ids; {seq_len} tokens from start={start} need (S - start - 1) "
                f"x layers x top_k = {seq_len - start - 1} x {len(layer_ids)} (MoE layers)"
                + (f" or x {num_hidden_layers} (num_hidden_layers)" if num_hidden_layers else
                   " (pass num_hidden_layers=config.num_hidden_layers: SGLang returns every hidden layer)")
                + f" x {top_k}" + (" (ambiguous)" if len(fits) > 1 else ""))
        (_, n_layers), = fits
        routes = rearrange(routes, "(n l k) -> n l k", l=n_layers, k=top_k)
    routes = moe_layers(routes, layer_ids, num_hidden_layers, "routed_experts", unreplayed)
    return place_rows(routes, seq_len, start, "SGLang routed_experts", "sequence")
