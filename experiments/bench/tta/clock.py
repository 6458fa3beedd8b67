"""The clock from process start: run one arm's process and note when each of its metric rows appears, and the
CPU seconds its process tree has used by then.

bench_tta.py's headline is the time a user waits from the moment they launch the command (imports, model load, the
asynchronous worker's start, the step-0 evaluation, the first step: every second charged).  The training loop's own
clock (``perf/elapsed_s``) starts after most of that, so this module watches from outside: it launches the command
with ``subprocess.Popen``, reads ``metrics.jsonl`` as it grows (every ``poll_s``, 20 ms by default: the resolution of
the clock) and stamps each new row with the seconds since launch.  A row is written right after its step (and that
step's evaluation), so the stamp of an eval row is the time from launch to the end of that evaluation.

After the command exits, :func:`watch` waits (up to :data:`SETTLE_S`) until every descendant it saw has exited too,
so that the next run starts on a quiet machine: the asynchronous arms' fork server and worker tear down torch and
transformers for a second or so after the trainer returns, and a run launched then shares the cores with them.

CPU seconds: user + system time of the process and every descendant alive at the stamp (Linux ``/proc``: our
asynchronous worker is a grandchild of the trainer, under multiprocessing's fork server), read when an eval row
appears and every second; the total at the end is the larger of the last live reading and the reaped children's
rusage (``resource.getrusage(RUSAGE_CHILDREN)`` before and after: a worker its parent never waits for is missing
there).
"""
from __future__ import annotations

import json
import os
import resource
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
SETTLE_S = 30.0     # the longest :func:`watch` waits for a command's descendants to exit after it


def _proc_cpu_s(pid: int) -> float:
    """utime + stime of one process in seconds (0 when it is gone or /proc is unavailable)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICK     # fields 14, 15 of stat(5), after "pid (comm)"


def _children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            text = (task / "children").read_text().split()
            out += [int(x) for x in text]
    except OSError:
        pass
    return out


def descendants(pid: int) -> set[int]:
    """The live descendants of ``pid`` (children, grandchildren, ...), read from ``/proc``."""
    out, todo = set(), _children(pid)
    while todo:
        p = todo.pop()
        if p not in out:
            out.add(p)
            todo += _children(p)
    return out


def _running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie (an exited process its new parent has not reaped yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def settle(pids: set[int], bound_s: float = SETTLE_S, poll_s: float = 0.02) -> float:
    """Wait until every process of ``pids`` has exited (zombies count as exited), at most ``bound_s`` seconds; the
    seconds waited.  A watched command's descendants outlive it (the workers' fork server and the workers tear
    down torch and transformers after the trainer returns, a second or so of CPU), and the next run must not start
    beside them."""
    t0 = time.perf_counter()
    while any(_running(p) for p in pids) and time.perf_counter() - t0 < bound_s:
        time.sleep(poll_s)
    return time.perf_counter() - t0


def tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of ``pid`` and all its live descendants."""
    total, todo, seen = 0.0, [pid], set()
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        total += _proc_cpu_s(p)
        todo += _children(p)
    return total


@dataclass
class Watched:
    """One watched process: its wall seconds, total CPU seconds, and per step the seconds since launch at which its
    row appeared (``seen_s``) and the tree's CPU seconds then (``cpu_s``, eval rows only)."""

    wall_s: float
    cpu_total_s: float
    seen_s: dict[int, float] = field(default_factory=dict)
    cpu_s: dict[int, float] = field(default_factory=dict)
    returncode: int = 0
    settle_s: float = 0.0       # seconds its descendants outlived it (:func:`settle`), not in ``wall_s``


def watch(cmd: list[str], metrics: Path, *, env: dict, log: Path, poll_s: float = 0.02,
          eval_key: str = "eval/accuracy") -> Watched:
    """Run ``cmd`` (stdout and stderr to ``log``), stamping each row of ``metrics`` as it appears (module
    docstring)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    out = Watched(0.0, 0.0)
    buf, offset = "", 0
    last_cpu = 0.0
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env)

        def drain() -> None:
            nonlocal buf, offset, last_cpu
            if not metrics.exists():
                return
            with open(metrics) as f:
                f.seek(offset)
                chunk = f.read()
                offset = f.tell()
            if not chunk:
                return
            now = time.perf_counter() - t0
            buf += chunk
            *lines, buf = buf.split("\n")
            for line in lines:
                if not line.strip():
                    continue
                row = json.loads(line)
                step = int(row["step"])
                out.seen_s.setdefault(step, now)
                if row.get(eval_key) is not None:
                    if proc.poll() is None:
                        last_cpu = max(last_cpu, tree_cpu_s(proc.pid))
                    out.cpu_s[step] = last_cpu     # a process already gone: its last live reading

        last_read, tree = 0.0, set()
        while proc.poll() is None:
            tree |= descendants(proc.pid)
            drain()
            if time.perf_counter() - last_read > 1.0:          # the live tree, so a worker's CPU is not lost
                last_cpu = max(last_cpu, tree_cpu_s(proc.pid))
                last_read = time.perf_counter()
            time.sleep(poll_s)
        drain()
    out.wall_s = time.perf_counter() - t0
    out.returncode = proc.returncode
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    reaped = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    out.cpu_total_s = max(reaped, last_cpu)     # an unreaped grandchild (the worker) is only in the live readings
    out.settle_s = settle(tree)
    return out


def tail(path: Path, n: int = 4000) -> str:
    """The last ``n`` characters of a text file ('' when it is missing)."""
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def process_curve(steps: list[int], eval_s: dict[int, float], seen_s: dict[int, float],
                  cpu_s: dict[int, float], wall_s: float, cpu_total_s: float) -> dict:
    """The clock from process start at each eval step: ``time_process_s`` = the row's stamp minus its own evaluation
    (every earlier evaluation charged, as ``time_s``), ``time_process_no_eval_s`` = the stamp minus every evaluation
    up to it (step 0's included), and ``cpu_s`` (the tree's CPU seconds at the stamp; NaN when not read); the end
    (``end_process_s`` = process wall seconds, ``cpu_end_s``) censors a run that never reaches its target."""
    tp, tn, cp = [], [], []
    cum = 0.0
    for s in steps:
        cum += eval_s.get(s, 0.0)
        t = seen_s.get(s)
        if t is None:
            raise ValueError(f"no stamp for eval step {s}: the row was never seen")
        tp.append(max(t - eval_s.get(s, 0.0), 0.0))
        tn.append(max(t - cum, 0.0))
        cp.append(cpu_s.get(s, float("nan")))
    return {"time_process_s": tp, "time_process_no_eval_s": tn, "cpu_s": cp, "end_process_s": wall_s,
            "end_process_no_eval_s": max(wall_s - sum(eval_s.values()), 0.0), "cpu_end_s": cpu_total_s}


def eval_seconds(rows: list[dict]) -> dict[int, float]:
    """``perf/time_eval_s`` of every row that has it, by step (step 0's evaluation included)."""
    return {int(r["step"]): float(r["perf/time_eval_s"]) for r in rows if r.get("perf/time_eval_s") is not None}


def first_at_or_above(steps: list[int], accuracy: list[float], target: float) -> Optional[int]:
    """Index of the first eval point with ``accuracy >= target``, else None."""
    for i, a in enumerate(accuracy):
        if a >= target:
            return i
    return None
