"""Graceful stop on SIGINT / SIGTERM.

Inside :func:`graceful_stop` the first SIGINT or SIGTERM only records the request; the training loop looks at it at
its next step boundary, writes a checkpoint there and raises :class:`RunInterrupted` (exit code ``128 + signal``:
130 for SIGINT, 143 for SIGTERM), so a ``--resume`` continues exactly where the run stopped.  A second signal while
the first is pending raises ``KeyboardInterrupt`` at once (stop now, without the checkpoint).  The previous handlers
are restored when the context ends.
"""
from __future__ import annotations

import contextlib
import signal
import threading
from dataclasses import dataclass
from typing import Iterator, Optional

__all__ = ["StopRequest", "RunInterrupted", "graceful_stop", "STOP_SIGNALS"]

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@dataclass
class StopRequest:
    """The stop asked for by a signal (``signum`` None while none arrived)."""

    signum: Optional[int] = None

    @property
    def requested(self) -> bool:
        """True once a stop signal arrived."""
        return self.signum is not None

    @property
    def name(self) -> str:
        """The signal's name (``SIGTERM``), empty without one."""
        return signal.Signals(self.signum).name if self.signum is not None else ""


class RunInterrupted(KeyboardInterrupt):
    """The run stopped at a step boundary because of ``signum``, after writing its checkpoint (``checkpoint``) and
    ``summary.json`` (status ``stopped``); ``exit_code`` is ``128 + signum``."""

    def __init__(self, signum: int, step: int, checkpoint: Optional[str]):
        self.signum, self.step, self.checkpoint = int(signum), int(step), checkpoint
        self.exit_code = 128 + self.signum
        where = f"checkpoint {checkpoint}" if checkpoint else "no checkpoint"
        super().__init__(f"stopped by {signal.Signals(self.signum).name} after step {self.step} ({where}); "
                         "continue it with --resume")

    def __str__(self) -> str:
        return str(self.args[0])


@contextlib.contextmanager
def graceful_stop(signals: tuple[int, ...] = STOP_SIGNALS) -> Iterator[StopRequest]:
    """Record the first of ``signals`` in the yielded :class:`StopRequest` instead of dying (see the module
    docstring).  Outside the main thread nothing is installed and the request never fires."""
    request = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield request
        return

    def handler(signum, frame):  # noqa: ARG001 - the signal module's signature
        if request.signum is not None:
            raise KeyboardInterrupt(f"second {signal.Signals(signum).name}: stopping now")
        request.signum = signum

    previous = {s: signal.signal(s, handler) for s in signals}
    try:
        yield request
    finally:
        for s, h in previous.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)
