"""Loggers: console progress bar, ``metrics.jsonl`` (the source of truth for tables/plots, keys in
:mod:`offpolicy_moe.run.metrics`), optional wandb (imported lazily, offline unless told otherwise)."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Optional

import torch

from offpolicy_moe.losses import metrics_to_floats

__all__ = ["JsonlLogger", "ConsoleLogger", "WandbLogger", "MultiLogger", "clean_metrics"]


def clean_metrics(metrics: dict) -> dict:
    """The numbers of ``metrics`` as floats (:func:`~offpolicy_moe.losses.metrics_to_floats`, one host sync), with
    non-finite values as None so the line stays valid JSON; other values are left out."""
    numeric = {k: v for k, v in metrics.items() if isinstance(v, (int, float, torch.Tensor)) and
               (not isinstance(v, torch.Tensor) or v.numel() == 1)}
    return {k: (v if math.isfinite(v) else None) for k, v in metrics_to_floats(numeric).items()}


class JsonlLogger:
    """Append one JSON line per step to ``<run_dir>/metrics.jsonl``, flushed at once; fsynced when a checkpoint
    asks for its :meth:`offset` and on :meth:`close`, so a machine crash loses only lines that resume regenerates."""

    def __init__(self, run_dir: str | os.PathLike, filename: str = "metrics.jsonl"):
        self.path = Path(run_dir) / filename
        self._fh = open(self.path, "a", encoding="utf-8")

    def log(self, step: int, metrics: dict) -> None:
        rec = {"step": int(step), **clean_metrics(metrics)}
        self._fh.write(json.dumps(rec, sort_keys=True) + "\n")
        self._fh.flush()

    def offset(self) -> int:
        """Bytes written so far (saved in checkpoints; resume truncates the file to it)."""
        self._fh.flush()
        os.fsync(self._fh.fileno())
        return self._fh.tell()

    @staticmethod
    def truncate(path: str | os.PathLike, offset: int) -> None:
        """Cut ``path`` back to ``offset`` bytes (the lines logged after the checkpoint are regenerated)."""
        p = Path(path)
        if p.exists():
            with open(p, "r+b") as fh:
                fh.truncate(offset)

    def close(self) -> None:
        if not self._fh.closed:
            self._fh.flush()
            os.fsync(self._fh.fileno())
        self._fh.close()


_POSTFIX = (("reward/mean", "reward"), ("mismatch/k3_kl", "kl"), ("routing/token_mismatch", "route"),
            ("eval/accuracy", "acc"))


class ConsoleLogger:
    """tqdm bar over trained steps (postfix: reward, mismatch KL, routing mismatch) + a text line every N steps."""

    def __init__(self, total: int, *, initial: int = 0, every: int = 10, progress: bool = True,
                 is_main: bool = True):
        self.every = max(int(every), 1)
        self.is_main = is_main
        self.bar = None
        self._last: dict[str, float] = {}
        if progress and is_main:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True)

    def write(self, msg: str) -> None:
        if not self.is_main:
            return
        if self.bar is not None:
            self.bar.write(msg)
        else:
            print(msg, flush=True)

    def log(self, step: int, metrics: dict) -> None:
        m = clean_metrics(metrics)
        self._last.update({k: v for k, v in m.items() if v is not None})
        if self.bar is not None and step > 0:
            self.bar.update(step - self.bar.n)
            self.bar.set_postfix({short: f"{self._last[k]:.3g}" for k, short in _POSTFIX if k in self._last},
                                 refresh=False)
        if step % self.every == 0 or "eval/accuracy" in m:
            parts = [f"{short}={self._last[k]:.4g}" for k, short in _POSTFIX if k in self._last]
            self.write(f"step {step}: " + " ".join(parts))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class WandbLogger:
    """Mirror of the jsonl log in wandb; lazy import; mode offline unless ``mode``/``WANDB_MODE`` says otherwise."""

    def __init__(self, run_dir: str | os.PathLike, config: dict, *, project: str, mode: Optional[str] = None,
                 name: Optional[str] = None):
        try:
            import wandb  # noqa: WPS433 (lazy on purpose)
        except ImportError as exc:   # pragma: no cover - wandb is a dependency but may be absent
            raise RuntimeError("logging.loggers lists 'wandb' but wandb is not installed: pip install wandb, "
                               "or remove 'wandb' from logging.loggers") from exc
        mode = os.environ.get("WANDB_MODE") or mode or "offline"
        self._run = wandb.init(project=project, dir=str(run_dir), config=config, mode=mode,
                               name=name or Path(run_dir).name, reinit=True)

    def log(self, step: int, metrics: dict) -> None:
        self._run.log({k: v for k, v in clean_metrics(metrics).items() if v is not None}, step=int(step))

    def close(self) -> None:
        self._run.finish()


class MultiLogger:
    """Fan out ``log``/``close`` to several loggers."""

    def __init__(self, loggers: list):
        self.loggers = loggers

    def log(self, step: int, metrics: dict) -> None:
        for lg in self.loggers:
            lg.log(step, metrics)

    def close(self) -> None:
        for lg in self.loggers:
            lg.close()
