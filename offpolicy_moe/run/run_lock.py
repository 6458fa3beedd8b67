"""One live run per folder: an exclusive ``fcntl.flock`` on ``<run_dir>/.lock``.

The operating system drops the lock when its process ends, however it ends (SIGKILL included), so a crashed run
never blocks its folder; a second start, or a ``--resume`` while the first run is alive, is refused with a one-line
message naming the holder (pid, host, start time) that the holder wrote into the lock file.
"""
from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import IO, Optional

from offpolicy_moe.run.run_dir_checks import RunDirError

__all__ = ["RunLock", "LOCK_NAME"]

LOCK_NAME = ".lock"


def _holder(path: Path) -> str:
    try:
        info = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        info = {}
    if not info:
        return "another process (it has not written its pid yet)"
    return f"process {info.get('pid', '?')} on host {info.get('host', '?')} (started {info.get('started', '?')})"


class RunLock:
    """The exclusive lock of one run folder; :meth:`acquire` refuses with :class:`RunDirError` while another live
    process holds it, :meth:`release` (or the process's end) lets go."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)
        self.path = self.folder / LOCK_NAME
        self._fh: Optional[IO[str]] = None

    @property
    def held(self) -> bool:
        """True while this object holds the lock."""
        return self._fh is not None

    def acquire(self) -> "RunLock":
        """Take the lock (without waiting) and write ``{"pid", "host", "started"}`` into the lock file."""
        if self._fh is not None:
            return self
        fh = open(self.path, "a+", encoding="utf-8")     # "a+": never truncate the holder's info before locking
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            fh.close()
            raise RunDirError(f"run folder {str(self.folder)!r} is in use by {_holder(self.path)}; wait for that "
                              f"run to end or stop it (lock file {self.path})") from None
        fh.seek(0)
        fh.truncate()
        fh.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                             "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}))
        fh.flush()
        self._fh = fh
        return self

    def release(self) -> None:
        """Let go of the lock (idempotent)."""
        fh, self._fh = self._fh, None
        if fh is None:
            return
        try:
            fh.seek(0)
            fh.truncate()
            fh.flush()
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)
        finally:
            fh.close()

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
