"""Every check a real start makes before compute, without building the model's weights (``train --dry-run``).

:func:`preflight` runs :func:`~offpolicy_moe.config.validate.validate`, then the checks that read files:

* the task is built: a ``jsonl:`` file is read and parsed (errors name ``task.name``, the file and the line);
* ``model.path`` is a model folder whose ``config.json`` loads as a transformers config, and the tokenizer folder
  (``model.tokenizer_path``, else ``model.path``) holds tokenizer files and loads (errors name the key the user set);
* the model's shape: ``model.path``'s ``vocab_size`` holds the tokenizer; a built-in preset's config object is built
  (no weights) from the configured sizes (replay on a dense model is refused by ``validate``, which reads the
  expert count with :func:`~offpolicy_moe.models.moe_shape`);
* the task's characters can be encoded, and its answers fit in ``rollout.max_new_tokens`` (an error when none does:
  the exact-match reward would always be 0; a warning when some do not);
* an experts kernel that needs a GPU and the ``kernels`` package (``model.experts_implementation=deepgemm`` or
  ``sonicmoe``) is refused where they are missing (otherwise the first forward fails inside transformers).

The staleness buffer's feasibility is checked by the sources layer; see ``offpolicy_moe.sources.buffer``.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from offpolicy_moe.config.validate import Findings, validate
from offpolicy_moe.models import PRESETS, CheckpointNotFoundError, load_model_config, load_tokenizer, tokenizer_source
from offpolicy_moe.tasks import (PromptAnswerTask, RewardImportError, embedded_tokenizer, encode_texts, make_task,
                                 render_prompt)


@dataclass
class CheckedConfig:
    """What the checks before compute found and built: the warnings, and the task (built once, here; the trainer
    takes it instead of building it again)."""

    warnings: list[str] = field(default_factory=list)
    task: Optional[PromptAnswerTask] = None
    model_config: Any = None          # the policy's transformers config (read from model.path, or the preset's)


def preflight(cfg: Any) -> list[str]:
    """Validate ``cfg`` and run the file-reading checks of the module docstring; return the warnings.

    Raises :class:`~offpolicy_moe.config.validate.ConfigError` listing every problem, each one line naming its key.
    """
    return preflight_checked(cfg).warnings


def preflight_checked(cfg: Any, *, more: tuple[Callable[[Any, Findings], None], ...] = ()) -> CheckedConfig:
    """:func:`preflight`, returning the task it built with the warnings; ``more``: rules that :func:`validate` adds
    (the batch source's, from :func:`offpolicy_moe.trainer.checks.check_config`)."""
    warnings = validate(cfg, more=more)
    found = Findings()
    task = check_task_data(cfg, found)
    model_config = check_model_folder(cfg, found)
    tok = check_tokenizer(cfg, found, task)
    model_config = check_model_shape(cfg, found, model_config, tok)
    check_experts_kernel(cfg, found)
    if task is not None and tok is not None:
        check_answers_fit(cfg, found, task, tok)
        check_chat_template(cfg, found, task, tok)
    found.raise_if_errors()
    return CheckedConfig(warnings + found.warnings, task, model_config)


#: experts implementations that run only as CUDA kernels loaded through the ``kernels`` package
GPU_KERNEL_EXPERTS = ("deepgemm", "sonicmoe")


def check_experts_kernel(cfg: Any, found: Findings) -> None:
    """``model.experts_implementation`` names a GPU kernel (:data:`GPU_KERNEL_EXPERTS`): refused without CUDA or
    without the ``kernels`` package (transformers loads the kernel from it)."""
    name = cfg.model.experts_implementation
    if name not in GPU_KERNEL_EXPERTS:
        return
    missing = [what for what, ok in (("a CUDA GPU", torch.cuda.is_available()),
                                     ("the `kernels` package", importlib.util.find_spec("kernels") is not None))
               if not ok]
    if missing:
        found.error(f"model.experts_implementation={name} is a GPU kernel and needs {' and '.join(missing)} here; "
                    "use auto, eager, grouped_mm or batched_mm")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def check_task_data(cfg: Any, found: Findings) -> Optional[PromptAnswerTask]:
    """Build the task as the trainer does; a bad or missing task file becomes one error naming ``task.name``."""
    try:
        return make_task(cfg.task)
    except RewardImportError as exc:        # names task.rewards[i].fn and the path itself
        found.error(_first_line(exc))
        return None
    except (ValueError, TypeError, OSError) as exc:
        found.error(f"task.name={cfg.task.name!r}: {_first_line(exc)}")
        return None


def check_chat_template(cfg: Any, found: Findings, task: PromptAnswerTask, tok: Any) -> None:
    """``task.chat_template=auto`` with a tokenizer that has a template: the first prompt renders and encodes."""
    if cfg.task.chat_template != "auto" or not getattr(tok, "chat_template", None) or not task.train_prompts:
        return
    try:
        encode_texts(tok, [render_prompt(tok, task.train_prompts[0])])
    except Exception as exc:  # noqa: BLE001 - jinja / tokenizer errors of a user's template, one line
        found.error(f"task.chat_template=auto: the tokenizer's chat template fails on the first prompt: "
                    f"{_first_line(exc)}")


def check_model_folder(cfg: Any, found: Findings):
    """The transformers config of ``model.path`` (``None`` for a preset, or when it cannot be read: then an error)."""
    if not cfg.model.path:
        return None
    try:
        return load_model_config(cfg.model.path)
    except CheckpointNotFoundError as exc:
        found.error(_first_line(exc))
        return None


def check_tokenizer(cfg: Any, found: Findings, task: Any = None):
    """The tokenizer a real start would use: loaded from its folder, or the built-in character tokenizer (with byte
    fallback when the task's text needs it)."""
    source = tokenizer_source(cfg.model)
    if source is None:
        return embedded_tokenizer(task.alphabet if task is not None else ())
    try:
        return load_tokenizer(*source)
    except CheckpointNotFoundError as exc:
        found.error(_first_line(exc))
        return None


def check_model_shape(cfg: Any, found: Findings, model_config: Any, tok: Any) -> Any:
    """``model.path``: the tokenizer fits the embedding (``vocab_size``); a preset: its config object builds.
    Returns the policy's transformers config (``None`` when it could not be had)."""
    m = cfg.model
    if model_config is not None:
        rows = getattr(model_config, "vocab_size", None) or getattr(getattr(model_config, "text_config", None),
                                                                      "vocab_size", None)
        if tok is not None and isinstance(rows, int) and len(tok) > rows:
            found.error(f"model.path={m.path!r}: the tokenizer has {len(tok)} tokens but the model's vocab_size is "
                        f"{rows}; the tokenizer does not match the checkpoint")
        return model_config
    if m.path or m.preset not in PRESETS or tok is None:
        return None
    make_config = PRESETS[m.preset][0]
    special = {"pad_token_id": tok.pad_token_id, "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id}
    sizes = {"head_dim": m.head_dim} if m.head_dim is not None else {}
    try:
        return make_config(len(tok), num_layers=m.num_layers, hidden_size=m.hidden_size, num_experts=m.num_experts,
                           top_k=m.top_k, special_ids=special, experts_implementation=m.experts_implementation,
                           **sizes)
    except (ValueError, TypeError) as exc:
        found.error(f"model.preset={m.preset!r}: cannot build its config: {_first_line(exc)}")
        return None


def check_answers_fit(cfg: Any, found: Findings, task: PromptAnswerTask, tok: Any) -> None:
    """Every character of the task encodes; answers fit in ``rollout.max_new_tokens`` (error if none does)."""
    answers = sorted({a.strip() for a in task.train_answers + task.eval_answers})
    try:
        lengths = [len(ids) for ids in encode_texts(tok, answers)]
        encode_texts(tok, ["".join(sorted(task.alphabet))])
    except (ValueError, KeyError) as exc:
        found.error(f"task.name={cfg.task.name!r}: the tokenizer cannot encode the task: {_first_line(exc)}")
        return
    limit = cfg.rollout.max_new_tokens
    too_long = sum(n > limit for n in lengths)
    if too_long == len(lengths):
        found.error(f"rollout.max_new_tokens={limit}: no answer of task.name={cfg.task.name!r} fits (the shortest "
                    f"takes {min(lengths)} tokens), so every exact-match reward is 0; raise rollout.max_new_tokens "
                    f"(the longest answer and its eos take {max(lengths) + 1})")
    elif too_long:
        found.warn(f"rollout.max_new_tokens={limit}: {too_long} of {len(lengths)} distinct answers of "
                   f"task.name={cfg.task.name!r} need more tokens (up to {max(lengths)}) and can never be matched")
