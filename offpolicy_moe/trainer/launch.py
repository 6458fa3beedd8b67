"""Starting a training run: :func:`train`, and the CPU relaunch under ``accelerate launch --cpu`` (Accelerate
starts several CPU processes only through mpirun; without it this re-runs the command with torch.distributed.run).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterable, Optional

import psutil
import yaml
from accelerate.commands.launch import launch_command_parser

from offpolicy_moe.trainer.callbacks import Callback
from offpolicy_moe.trainer.checks import CheckedConfig
from offpolicy_moe.trainer.trainer import Trainer

__all__ = ["train", "cpu_launch_processes"]

_MPI_SIZE_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE", "PMIX_SIZE")


def _truthy(value: Optional[str]) -> bool:
    return str(value).strip().lower() in ("1", "true", "yes", "on")


def _accelerate_launch_num_processes(argv: list[str]) -> int:
    """``--num_processes`` of an ``accelerate launch`` command line (its flag, else its ``--config_file``), parsed
    with Accelerate's own ``launch`` argument parser (so the training command's arguments are never mistaken for
    the launcher's)."""
    if "launch" not in argv:
        return 1
    rest = argv[argv.index("launch") + 1:]
    try:
        args = launch_command_parser().parse_args(rest)
    except (Exception, SystemExit):  # noqa: BLE001 - not a launch command line we understand: no relaunch
        return 1
    n = getattr(args, "num_processes", None)
    config_file = getattr(args, "config_file", None)
    if n is None and config_file:
        try:
            n = (yaml.safe_load(Path(config_file).read_text()) or {}).get("num_processes")
        except Exception:  # noqa: BLE001 - unreadable config: no relaunch
            n = None
    try:
        return max(int(n), 1) if n is not None else 1
    except (TypeError, ValueError):
        return 1


def cpu_launch_processes(env: Optional[dict] = None, parent_argv: Optional[list[str]] = None) -> int:
    """How many CPU processes an ``accelerate launch --cpu --num_processes N`` wanted but did not start.

    Accelerate 1.15 starts several CPU processes only through ``mpirun`` (``--mpirun_hostfile``, Intel MPI / oneCCL);
    without it, ``accelerate launch --cpu --num_processes N`` (or a ``distributed_type: MULTI_CPU`` config) runs ONE
    process with ``ACCELERATE_USE_CPU`` and ``MASTER_ADDR`` set but no ``RANK`` / ``WORLD_SIZE``.  This returns
    ``N`` (read from the parent ``accelerate launch`` command line) in exactly that situation and 0 otherwise."""
    env = os.environ if env is None else env
    if not _truthy(env.get("ACCELERATE_USE_CPU")) or "MASTER_ADDR" not in env:
        return 0
    if "RANK" in env or "WORLD_SIZE" in env or any(v in env for v in _MPI_SIZE_VARS):
        return 0
    if parent_argv is None:
        try:
            parent_argv = psutil.Process(os.getppid()).cmdline()
        except Exception:  # noqa: BLE001 - no parent info: nothing to do
            return 0
    n = _accelerate_launch_num_processes(list(parent_argv))
    return n if n > 1 else 0


def _relaunch_with_torchrun(nproc: int) -> dict:
    """Start ``nproc`` gloo processes running this same command (``torch.distributed.run``), wait, and exit with
    their return code (``SystemExit``): they ran the whole command, process 0 reported the result."""
    print(f"offpolicy-moe: accelerate launch --cpu started 1 process (accelerate starts several CPU processes only "
          f"through mpirun); starting {nproc} gloo processes with torch.distributed.run", file=sys.stderr)
    env = dict(os.environ, ACCELERATE_USE_CPU="true")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", str(nproc),
           "--master_addr", env.get("MASTER_ADDR", "127.0.0.1"), "--master_port", env.get("MASTER_PORT", "29500"),
           sys.argv[0], *sys.argv[1:]]
    rc = subprocess.run(cmd, env=env).returncode
    raise SystemExit(rc)


def train(cfg: Any, *, resume: bool = False, callbacks: Optional[Iterable[Callback]] = None,
          checked: Optional[CheckedConfig] = None) -> dict:
    """Run one training run described by ``cfg`` (a ``TrainConfig``); returns the summary dict.  ``checked``: the
    result of :func:`~offpolicy_moe.trainer.checks.check_config` when the caller has checked ``cfg`` already.

    Under ``accelerate launch --cpu --num_processes N`` without mpirun (one process started, see
    :func:`cpu_launch_processes`), the command is re-run as ``N`` gloo processes by ``torch.distributed.run`` and
    this process exits with their return code (not when called with ``callbacks``: they live in this process)."""
    nproc = cpu_launch_processes() if not callbacks else 0
    if nproc > 1:
        return _relaunch_with_torchrun(nproc)
    return Trainer(cfg, resume=resume, callbacks=callbacks, checked=checked).run()
