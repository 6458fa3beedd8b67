"""The run folder: its checks, its files (``config.yaml``, ``env.json``, ``metrics.jsonl``, ``summary.json``,
``checkpoints/``) and the loggers that write into it."""
from __future__ import annotations

import importlib.metadata as md
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any, Optional

import torch

from offpolicy_moe.config.load import to_dict, to_yaml
from offpolicy_moe.run.checkpoint import (clean_checkpoint_root, latest_checkpoint, restore_metrics,
                                             resume_checkpoint)
from offpolicy_moe.run.run_dir_checks import RunDirError, check_run_dir
from offpolicy_moe.run.loggers import ConsoleLogger, JsonlLogger, MultiLogger, WandbLogger
from offpolicy_moe.run.run_lock import RunLock

__all__ = ["RunDir", "environment_info"]


def _version(pkg: str) -> Optional[str]:
    try:
        return md.version(pkg)
    except md.PackageNotFoundError:
        return None


def environment_info() -> dict:
    """Versions of the libraries a run depends on, the torch thread count and the devices."""
    info = {
        "offpolicy_moe": _version("offpolicy_moe") or "source",
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch_threads": torch.get_num_threads(),
        "cuda_available": torch.cuda.is_available(),
        "cuda_devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
    }
    for pkg in ("torch", "transformers", "accelerate", "datasets", "tokenizers", "omegaconf", "wandb"):
        info[pkg] = _version(pkg)
    return info


class RunDir:
    """One run's folder, checked at construction: writable, ``min_free_mb`` free, not in use by another live
    process (the main process takes the folder's :class:`~offpolicy_moe.run.run_lock.RunLock` until
    :meth:`close`), and (unless ``resume``) not already holding a run.  Only the main process (``is_main``) writes
    files."""

    def __init__(self, path: str | os.PathLike, *, min_free_mb: float, resume: bool, is_main: bool = True):
        self.path = check_run_dir(path, min_free_mb)       # fail fast: unwritable / full disk
        self.metrics_path = self.path / "metrics.jsonl"
        self.ckpt_root = self.path / "checkpoints"
        self.is_main = bool(is_main)
        self.jsonl: Optional[JsonlLogger] = None
        self.lock = RunLock(self.path)
        if self.is_main:
            self.lock.acquire()
        if not resume and (self.metrics_path.exists() and self.metrics_path.stat().st_size > 0
                           or latest_checkpoint(self.ckpt_root) is not None):
            self.lock.release()
            raise RunDirError(f"run folder {str(self.path)!r} already holds a run (metrics.jsonl/checkpoints); "
                              "pass --resume to continue it or choose another --run-dir")

    def close(self) -> None:
        """Release the folder's lock (the run is over in this process)."""
        self.lock.release()

    def latest_checkpoint(self) -> Optional[Path]:
        """The newest complete checkpoint folder, or None (not verified; see :meth:`resume_checkpoint`)."""
        return latest_checkpoint(self.ckpt_root)

    def resume_checkpoint(self) -> Optional[Path]:
        """The newest checkpoint whose checksums verify (a damaged newer one is skipped, saying so), or None."""
        return resume_checkpoint(self.ckpt_root, log=self._warn)

    def clean_checkpoints(self) -> None:
        """Remove what interrupted checkpoint writes left behind (main process), saying what was done."""
        if self.is_main:
            for line in clean_checkpoint_root(self.ckpt_root):
                self._warn(f"offpolicy-moe: checkpoints: {line}")

    def _warn(self, msg: str) -> None:
        if self.is_main:
            print(msg, file=sys.stderr)

    def truncate_metrics(self, offset: int) -> None:
        """Cut ``metrics.jsonl`` back to ``offset`` bytes (0 = a fresh start)."""
        if self.is_main and (offset > 0 or self.metrics_path.exists()):
            JsonlLogger.truncate(self.metrics_path, offset)

    def restore_metrics(self, offset: int, checkpoint: Path) -> None:
        """Cut ``metrics.jsonl`` back to the offset ``checkpoint`` recorded; refuse a file shorter than it or not
        ending a line there (never padded)."""
        if self.is_main:
            restore_metrics(self.metrics_path, offset, checkpoint)

    def metrics_offset(self) -> int:
        """Bytes of ``metrics.jsonl`` written so far (fsynced), 0 before the loggers are open."""
        return self.jsonl.offset() if self.jsonl is not None else 0

    def write_run_files(self, cfg: Any, chat_template: Optional[dict] = None) -> None:
        """``config.yaml`` (the resolved config), ``env.json`` (:func:`environment_info`) and ``chat_template.json``
        (whether the tokenizer's chat template was applied to the prompts, its sha256 and a rendered example)."""
        if not self.is_main:
            return
        (self.path / "config.yaml").write_text(to_yaml(cfg))
        if chat_template is not None:
            (self.path / "chat_template.json").write_text(json.dumps(chat_template, indent=2))
        try:
            env = environment_info()
        except Exception as exc:  # noqa: BLE001 - env info is best effort
            env = {"error": str(exc)}
        (self.path / "env.json").write_text(json.dumps(env, indent=2))

    def open_loggers(self, cfg: Any, *, initial_step: int) -> tuple[MultiLogger, ConsoleLogger]:
        """The run's loggers (console, ``metrics.jsonl`` always, wandb when asked) and the console logger."""
        lc = cfg.logging
        console = ConsoleLogger(cfg.trainer.steps, initial=initial_step, every=cfg.trainer.log_every,
                                progress=lc.progress and "console" in lc.loggers, is_main=self.is_main)
        loggers: list = []
        if self.is_main:
            if "console" in lc.loggers:
                loggers.append(console)
            self.jsonl = JsonlLogger(self.path)   # metrics.jsonl is the run-folder contract: always written
            loggers.append(self.jsonl)
            if "wandb" in lc.loggers and lc.wandb_mode != "disabled":
                loggers.append(WandbLogger(self.path, to_dict(cfg), project=lc.wandb_project, mode=lc.wandb_mode))
        return MultiLogger(loggers), console

    def write_summary(self, summary: dict) -> dict:
        """Atomically write ``summary.json`` (main process); returns ``summary``."""
        if self.is_main:
            tmp = self.path / ".summary.json.tmp"
            tmp.write_text(json.dumps(summary, indent=2, sort_keys=True))
            os.replace(tmp, self.path / "summary.json")
        return summary
