"""Faults that run INSIDE vLLM's worker process, reached with ``LLM.collective_rpc`` (pickled by name: this module
imports nothing of pytest or the trainer).  They fire at a point the engine itself reaches, never on a timer, so a
test that uses them does not depend on how fast the CPU generates."""
from __future__ import annotations

import os
import signal
from typing import Any


def kill_at_forward(worker: Any, forward: int) -> int:
    """SIGKILL this process just before its ``forward``-th model forward from now (``forward >= 2``: after the
    first forward's tokens were sampled, so the kill lands in the middle of a generation); returns its pid."""
    if forward < 2:
        raise ValueError(f"kill_at_forward needs forward >= 2 (a kill after tokens were made), got {forward}")
    seen = [0]

    def before_forward(module: Any, args: Any) -> None:
        seen[0] += 1
        if seen[0] >= forward:
            os.kill(os.getpid(), signal.SIGKILL)

    worker.model_runner.model.register_forward_pre_hook(before_forward)
    return os.getpid()
