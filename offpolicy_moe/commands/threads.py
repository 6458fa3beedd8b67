"""``trainer.threads: 0`` (auto): how many CPU threads one training process uses.

The small models this project trains on a CPU are bound by per-operator dispatch, not by arithmetic, so a second
thread buys little and costs a lot as soon as a core is contended (``experiments/bench/bench_threads.py`` on a
2-core VM shared with other jobs: 1 thread took 12.8 s and 8.8 s against 73.8 s and 11.8 s for 2 threads).  So:
at most :data:`SMALL_MACHINE_CORES` cores, 1 thread per process; more cores, the cores not already busy shared among
the run's processes (:func:`choose_threads`).  An explicit ``trainer.threads=N`` is used as given; under auto,
``OMP_NUM_THREADS`` wins.
"""
from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass
from typing import Optional

#: machines with at most this many cores get 1 thread per process
SMALL_MACHINE_CORES = 2


@dataclass(frozen=True)
class ThreadChoice:
    """The thread count of one process and why it was chosen."""

    threads: int
    setting: str        # "auto" or the explicit number
    reason: str

    def as_dict(self) -> dict:
        """JSON-ready record (for ``env.json`` and ``segments.jsonl``)."""
        return asdict(self)


def choose_threads(setting: int, cores: int, load1: float, processes: int = 1,
                   env_threads: Optional[str] = None) -> ThreadChoice:
    """Threads per process for ``trainer.threads=setting`` (0 = auto) on ``cores`` cores at 1-minute load ``load1``:
    ``env_threads`` when it is a positive integer; else 1 when ``cores <= SMALL_MACHINE_CORES``; else
    ``max(1, floor((cores - load1) / processes))``."""
    if setting and setting > 0:
        return ThreadChoice(int(setting), str(setting), "trainer.threads")
    if env_threads is not None and env_threads.strip().isdigit() and int(env_threads) > 0:
        return ThreadChoice(int(env_threads), "auto", "OMP_NUM_THREADS")
    if cores <= SMALL_MACHINE_CORES:
        return ThreadChoice(1, "auto", f"{cores} cores (<= {SMALL_MACHINE_CORES}): 1 thread per process")
    free = max(0.0, cores - max(0.0, load1))
    n = max(1, math.floor(free / max(1, processes)))
    return ThreadChoice(n, "auto", f"{cores} cores, load average {load1:.1f}, {processes} process(es)")


def machine_threads(setting: int, processes: int = 1) -> ThreadChoice:
    """:func:`choose_threads` for this machine (``os.cpu_count()``, ``os.getloadavg()``, ``$OMP_NUM_THREADS``)."""
    try:
        load1 = os.getloadavg()[0]
    except OSError:          # not available on this platform
        load1 = 0.0
    return choose_threads(setting, os.cpu_count() or 1, load1, processes, os.environ.get("OMP_NUM_THREADS"))
