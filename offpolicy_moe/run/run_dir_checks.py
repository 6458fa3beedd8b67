"""Whether a run folder can be used: a run must fail at START when its folder is unwritable or the disk is (nearly)
full, not after an hour."""
from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

__all__ = ["RunDirError", "check_run_dir"]


class RunDirError(RuntimeError):
    """The run folder cannot be used (unwritable, not a folder, disk full)."""



def check_run_dir(run_dir: str | os.PathLike, min_free_mb: float = 50.0) -> Path:
    """Create ``run_dir`` if needed, prove it is writable (write+fsync+delete a probe file) and has at least
    ``min_free_mb`` MiB free; raise :class:`RunDirError` with the path and the reason otherwise."""
    path = Path(run_dir)
    if path.exists() and not path.is_dir():
        raise RunDirError(f"run folder {str(path)!r} exists and is not a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RunDirError(f"cannot create run folder {str(path)!r}: {exc.strerror or exc}") from exc
    probe = path / f".write_probe_{uuid.uuid4().hex}"
    try:
        with open(probe, "wb") as fh:
            fh.write(b"ok")
            fh.flush()
            os.fsync(fh.fileno())
    except OSError as exc:
        raise RunDirError(f"run folder {str(path)!r} is not writable: {exc.strerror or exc}") from exc
    finally:
        try:
            probe.unlink()
        except OSError:
            pass
    free_mb = shutil.disk_usage(path).free / 2**20
    if free_mb < min_free_mb:
        raise RunDirError(f"run folder {str(path)!r} has only {free_mb:.1f} MiB free; at least {min_free_mb:.0f} "
                          "MiB are needed (trainer.min_free_mb)")
    return path
