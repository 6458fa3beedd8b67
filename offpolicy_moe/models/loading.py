"""Build a policy from a preset or load a local Hugging Face checkpoint offline (``local_files_only``, nothing
fetched from the network), and check that model and tokenizer fit (:func:`check_compatibility`)."""
from __future__ import annotations

import contextlib
import os
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

from transformers.utils import logging as hf_logging

from ..tasks.tokenizer import embedded_tokenizer, encode_texts
from .dtypes import resolve_dtype
from .experts import AUTO, resolve_experts_implementation
from .moe_shape import moe_shape
from .presets import HEAD_DIM, PRESETS, build_preset

# Files of which at least one must be present for AutoTokenizer to load a folder offline.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "tokenizer.tiktoken")


class CheckpointNotFoundError(FileNotFoundError, ValueError):
    """``model.path`` / ``model.tokenizer_path`` is missing or not a Hugging Face directory."""


@dataclass(frozen=True)
class MoEInfo:
    """MoE shape of a model: routed experts per layer, experts per token, MoE layers found."""

    num_experts: Optional[int]
    top_k: Optional[int]
    num_moe_layers: int


def moe_info(model) -> MoEInfo:
    """Experts and top-k from the model config; MoE layers = modules holding both ``experts`` and a
    router (``gate`` or ``router``), the layout of every transformers 5.x MoE family."""
    config = getattr(model, "config", None)
    layers = sum(1 for m in model.modules()
                 if hasattr(m, "experts") and (hasattr(m, "gate") or hasattr(m, "router")))
    num_experts, top_k = moe_shape(config) if config is not None else (None, None)
    return MoEInfo(num_experts, top_k, layers)


def is_moe(model) -> bool:
    """True when the model has at least one routed-experts layer."""
    return moe_info(model).num_moe_layers > 0


def _embedding_rows(model) -> int:
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if emb is not None and hasattr(emb, "num_embeddings"):
        return int(emb.num_embeddings)
    return int(model.config.vocab_size)


def check_compatibility(model, tok, *, num_experts: Optional[int] = None, top_k: Optional[int] = None,
                        require_moe: bool = False, task=None) -> MoEInfo:
    """Check that ``model`` and ``tok`` (and optionally ``task``) can be trained together; returns the model's
    :class:`MoEInfo`.  ``ValueError`` when the tokenizer does not fit the embedding (or a special id falls outside it),
    eos/pad ids are missing, ``require_moe`` and the model has no MoE layer, experts or top-k differ from
    ``num_experts``/``top_k``, or a character of the task's text cannot be encoded."""
    rows = _embedding_rows(model)
    n_tok = len(tok)
    if n_tok > rows:
        raise ValueError(f"tokenizer has {n_tok} tokens but the model embedding has {rows} rows "
                         f"(model.config.vocab_size={model.config.vocab_size}); the tokenizer does not match the checkpoint")
    for name in ("eos_token_id", "pad_token_id"):
        tid = getattr(tok, name, None)
        if tid is None:
            raise ValueError(f"tokenizer has no {name}; generation and SFT need it")
        if not 0 <= tid < rows:
            raise ValueError(f"tokenizer {name}={tid} is outside the model embedding (0..{rows - 1})")
    info = moe_info(model)
    if require_moe and info.num_moe_layers == 0:
        raise ValueError(f"{type(model).__name__} has no Mixture-of-Experts layer; this run needs an MoE policy "
                         "(routing replay / routing metrics)")
    if num_experts is not None and info.num_experts != num_experts:
        raise ValueError(f"expected {num_experts} experts per MoE layer but {type(model).__name__} has "
                         f"{info.num_experts} (config vs checkpoint mismatch: set model.num_experts={info.num_experts})")
    if top_k is not None and info.top_k != top_k:
        raise ValueError(f"expected top_k={top_k} but {type(model).__name__} routes to {info.top_k} experts per token "
                         f"(set model.top_k={info.top_k})")
    if task is not None:
        sample = sorted(task.alphabet)
        try:
            encode_texts(tok, ["".join(sample)])
        except Exception as exc:  # noqa: BLE001 - re-raised with context
            raise ValueError(f"the task uses characters the tokenizer cannot encode: {exc}") from exc
    return info


def _require_dir(path: str, key: str) -> str:
    path = os.path.expanduser(path)
    if not os.path.isdir(path):
        raise CheckpointNotFoundError(f"{key}={path!r} is not an existing directory (local checkpoints only; "
                                      "nothing is downloaded)")
    return path


def load_model_config(path: str, key: str = "model.path"):
    """The transformers config of the local checkpoint folder ``path`` (offline), without its weights.

    Raises :class:`CheckpointNotFoundError` naming ``key`` when the folder is missing, has no ``config.json``,
    or its ``config.json`` cannot be read as a model config.
    """
    from transformers import AutoConfig   # heavy; imported when a checkpoint is actually read

    path = _require_dir(path, key)
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise CheckpointNotFoundError(f"{key}={path!r} has no config.json: not a Hugging Face model folder")
    try:
        return AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointNotFoundError(f"{key}={path!r}: config.json is not a usable model config ({first})") from None


def require_tokenizer_files(path: str, key: str) -> str:
    """``path`` when it is a folder holding at least one of :data:`TOKENIZER_FILES`; else a one-line
    :class:`CheckpointNotFoundError` naming ``key`` and the files looked for."""
    path = _require_dir(path, key)
    if not any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES):
        hint = " (or set model.tokenizer_path to a folder that has them)" if key == "model.path" else ""
        raise CheckpointNotFoundError(f"{key}={path!r} has no tokenizer files (looked for {', '.join(TOKENIZER_FILES)})"
                                      f"{hint}")
    return path


def load_tokenizer(path: str, key: str = "model.tokenizer_path"):
    """``AutoTokenizer`` from a local directory (offline); sets ``pad_token = eos_token`` if it has none.

    ``key`` is the config key the folder came from; every error names it.
    """
    from transformers import AutoTokenizer

    path = require_tokenizer_files(path, key)
    try:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, ImportError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointNotFoundError(f"{key}={path!r}: no usable tokenizer ({first})") from None
    if tok.pad_token is None and tok.eos_token is not None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


def tokenizer_source(cfg) -> Optional[tuple[str, str]]:
    """``(folder, key)`` the tokenizer of a ``ModelConfig`` is read from: ``model.tokenizer_path`` when set, else
    ``model.path``; ``None`` for a preset (the built-in char tokenizer)."""
    if getattr(cfg, "tokenizer_path", None):
        return cfg.tokenizer_path, "model.tokenizer_path"
    if getattr(cfg, "path", None):
        return cfg.path, "model.path"
    return None


def _supports_experts_impl(config) -> bool:
    return moe_shape(config)[0] is not None


@contextlib.contextmanager
def hf_progress_bars(on: bool) -> Iterator[None]:
    """transformers' progress bars (its weight-loading bar among them) on or off for the block, restored after."""
    was_on = hf_logging.is_progress_bar_enabled()
    (hf_logging.enable_progress_bar if on else hf_logging.disable_progress_bar)()
    try:
        yield
    finally:
        (hf_logging.enable_progress_bar if was_on else hf_logging.disable_progress_bar)()


def load_checkpoint(path: str, *, dtype="float32", experts_implementation: Optional[str] = AUTO,
                    progress: bool = True):
    """``AutoModelForCausalLM`` from a local directory with ``local_files_only=True``; ``progress=False`` hides
    transformers' weight-loading bar (a run with ``logging.progress=false`` or ``--quiet``)."""
    from transformers import AutoModelForCausalLM

    config = load_model_config(path)
    kwargs = {"dtype": resolve_dtype(dtype), "local_files_only": True}
    if experts_implementation and _supports_experts_impl(config):
        kwargs["experts_implementation"] = resolve_experts_implementation(experts_implementation)
    try:
        with hf_progress_bars(progress):
            return AutoModelForCausalLM.from_pretrained(os.path.expanduser(path), **kwargs)
    except pickle.UnpicklingError as exc:   # transformers reads .bin weights with weights_only=True
        bins = ", ".join(sorted(p.name for p in Path(path).glob("*.bin"))) or "its weights"
        raise CheckpointNotFoundError(f"model.path={path!r}: {bins} refused by the safe loader (only tensors are "
                                      f"allowed): {str(exc).splitlines()[0][:200]}") from None


def build_model(cfg, tok, *, seed: Optional[int] = None, progress: bool = True):
    """Model for ``cfg`` (a ``ModelConfig``): the local checkpoint at ``cfg.path`` (``progress``: transformers'
    loading bar) or a preset sized for ``tok`` (vocabulary and pad/bos/eos ids)."""
    if getattr(cfg, "path", None):
        return load_checkpoint(cfg.path, dtype=cfg.dtype, experts_implementation=cfg.experts_implementation,
                               progress=progress)
    preset = getattr(cfg, "preset", "tiny-qwen3-moe")
    if preset == "path":
        raise ValueError("model.preset='path' needs model.path (a local Hugging Face checkpoint directory)")
    if preset not in PRESETS:
        raise ValueError(f"unknown model.preset={preset!r}; expected one of {sorted(PRESETS)} or set model.path")
    special = {"pad_token_id": tok.pad_token_id, "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id}
    return build_preset(preset, len(tok), num_layers=cfg.num_layers, hidden_size=cfg.hidden_size,
                        num_experts=cfg.num_experts, top_k=cfg.top_k, special_ids=special, dtype=cfg.dtype,
                        experts_implementation=cfg.experts_implementation, seed=seed,
                        head_dim=int(getattr(cfg, "head_dim", None) or HEAD_DIM))


def load_policy(cfg, tokenizer=None, *, seed: Optional[int] = 0, expected_num_experts: Optional[int] = None,
                expected_top_k: Optional[int] = None, require_moe: bool = False, task=None, progress: bool = True):
    """``(model, tokenizer)`` for a ``ModelConfig``, checked with :func:`check_compatibility`; ``progress=False``
    hides transformers' weight-loading bar.

    Tokenizer: the argument, else ``cfg.tokenizer_path``, else ``cfg.path``, else (preset) the built-in char tokenizer
    (with byte fallback when ``task``'s text needs it).  A preset's experts and top-k are checked against ``cfg``; a
    checkpoint's only against ``expected_num_experts``/``expected_top_k`` (``cfg``'s size fields describe presets).
    """
    if getattr(cfg, "path", None):
        load_model_config(cfg.path)   # a folder that is not a model is named as such before its tokenizer is read
    if tokenizer is None:
        source = tokenizer_source(cfg)
        tokenizer = load_tokenizer(*source) if source else embedded_tokenizer(task.alphabet if task else ())
    model = build_model(cfg, tokenizer, seed=seed, progress=progress)
    if getattr(cfg, "path", None):
        n_exp, k = expected_num_experts, expected_top_k
    else:
        is_moe_preset = getattr(cfg, "preset", "tiny-qwen3-moe") != "tiny-dense"
        n_exp = cfg.num_experts if is_moe_preset else None
        k = cfg.top_k if is_moe_preset else None
    check_compatibility(model, tokenizer, num_experts=n_exp, top_k=k, require_moe=require_moe, task=task)
    model.eval()
    return model, tokenizer
