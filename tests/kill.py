"""Test helpers that kill a run, or one of its rollout workers, part-way through."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]


def train_until_checkpoint(cfg_path: Path, run_dir: Path, step: int, timeout: float,
                           tail: int = 3000) -> tuple[subprocess.Popen, list[str], dict]:
    """``offpolicy_moe train cfg_path`` in a child process, returned once ``run_dir`` holds the checkpoint of
    ``step`` (the assertion names why when the child ends first or ``timeout`` seconds pass); also the command and
    environment, for the ``--resume`` that follows."""
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled", PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "offpolicy_moe", "train", str(cfg_path)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + timeout
    while not (run_dir / "checkpoints" / f"step_{step}").exists():
        assert proc.poll() is None, proc.stderr.read().decode()[-tail:]
        assert time.time() < deadline, f"no checkpoint of step {step}"
        time.sleep(0.05)
    return proc, cmd, env


def kill_first_worker_after(step: int, killed: list[int]) -> Callable:
    """An ``on_step_end`` callback that SIGKILLs the trainer's first rollout worker at the end of ``step`` and
    appends its pid to ``killed``."""

    def kill(trainer, at: int, metrics) -> None:
        if at == step:
            pid = trainer.source.worker_pids()[0]
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    return kill
