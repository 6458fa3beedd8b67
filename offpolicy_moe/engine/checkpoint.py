"""Atomic checkpoints: ``<run_dir>/checkpoints/step_<n>/{model.pt, state.pt}``.

A checkpoint is written into a hidden temporary folder, fsynced, and renamed to ``step_<n>`` in one
``os.replace``: a run killed at any instant leaves either the previous complete checkpoint or the new complete
one, never a half-written folder that resume would pick.  ``state.pt`` holds everything else a bit-identical
resume needs (optimizer, scheduler, RNG states, buffer queue, engine version, PR2 predictors, counters, the byte
offset of ``metrics.jsonl``).
"""
from __future__ import annotations

import os
import random
import re
import shutil
import uuid
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

__all__ = ["save_checkpoint", "load_checkpoint", "latest_checkpoint", "rng_state", "set_rng_state",
           "CheckpointError"]

_STEP_RE = re.compile(r"^step_(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, unreadable or does not match the configured model."""


def rng_state() -> dict:
    """Python, numpy, torch (and CUDA) RNG states."""
    st = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def set_rng_state(st: dict) -> None:
    random.setstate(st["python"])
    np.random.set_state(st["numpy"])
    torch.set_rng_state(st["torch"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _save(obj: Any, path: Path) -> None:
    with open(path, "wb") as fh:
        torch.save(obj, fh)
        fh.flush()
        os.fsync(fh.fileno())


def save_checkpoint(ckpt_root: str | os.PathLike, step: int, model_state: dict, state: dict, *,
                    keep: int = 2) -> Path:
    """Write ``ckpt_root/step_<step>`` atomically; keep the newest ``keep`` checkpoints (0 = keep all)."""
    root = Path(ckpt_root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step}"
    tmp = root / f".tmp_step_{step}_{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        _save({k: v.detach().cpu() for k, v in model_state.items()}, tmp / "model.pt")
        _save(state, tmp / "state.pt")
        _fsync_dir(tmp)
        if final.exists():   # re-saving the same step (e.g. final save right after a periodic one)
            trash = root / f".old_step_{step}_{uuid.uuid4().hex[:8]}"
            os.replace(final, trash)
            os.replace(tmp, final)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(tmp, final)
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if keep > 0:
        for old in sorted(_complete(root))[:-keep]:
            shutil.rmtree(root / f"step_{old}", ignore_errors=True)
    for junk in root.glob(".tmp_step_*"):   # leftovers of killed runs
        if junk != tmp:
            shutil.rmtree(junk, ignore_errors=True)
    return final


def _complete(root: Path) -> list[int]:
    steps = []
    if root.is_dir():
        for p in root.iterdir():
            m = _STEP_RE.match(p.name)
            if m and (p / "model.pt").is_file() and (p / "state.pt").is_file():
                steps.append(int(m.group(1)))
    return steps


def latest_checkpoint(ckpt_root: str | os.PathLike) -> Optional[Path]:
    """The complete ``step_<n>`` folder with the largest ``n``, or None."""
    steps = _complete(Path(ckpt_root))
    return Path(ckpt_root) / f"step_{max(steps)}" if steps else None


def load_checkpoint(path: str | os.PathLike) -> tuple[dict, dict]:
    """``(model_state, state)`` of a checkpoint folder; :class:`CheckpointError` if unreadable."""
    p = Path(path)
    try:
        model_state = torch.load(p / "model.pt", map_location="cpu", weights_only=False)
        state = torch.load(p / "state.pt", map_location="cpu", weights_only=False)
    except (OSError, RuntimeError, EOFError) as exc:
        raise CheckpointError(f"cannot read checkpoint {str(p)!r}: {exc}") from exc
    return model_state, state
