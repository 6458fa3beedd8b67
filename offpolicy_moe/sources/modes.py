"""``buffer.mode`` → the batch source class that runs it: the one place the configuration's mode name is read.

Everything else asks the class (:class:`~offpolicy_moe.sources.base.BatchSource`): whether the trainer's process
builds the rollout engine (:attr:`~offpolicy_moe.sources.base.BatchSource.builds_engine`), what each worker runs
(``worker_entry``), how many past versions the preparation stage keeps (``keeps_versions``), whether its batches are
on-policy (``on_policy``), what it needs of the engine (``check_engine``) and which configurations it refuses or
ignores keys of (``check_rules``).  A new mode is one source module plus its line in :data:`MODES`.

This module imports no torch: ``offpolicy-moe train`` asks :func:`mode_of` whether to start the workers' fork
server before its heavy imports (:mod:`~offpolicy_moe.sources.fork_server`); the class itself is imported on first
use (:meth:`SourceMode.source_class`).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Optional

from offpolicy_moe.config.validate import Findings, validate

__all__ = ["MODES", "SourceMode", "check_mode", "follow_threads_problem", "mode_of", "source_class", "validate_run"]


@dataclass(frozen=True)
class SourceMode:
    """One value of ``buffer.mode``: ``source``, the ``module:Class`` of its batch source; ``forks_workers``, its
    generation runs in worker processes (or Ray actors) rather than in the trainer's process; ``random_delay``, the
    delay line releases batches after a random delay (``bounded``) rather than exactly ``k`` steps late."""

    name: str
    source: str
    forks_workers: bool
    random_delay: bool = False

    def source_class(self) -> type:
        """The class named by :attr:`source`, imported now."""
        module, _, name = self.source.partition(":")
        return getattr(importlib.import_module(module), name)


#: every ``buffer.mode`` (the schema's ``BUFFER_MODES``, in order) and the source that runs it
MODES: dict[str, SourceMode] = {m.name: m for m in (
    SourceMode("fixed", "offpolicy_moe.sources.sync:SyncBatchSource", forks_workers=False),
    SourceMode("bounded", "offpolicy_moe.sources.sync:SyncBatchSource", forks_workers=False, random_delay=True),
    SourceMode("async", "offpolicy_moe.sources.asynchronous:AsyncBatchSource", forks_workers=True),
    SourceMode("stream", "offpolicy_moe.sources.stream:StreamBatchSource", forks_workers=True),
)}


def mode_of(cfg: Any) -> SourceMode:
    """The :class:`SourceMode` of ``cfg.buffer.mode``; a one-line ``ValueError`` naming the key for an unknown one."""
    name = cfg.buffer.mode
    mode = MODES.get(name)
    if mode is None:
        raise ValueError(f"buffer.mode must be one of {sorted(MODES)}, got {name!r}")
    return mode


def source_class(cfg: Any) -> type:
    """The batch source class of ``cfg.buffer.mode`` (:func:`mode_of`)."""
    return mode_of(cfg).source_class()


def follow_threads_problem(cfg: Any) -> Optional[str]:
    """``trainer.follow_threads`` follows the cores local rollout workers leave idle: it needs a mode whose
    generation runs in workers (``forks_workers``) on this machine (``rollout.backend=local``); None when it can
    run."""
    if not cfg.trainer.follow_threads:
        return None
    if not mode_of(cfg).forks_workers:
        workers = "/".join(m.name for m in MODES.values() if m.forks_workers)
        return (f"trainer.follow_threads=true follows the cores rollout workers leave idle, but buffer.mode="
                f"{cfg.buffer.mode} has no workers: set buffer.mode={workers}, or use trainer.threads=N")
    if cfg.rollout.backend != "local":
        return (f"trainer.follow_threads=true with rollout.backend={cfg.rollout.backend}: the workers do not run on "
                "the trainer's cores; set rollout.backend=local, or use trainer.threads=N")
    return None


def _get(cfg: Any, key: str) -> Any:
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def check_mode(cfg: Any, found: Findings) -> None:
    """The rules of ``cfg``'s mode: threads that follow the workers need local workers
    (:func:`follow_threads_problem`); ``buffer.max_delay`` is read by a random delay line only (an error elsewhere);
    a key that only another source reads (its ``reads``) set away from its default has no effect (a warning); then
    the source class's own rules (``check_rules``).  An unknown mode is left to the schema's own range check."""
    mode = MODES.get(cfg.buffer.mode)
    if mode is None:
        return
    b = cfg.buffer
    follow = follow_threads_problem(cfg)
    if follow:
        found.error(follow)
    if b.max_delay is not None and not mode.random_delay:
        found.error(f"buffer.max_delay={b.max_delay} is read by buffer.mode=bounded only; buffer.mode={b.mode} "
                    "ignores it: remove it, or set buffer.mode=bounded")
    cls = mode.source_class()
    readers: dict[tuple[str, Any], list[str]] = {}
    for m in MODES.values():
        for read in m.source_class().reads:
            readers.setdefault(read, []).append(m.name)
    for (key, default), names in readers.items():
        value = _get(cfg, key)
        if (key, default) not in cls.reads and value != default:
            found.warn(f"{key}={value} has no effect with buffer.mode={b.mode}: it is read only with "
                       f"buffer.mode={'/'.join(names)}")
    cls.check_rules(cfg, found)


def validate_run(cfg: Any, *, model_is_moe: Optional[bool] = None,
                 more: tuple[Callable[[Any, Findings], None], ...] = ()) -> list[str]:
    """:func:`~offpolicy_moe.config.validate.validate` with the source's rules (:func:`check_mode`): every rule a
    run's configuration must meet, errors raised together as one :class:`~offpolicy_moe.config.validate.ConfigError`;
    returns the warnings."""
    return validate(cfg, model_is_moe=model_is_moe, more=(check_mode, *more))
