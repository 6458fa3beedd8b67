"""Atomic, verified checkpoints that cannot run code when read: ``<run_dir>/checkpoints/step_<n>/``.

Layout of one checkpoint (format ``offpolicy_moe.checkpoint/2``)::

    manifest.json          format, step, and the sha256 + size of every other file (plain JSON)
    model.safetensors      the policy's weights
    <name>.safetensors     other weight sets (``ref_model``, ``predictors`` for PR2), one file each
    state.pt               optimizer, scheduler, buffer queue, counters, metrics offset: tensors and plain
                           python values only, read with ``torch.load(weights_only=True)``
    rng_<rank>.pt          each process's RNG states (python, numpy, torch, CUDA), ``weights_only=True`` too

Reading never unpickles arbitrary objects: the ``.pt`` files go through torch's restricted unpickler with the
allow-list :data:`SAFE_GLOBALS` (empty), and class references inside the state are checked against
:data:`ALLOWED_STATE_CLASSES` before any module is imported by name.  ``manifest.json`` is written last and every
listed file is checked BEFORE anything is deserialised (corruption, not tampering: safety comes from the formats).
A checkpoint is written into a hidden temporary folder, fsynced, and renamed in one ``os.replace``.

Not Accelerate's ``save_state``: in accelerate 1.15 ``load_custom_state`` calls ``torch.load(weights_only=False)``
and ``load_accelerator_state`` swallows errors reading the RNG file, so a damaged or hostile file would run code or
be silently ignored.  Sharded (FSDP/ZeRO-3) optimizer states are not supported; an FSDP2-sharded model is stored as
its full state.  The previous pickle format is refused with the command that converts it (and so unpickles it)::

    python -m offpolicy_moe.run.checkpoint convert RUN_DIR/checkpoints/step_N --trust-pickle
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import pickle
import random
import re
import shutil
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import (get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)

from offpolicy_moe.run.full_state import FULL, is_sharded

__all__ = ["save_checkpoint", "load_checkpoint", "latest_checkpoint", "resume_checkpoint", "verify_checkpoint",
           "clean_checkpoint_root", "restore_metrics", "convert_legacy_checkpoint", "rng_state", "set_rng_state",
           "gather_rng_states", "full_optimizer_state", "load_full_model_state", "load_full_optimizer_state",
           "LoadedCheckpoint", "CheckpointError", "FORMAT", "SAFE_GLOBALS", "ALLOWED_STATE_CLASSES"]

FORMAT = "offpolicy_moe.checkpoint/2"
MANIFEST = "manifest.json"
MODEL_FILE = "model.safetensors"
STATE_FILE = "state.pt"
LEGACY_FILES = ("model.pt", "state.pt")
SAFE_GLOBALS: tuple = ()   # extra types the restricted unpickler may build (none needed, see module docstring)
ALLOWED_STATE_CLASSES = frozenset({"offpolicy_moe.routing.trace:RouteTrace",
                                   "offpolicy_moe.routing.pr2:PR2Features"})
_STEP_RE = re.compile(r"^step_(\d+)$")
_JUNK_RE = re.compile(r"^\.(tmp|old)_step_(\d+)_[0-9a-f]+$")
_NAME_RE = re.compile(r"^[A-Za-z0-9_]+$")
_CHUNK = 1 << 20


class CheckpointError(RuntimeError):
    """A checkpoint is missing, damaged, unsafe, or does not match the configured model."""


@dataclass
class LoadedCheckpoint:
    """What :func:`load_checkpoint` read: weights as plain tensor dicts, the state dict, this rank's RNG states."""

    path: Path
    model: dict[str, torch.Tensor]
    modules: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    state: dict = field(default_factory=dict)
    rng: Optional[dict] = None


# ---------------------------------------------------------------------------------------------------- RNG states
def rng_state() -> dict:
    """This process's python, numpy, torch (and CUDA) RNG states as tensors and plain values."""
    py = random.getstate()
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    st = {"python": {"version": int(py[0]), "state": torch.tensor(py[1], dtype=torch.int64),
                     "gauss_next": py[2]},
          "numpy": {"kind": str(kind), "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
                    "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(gauss)},
          "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def set_rng_state(st: dict) -> None:
    """Inverse of :func:`rng_state`."""
    py = st["python"]
    random.setstate((py["version"], tuple(int(x) for x in py["state"].tolist()), py["gauss_next"]))
    nps = st["numpy"]
    np.random.set_state((nps["kind"], nps["keys"].numpy().astype(np.uint32), nps["pos"], nps["has_gauss"],
                         nps["cached_gaussian"]))
    torch.set_rng_state(st["torch"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])


def gather_rng_states(accelerator: Any = None) -> list[dict]:
    """Every process's :func:`rng_state`, indexed by rank (collective: call it on every process)."""
    if accelerator is None or accelerator.num_processes == 1:
        return [rng_state()]
    out: list = [None] * accelerator.num_processes
    torch.distributed.all_gather_object(out, rng_state())
    return out


# ---------------------------------------------------------------------------------------------------- full states
def _bare(optimizer: Any) -> torch.optim.Optimizer:
    return getattr(optimizer, "optimizer", optimizer)     # Accelerate's AcceleratedOptimizer wraps the torch one


def full_optimizer_state(model: torch.nn.Module, optimizer: Any) -> dict:
    """The optimizer's state dict with full tensors; collective when the model is sharded."""
    if not is_sharded(model):
        return optimizer.state_dict()
    return get_optimizer_state_dict(model, _bare(optimizer), options=FULL)


def load_full_model_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load a full state dict (every process holds it) into a plain or sharded model (strict keys); ``state`` is
    left as it was (PyTorch's loader replaces its values by shards, so it gets a copy of the mapping)."""
    if not is_sharded(model):
        model.load_state_dict(state)
        return
    set_model_state_dict(model, dict(state), options=FULL)


def load_full_optimizer_state(model: torch.nn.Module, optimizer: Any, state: dict) -> None:
    """Load a full optimizer state dict into the optimizer of a plain or sharded model."""
    if not is_sharded(model):
        optimizer.load_state_dict(state)
        return
    set_optimizer_state_dict(model, _bare(optimizer), state, options=FULL)


# ---------------------------------------------------------------------------------------------------- writing
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


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as fh:
        os.fsync(fh.fileno())


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def _tensors(obj: Any) -> dict[str, torch.Tensor]:
    """A module's or a mapping's tensors as detached, contiguous CPU copies (copies: safetensors refuses tensors
    that share storage, e.g. tied embeddings)."""
    sd = obj.state_dict() if hasattr(obj, "state_dict") else obj
    return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in sd.items()}


def _plain(obj: Any) -> Any:
    return obj.state_dict() if hasattr(obj, "state_dict") and callable(obj.state_dict) else obj


def _write_files(tmp: Path, step: int, model: Any, modules: Mapping[str, Any], state: dict,
                 rng_states: Sequence[dict]) -> None:
    save_file(_tensors(model), str(tmp / MODEL_FILE))
    for name, mod in modules.items():
        if mod is None:
            continue
        if not _NAME_RE.match(name) or name == "model":
            raise ValueError(f"checkpoint weight-set name {name!r} must be [A-Za-z0-9_]+ and not 'model'")
        save_file(_tensors(mod), str(tmp / f"{name}.safetensors"))
    torch.save(state, tmp / STATE_FILE)
    for rank, st in enumerate(rng_states):
        torch.save(st, tmp / f"rng_{rank}.pt")
    files = sorted(p.name for p in tmp.iterdir())
    for name in files:
        _fsync_file(tmp / name)
    manifest = {"format": FORMAT, "step": int(step),
                "files": {n: {"sha256": _sha256(tmp / n), "bytes": (tmp / n).stat().st_size} for n in files}}
    with open(tmp / MANIFEST, "w", encoding="utf-8") as fh:
        json.dump(manifest, fh, indent=1, sort_keys=True)
        fh.flush()
        os.fsync(fh.fileno())


def _commit(root: Path, tmp: Path, final: Path) -> None:
    """Rename the finished ``tmp`` folder to ``final`` (replacing an existing one) durably."""
    _fsync_dir(tmp)
    if final.exists():   # re-saving the same step (e.g. final save right after a periodic one)
        trash = root / f".old_{final.name}_{uuid.uuid4().hex[:8]}"
        os.replace(final, trash)
        os.replace(tmp, final)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(tmp, final)
    _fsync_dir(root)


def save_checkpoint(ckpt_root: str | os.PathLike, step: int, *, model: Any, optimizer: Any = None,
                    scheduler: Any = None, extra: Optional[Mapping[str, Any]] = None,
                    modules: Optional[Mapping[str, Any]] = None, rng_states: Optional[Sequence[dict]] = None,
                    keep: int = 2) -> Path:
    """Write ``ckpt_root/step_<step>`` atomically; keep the newest ``keep`` checkpoints (0 = keep all).

    ``modules``: name -> module / tensor mapping / None (``<name>.safetensors``; None is skipped).  ``optimizer``,
    ``scheduler`` and the ``extra`` values form ``state.pt`` (as their ``state_dict()`` when they have one) and must
    contain only tensors and plain python values.  ``rng_states``: one :func:`rng_state` per rank (default: this
    process's only).
    """
    root = Path(ckpt_root)
    root.mkdir(parents=True, exist_ok=True)
    state = {k: _plain(v) for k, v in (extra or {}).items()}
    if optimizer is not None:
        state["optimizer"] = _plain(optimizer)
    if scheduler is not None:
        state["scheduler"] = _plain(scheduler)
    final = root / f"step_{step}"
    tmp = root / f".tmp_step_{step}_{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        _write_files(tmp, step, model, dict(modules or {}), state,
                     list(rng_states) if rng_states is not None else [rng_state()])
        _commit(root, tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if keep > 0:
        for old in sorted(_complete(root))[:-keep]:
            shutil.rmtree(root / f"step_{old}", ignore_errors=True)
    return final


# ---------------------------------------------------------------------------------------------------- finding
def _is_legacy(p: Path) -> bool:
    return not (p / MANIFEST).exists() and all((p / n).is_file() for n in LEGACY_FILES)


def _complete(root: Path) -> list[int]:
    """Steps whose folder holds a manifest (this format) or the two files of the previous format."""
    steps = []
    if root.is_dir():
        for p in root.iterdir():
            m = _STEP_RE.match(p.name)
            if m and p.is_dir() and ((p / MANIFEST).is_file() or _is_legacy(p)):
                steps.append(int(m.group(1)))
    return steps


def latest_checkpoint(ckpt_root: str | os.PathLike) -> Optional[Path]:
    """The complete ``step_<n>`` folder with the largest ``n`` (not verified), or None."""
    steps = _complete(Path(ckpt_root))
    return Path(ckpt_root) / f"step_{max(steps)}" if steps else None


def _read_manifest(p: Path) -> dict:
    mf = p / MANIFEST
    try:
        manifest = json.loads(mf.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"checkpoint file {str(mf)!r} is not a readable manifest: "
                              f"{type(exc).__name__}: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or not isinstance(
            manifest.get("files"), dict):
        raise CheckpointError(f"checkpoint file {str(mf)!r} is not a {FORMAT} manifest")
    for name in manifest["files"]:
        if not isinstance(name, str) or "/" in name or "\\" in name or name.startswith("."):
            raise CheckpointError(f"checkpoint file {str(mf)!r} lists a bad file name {name!r}")
    return manifest


def verify_checkpoint(path: str | os.PathLike) -> dict:
    """Check every file listed in ``manifest.json`` (size, then sha256) before anything is deserialised; returns
    the manifest.  :class:`CheckpointError` names the first missing, truncated or corrupted file, or gives the command
    that converts a checkpoint of the previous format."""
    p = Path(path)
    if _is_legacy(p):
        raise CheckpointError(
            f"checkpoint {str(p)!r} is in the old pickle format, which can run code when read; if you trust it, "
            f"convert it once with: python -m offpolicy_moe.run.checkpoint convert {str(p)!r} --trust-pickle")
    manifest = _read_manifest(p)
    for name, rec in sorted(manifest["files"].items()):
        f = p / name
        if not f.is_file():
            raise CheckpointError(f"checkpoint file {str(f)!r} is missing")
        size = f.stat().st_size
        if size != rec.get("bytes"):
            raise CheckpointError(f"checkpoint file {str(f)!r} has {size} bytes, manifest says {rec.get('bytes')} "
                                  "(truncated or replaced)")
        if _sha256(f) != rec.get("sha256"):
            raise CheckpointError(f"checkpoint file {str(f)!r} fails its sha256 check (corrupted)")
    return manifest


def resume_checkpoint(ckpt_root: str | os.PathLike, *,
                      log: Callable[[str], None] = lambda msg: print(msg, file=sys.stderr)) -> Optional[Path]:
    """The newest checkpoint that passes :func:`verify_checkpoint`, or None when there is none at all; a damaged
    newer one is skipped with a message through ``log``, and when every checkpoint is damaged the newest one's error
    is raised."""
    root = Path(ckpt_root)
    first_error: Optional[CheckpointError] = None
    for step in sorted(_complete(root), reverse=True):
        p = root / f"step_{step}"
        if _is_legacy(p):
            return p
        try:
            verify_checkpoint(p)
        except CheckpointError as exc:
            first_error = first_error or exc
            log(f"offpolicy-moe: warning: skipping damaged checkpoint: {exc}")
            continue
        if first_error is not None:
            log(f"offpolicy-moe: warning: falling back to the newest intact checkpoint {str(p)!r}")
        return p
    if first_error is not None:
        raise CheckpointError(f"no intact checkpoint: {first_error}")
    return None


def clean_checkpoint_root(ckpt_root: str | os.PathLike) -> list[str]:
    """Remove what interrupted writes leave (main process, on start); returns one line per action.

    ``.tmp_step_*`` folders are removed; a ``.old_step_<n>_*`` folder is renamed back to ``step_<n>`` when that
    folder is missing and it verifies (a kill between the two renames of a re-save), else removed; a ``step_<n>``
    folder with neither a manifest nor the previous format's two files is removed."""
    root = Path(ckpt_root)
    done: list[str] = []
    if not root.is_dir():
        return done
    for p in sorted(root.iterdir()):
        m = _JUNK_RE.match(p.name)
        if m and p.is_dir():
            final = root / f"step_{m.group(2)}"
            if m.group(1) == "old" and not final.exists() and _intact(p):
                os.replace(p, final)
                done.append(f"restored {final.name} from {p.name}")
            else:
                shutil.rmtree(p, ignore_errors=True)
                done.append(f"removed {p.name}")
        elif _STEP_RE.match(p.name) and p.is_dir() and not (p / MANIFEST).is_file() and not _is_legacy(p):
            shutil.rmtree(p, ignore_errors=True)
            done.append(f"removed incomplete {p.name}")
    if done:
        _fsync_dir(root)
    return done


def _intact(p: Path) -> bool:
    try:
        verify_checkpoint(p)
    except CheckpointError:
        return False
    return True


# ---------------------------------------------------------------------------------------------------- reading
def _load_weights(f: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(f), device="cpu")
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint file {str(f)!r} is not a valid safetensors file: "
                              f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None


def _load_plain(f: Path) -> Any:
    """``torch.load(weights_only=True)`` with the explicit allow-list; any other object is refused unrun."""
    try:
        with torch.serialization.safe_globals(list(SAFE_GLOBALS)):
            return torch.load(f, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, OSError, EOFError, ValueError, TypeError, AttributeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"checkpoint file {str(f)!r} was refused (only tensors and plain values are "
                              f"allowed): {first}") from None


def _check_class_refs(obj: Any, f: Path) -> None:
    """Refuse ``{"__class__": ...}`` records naming anything outside :data:`ALLOWED_STATE_CLASSES`."""
    stack = [obj]
    while stack:
        o = stack.pop()
        if isinstance(o, dict):
            ref = o.get("__class__")
            if ref is not None and ref not in ALLOWED_STATE_CLASSES:
                raise CheckpointError(f"checkpoint file {str(f)!r} names class {ref!r}, which is not allowed")
            stack.extend(o.values())
        elif isinstance(o, (list, tuple)):
            stack.extend(o)


def load_checkpoint(path: str | os.PathLike, *, rank: int = 0,
                    require: Sequence[str] = ("optimizer", "scheduler")) -> LoadedCheckpoint:
    """Verify (:func:`verify_checkpoint`) and read a checkpoint folder, with rank ``rank``'s RNG states.

    Raises :class:`CheckpointError` (one line, naming the file) for a missing, damaged or unsafe file, or when the
    state lacks one of the ``require`` keys."""
    p = Path(path)
    if not p.is_dir():
        raise CheckpointError(f"checkpoint {str(p)!r} is not a folder")
    manifest = verify_checkpoint(p)
    files = manifest["files"]
    if MODEL_FILE not in files or STATE_FILE not in files:
        raise CheckpointError(f"checkpoint file {str(p / MANIFEST)!r} lists no {MODEL_FILE} or no {STATE_FILE}")
    model = _load_weights(p / MODEL_FILE)
    modules = {n[:-len(".safetensors")]: _load_weights(p / n) for n in sorted(files)
               if n.endswith(".safetensors") and n != MODEL_FILE}
    state = _load_plain(p / STATE_FILE)
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint file {str(p / STATE_FILE)!r} does not hold a dict")
    missing = [k for k in require if k not in state]
    if missing:
        raise CheckpointError(f"checkpoint file {str(p / STATE_FILE)!r} has no {', '.join(map(repr, missing))} "
                              "entry")
    _check_class_refs(state, p / STATE_FILE)
    rng_name = f"rng_{rank}.pt"
    if rng_name not in files:
        raise CheckpointError(f"checkpoint {str(p)!r} has no RNG states for process {rank} ({rng_name})")
    rng = _load_plain(p / rng_name)
    return LoadedCheckpoint(path=p, model=model, modules=modules, state=state, rng=rng)


def restore_metrics(path: str | os.PathLike, offset: int, checkpoint: str | os.PathLike = "") -> None:
    """Cut ``metrics.jsonl`` back to the byte ``offset`` a checkpoint recorded.  A file shorter than ``offset``, or
    not ending a line there, was cut or replaced after the checkpoint: :class:`CheckpointError` (never padded)."""
    p = Path(path)
    size = p.stat().st_size if p.exists() else 0
    where = f" recorded by checkpoint {str(checkpoint)!r}" if checkpoint else ""
    if size < offset:
        raise CheckpointError(f"{str(p)!r} has {size} bytes, fewer than the {offset}{where}: it was cut or "
                              "replaced; restore it (or start a new run folder) to resume")
    if offset > 0:
        with open(p, "rb") as fh:
            fh.seek(offset - 1)
            if fh.read(1) != b"\n":
                raise CheckpointError(f"{str(p)!r} does not end a line at byte {offset}{where}: it was replaced; "
                                      "restore it (or start a new run folder) to resume")
    if p.exists():
        with open(p, "r+b") as fh:
            fh.truncate(offset)
            fh.flush()
            os.fsync(fh.fileno())


# ---------------------------------------------------------------------------------------------------- old format
def _legacy_rng(st: dict) -> dict:
    """An RNG dict of the previous format (``numpy`` as the ``np.random.get_state()`` tuple) in this format."""
    kind, keys, pos, has_gauss, gauss = st["numpy"]
    py = st["python"]
    out = {"python": {"version": int(py[0]), "state": torch.tensor(py[1], dtype=torch.int64),
                      "gauss_next": py[2]},
           "numpy": {"kind": str(kind), "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
                     "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(gauss)},
           "torch": st["torch"]}
    if "cuda" in st:
        out["cuda"] = st["cuda"]
    return out


def convert_legacy_checkpoint(path: str | os.PathLike, *, trust_pickle: bool = False) -> Path:
    """Rewrite a checkpoint of the previous format (``model.pt`` + ``state.pt`` pickles) in this format, in place.

    Unpickling the old files can run any code they carry, so this refuses unless ``trust_pickle`` is True.  The old
    single RNG state (rank 0's, which old resumes applied on every rank) is written for every rank."""
    p = Path(path)
    if not _is_legacy(p):
        raise CheckpointError(f"{str(p)!r} is not a checkpoint of the old format (model.pt + state.pt)")
    if not trust_pickle:
        raise CheckpointError(f"converting {str(p)!r} unpickles it, which can run code: pass --trust-pickle "
                              "(trust_pickle=True) only for a checkpoint you wrote yourself")
    model_state = torch.load(p / "model.pt", map_location="cpu", weights_only=False)
    state = dict(torch.load(p / "state.pt", map_location="cpu", weights_only=False))
    modules = {"ref_model": state.pop("ref_model", None), "predictors": state.pop("predictors", None)}
    rng = _legacy_rng(state.pop("rng"))
    rngs = [rng] * int(state.get("world_size", 1) or 1)
    step = int(state.get("step", int(_STEP_RE.match(p.name).group(1)) if _STEP_RE.match(p.name) else 0))
    tmp = p.parent / f".tmp_step_{step}_{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        _write_files(tmp, step, model_state, modules, state, rngs)
        _commit(p.parent, tmp, p)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m offpolicy_moe.run.checkpoint {verify,convert} PATH [--trust-pickle]``."""
    ap = argparse.ArgumentParser(prog="python -m offpolicy_moe.run.checkpoint")
    ap.add_argument("action", choices=("verify", "convert"))
    ap.add_argument("path", help="a checkpoint folder (RUN_DIR/checkpoints/step_N)")
    ap.add_argument("--trust-pickle", action="store_true",
                    help="convert: allow unpickling the old-format files (only for checkpoints you wrote)")
    args = ap.parse_args(argv)
    try:
        if args.action == "verify":
            verify_checkpoint(args.path)
            print(f"{args.path}: intact")
        else:
            convert_legacy_checkpoint(args.path, trust_pickle=args.trust_pickle)
            print(f"{args.path}: converted to {FORMAT}")
    except CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
