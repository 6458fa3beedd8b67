"""The pure parts of ``bench_vllm.py`` (no torch, no vLLM at import): the grid and its arms, the interleaved round
order, the few-shot prompts of a given length, the CPU-time meter, the machine description, the summary of rounds
and the markdown table.  ``worker_info`` is the one function that runs inside vLLM's worker (through
``LLM.collective_rpc``); it imports only the standard library and torch, there."""
from __future__ import annotations

import math
import os
import platform
import re
import statistics
import subprocess
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterable, Optional, Sequence

ENGINES = ("hf", "vllm")
MODES = ("inproc", "process")
ROUTES = ("off", "on")
# how vLLM samples the G answers of a prompt:
#   seeds     G requests, each its own seed, prefix caching off (what rollout.engine=vllm does today, for exact reissue)
#   n         one request with n=G (vLLM's parent request, children seeded seed, seed+1, ...), prefix caching on
#   seeds-pc  the G seeded requests of `seeds` on an engine with prefix caching on (the cache without n)
SAMPLINGS = ("seeds", "n", "seeds-pc")


def parse_ints(text: str, name: str, minimum: int = 1) -> list[int]:
    """``"32,128,512"`` -> ``[32, 128, 512]``; one-line ``ValueError`` for anything else (order kept, duplicates
    dropped)."""
    out: list[int] = []
    for part in str(text).split(","):
        part = part.strip()
        if not part:
            continue
        try:
            v = int(part)
        except ValueError:
            raise ValueError(f"--{name}: {part!r} is not an integer (a comma list like 32,128,512)") from None
        if v < minimum:
            raise ValueError(f"--{name}: {v} is below {minimum}")
        if v not in out:
            out.append(v)
    if not out:
        raise ValueError(f"--{name}: empty list")
    return out


def parse_points(text: str) -> list[tuple[int, int]]:
    """``"64:32,64:128,512:128"`` -> ``[(64, 32), (64, 128), (512, 128)]`` (hidden size : new tokens), grouped by
    hidden size in order of first appearance (one engine start per hidden size), duplicates dropped; one-line
    ``ValueError`` for anything else."""
    pts: list[tuple[int, int]] = []
    for part in str(text).split(","):
        part = part.strip()
        if not part:
            continue
        h, sep, n = part.partition(":")
        try:
            pt = (int(h), int(n))
        except ValueError:
            raise ValueError(f"--points: {part!r} is not HIDDEN:NEW_TOKENS (a comma list like 64:32,512:128)") \
                from None
        if not sep or min(pt) < 1:
            raise ValueError(f"--points: {part!r} is not HIDDEN:NEW_TOKENS with both >= 1")
        if pt not in pts:
            pts.append(pt)
    if not pts:
        raise ValueError("--points: empty list")
    order = list(dict.fromkeys(h for h, _ in pts))
    return sorted(pts, key=lambda pt: order.index(pt[0]))


def product_points(hidden: Sequence[int], new_tokens: Sequence[int]) -> list[tuple[int, int]]:
    """Every hidden size with every answer length."""
    return [(h, n) for h in hidden for n in new_tokens]


def parse_choices(text: str, name: str, allowed: Sequence[str]) -> list[str]:
    """A comma list of names from ``allowed``, in ``allowed``'s order; one-line ``ValueError`` for an unknown one."""
    got = [p.strip() for p in str(text).split(",") if p.strip()]
    bad = [p for p in got if p not in allowed]
    if bad:
        raise ValueError(f"--{name}: unknown {bad}; choose from {list(allowed)}")
    if not got:
        raise ValueError(f"--{name}: empty list")
    return [a for a in allowed if a in got]


@dataclass(frozen=True)
class Arm:
    """One engine configuration that is timed at every point: ``engine`` hf (the built-in engine) or vllm; for
    vllm its ``mode`` (inproc: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, as the rollout workers run it; process: vLLM's
    own engine process) and ``sampling`` (:data:`SAMPLINGS`); ``routes``: the engine records the expert ids of
    every token (what R3 needs)."""

    engine: str
    routes: bool
    mode: Optional[str] = None
    sampling: Optional[str] = None

    @property
    def prefix_caching(self) -> bool:
        return self.engine == "vllm" and self.sampling in ("n", "seeds-pc")

    @property
    def instance(self) -> tuple:
        """The engine instance the arm runs on: arms with equal keys share one (vLLM: mode, prefix caching,
        routes; hf: routes)."""
        if self.engine == "hf":
            return ("hf", self.routes)
        return ("vllm", self.mode, self.prefix_caching, self.routes)

    @property
    def label(self) -> str:
        if self.engine == "hf":
            name = "built-in"
        else:
            how = {"seeds": "G seeds", "n": "n=G +cache", "seeds-pc": "G seeds +cache"}[self.sampling]
            name = f"vLLM {self.mode} {how}"
        return name + (" +routes" if self.routes else "")

    def to_json(self) -> dict:
        return {**asdict(self), "label": self.label, "prefix_caching": self.prefix_caching}


def build_arms(engines: Sequence[str], modes: Sequence[str], routes: Sequence[str],
               samplings: Sequence[str]) -> list[Arm]:
    """Every arm of the grid: per routes setting the built-in engine, then vLLM's modes x samplings."""
    arms: list[Arm] = []
    for r in routes:
        on = r == "on"
        if "hf" in engines:
            arms.append(Arm("hf", on))
        if "vllm" in engines:
            arms += [Arm("vllm", on, m, s) for m in modes for s in samplings]
    return arms


def round_order(arms: Sequence[Any], r: int) -> list[Any]:
    """The arms in the order of round ``r``: forward in even rounds, reversed in odd ones (A B C, C B A, A B C, ...),
    so every arm runs as often early as late in a pair of rounds."""
    return list(arms) if r % 2 == 0 else list(reversed(arms))


def few_shot_prompt(prompt: str, shots: Iterable[str], total_tokens: int, bos: int = 1) -> str:
    """``prompt`` preceded by worked problems (``shots``, each ``"3+4=7 "``) cut to the left so that the prompt's
    encoding is exactly ``total_tokens`` tokens (``bos`` of them the tokenizer's own prefix, a character tokenizer:
    one token per character); ``total_tokens=0``: the prompt as it is."""
    if total_tokens <= 0:
        return prompt
    want = total_tokens - bos - len(prompt)
    if want < 0:
        raise ValueError(f"--prompt-tokens {total_tokens} is shorter than the prompt {prompt!r} (+{bos} bos)")
    text = ""
    shots = list(shots)
    if want and not shots:
        raise ValueError("few_shot_prompt: no worked problems to fill the prompt with")
    i = 0
    while len(text) < want:
        text += shots[i % len(shots)]
        i += 1
    return text[len(text) - want:] + prompt


def vllm_seeds(round_seed: int, prompts: int, group: int) -> list[int]:
    """The first seed of each prompt's ``group`` answers: answer ``g`` of prompt ``i`` is drawn with seed
    ``seeds[i] + g``, whether it is its own request (``seeds``) or child ``g`` of an ``n=G`` request with seed
    ``seeds[i]`` (vLLM seeds the children that way), so every vLLM arm draws the same tokens."""
    base = (int(round_seed) * 1_000_003) % (2**31 - 1)
    return [(base + i * group) % (2**31 - 1 - group) for i in range(prompts)]


# ------------------------------------------------------------------------------------------------------ CPU time
def cpu_seconds_of(times: Any) -> float:
    """User + system seconds of one process and of its children that it reaped (``psutil``'s ``cpu_times``)."""
    return float(times.user + times.system + getattr(times, "children_user", 0.0)
                 + getattr(times, "children_system", 0.0))


def split_cpu_seconds(times: dict, own: Iterable[int]) -> tuple[float, float]:
    """``(own, total)`` CPU seconds from ``{pid: cpu_times}`` of a process and its live descendants: ``total`` sums
    :func:`cpu_seconds_of` over all of them, ``own`` over the pids in ``own``.  Each process's time is counted
    once: while it lives as itself, once reaped in its parent's ``children_*`` (Linux's ``cutime``), so the
    difference of two readings is the CPU time spent in between, also by a child that started and ended in
    between, as long as a process of the set reaped it."""
    own = set(own)
    total = mine = 0.0
    for pid, t in times.items():
        s = cpu_seconds_of(t)
        total += s
        if pid in own:
            mine += s
    return mine, total


class CpuMeter:
    """CPU seconds (user + system) of process ``pid`` (default: this one) and its descendants.  ``read(roots)``
    gives ``(own, total)``: ``own`` = the process itself plus each process in ``roots`` and its descendants (an
    arm's vLLM engine-core and worker processes), ``total`` = the process and all its descendants (other engines'
    idle processes included).  Read twice and subtract."""

    def __init__(self, pid: Optional[int] = None):
        import psutil

        self._psutil = psutil
        self.root = psutil.Process(pid)

    def _descendants(self, proc: Any) -> list:
        try:
            return proc.children(recursive=True)
        except self._psutil.Error:
            return []

    def read(self, roots: Iterable[int] = (), include_self: bool = True) -> tuple[float, float]:
        own = {self.root.pid} if include_self else set()
        for pid in roots:
            try:
                proc = self._psutil.Process(pid)
            except self._psutil.Error:
                continue
            own |= {pid, *(c.pid for c in self._descendants(proc))}
        times = {}
        for p in [self.root, *self._descendants(self.root)]:
            try:
                times[p.pid] = p.cpu_times()
            except self._psutil.Error:       # ended between the listing and the reading (its reaper counts it)
                continue
        return split_cpu_seconds(times, own)


def settle(meter: CpuMeter, pids: Sequence[int], *, window: float = 0.2, quiet: float = 0.02, limit: float = 3.0,
           clock: Callable[[], float] = None, sleep: Callable[[float], None] = None) -> tuple[float, float]:
    """Wait until processes ``pids`` and their descendants burn less than ``quiet`` CPU seconds in ``window``
    seconds (at most ``limit`` seconds); returns ``(seconds waited, CPU seconds they burned meanwhile)``.  vLLM's
    worker in its own process busy-loops on its shared-memory queue for a second after its last read
    (``shm_broadcast``'s ``busy_loop_s``): that spin is waited out, so that it neither slows the next arm nor
    counts as its CPU, and it is recorded apart."""
    import time as _time

    clock = clock or _time.perf_counter
    sleep = sleep or _time.sleep
    if not pids:
        return 0.0, 0.0
    t0 = clock()
    first = last = meter.read(pids, include_self=False)[0]
    while clock() - t0 < limit:
        sleep(window)
        now = meter.read(pids, include_self=False)[0]
        if now - last < quiet:
            last = now
            break
        last = now
    return clock() - t0, last - first


def timed(call: Callable[[], Any], meter: CpuMeter, clock: Callable[[], float],
          roots: Iterable[int] = ()) -> tuple[Any, float, float, float]:
    """``(call(), wall seconds, own CPU seconds, total CPU seconds)`` (:meth:`CpuMeter.read` with ``roots``)."""
    roots = list(roots)
    (o0, a0), t0 = meter.read(roots), clock()
    out = call()
    t1 = clock()
    o1, a1 = meter.read(roots)
    return out, t1 - t0, o1 - o0, a1 - a0


# ------------------------------------------------------------------------------------------------------ machine
def cpu_model_and_flags(lscpu_text: Optional[str] = None, cpuinfo_text: Optional[str] = None) -> dict:
    """The CPU's model name (``lscpu``) and whether it has avx512f, avx2 and AMX (``amx_tile``/``amx_bf16``),
    from ``lscpu`` and ``/proc/cpuinfo`` (read here unless given)."""
    if lscpu_text is None:
        try:
            lscpu_text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10,
                                        env={**os.environ, "LC_ALL": "C"}).stdout
        except (OSError, subprocess.SubprocessError):
            lscpu_text = ""
    if cpuinfo_text is None:
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
                cpuinfo_text = f.read()
        except OSError:
            cpuinfo_text = ""
    model = next((ln.split(":", 1)[1].strip() for ln in lscpu_text.splitlines()
                  if ln.strip().lower().startswith("model name")), None)
    flags_line = next((ln.split(":", 1)[1] for ln in cpuinfo_text.splitlines() if ln.startswith("flags")), None)
    if flags_line is None:
        flags_line = next((ln.split(":", 1)[1] for ln in lscpu_text.splitlines()
                           if ln.strip().lower().startswith("flags")), "")
    flags = set(flags_line.split())
    return {"cpu_model": model or platform.processor() or None, "avx2": "avx2" in flags,
            "avx512f": "avx512f" in flags, "amx": bool({"amx_tile", "amx_bf16"} & flags),
            "amx_flags": sorted(f for f in flags if f.startswith("amx"))}


def machine_info() -> dict:
    """The machine and software the figures belong to."""
    info: dict[str, Any] = {"cpus": os.cpu_count(), "platform": platform.platform(),
                            "python": platform.python_version(), **cpu_model_and_flags()}
    try:
        info["affinity"] = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        info["affinity"] = None
    for mod in ("torch", "vllm", "transformers"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - a missing or broken package is recorded, not fatal
            info[mod] = None
    info["env"] = {k: os.environ[k] for k in sorted(os.environ)
                   if re.match(r"^(OMP_|KMP_|MKL_|VLLM_CPU_|LD_PRELOAD)", k)}
    return info


def worker_info(worker: Any) -> dict:
    """Runs inside vLLM's worker (``LLM.collective_rpc``): its process id, torch threads, CPU affinity and
    ``OMP_NUM_THREADS``."""
    import os as _os

    import torch as _torch

    try:
        aff = sorted(_os.sched_getaffinity(0))
    except (AttributeError, OSError):
        aff = None
    return {"pid": _os.getpid(), "threads": _torch.get_num_threads(), "affinity": aff,
            "omp_num_threads": _os.environ.get("OMP_NUM_THREADS")}


# ------------------------------------------------------------------------------------------------------ summary
def summarize(rounds: Sequence[dict]) -> dict:
    """Median and per-round figures of one arm at one point from its timed rounds (each ``{"tokens", "wall_s",
    "cpu_s", "cpu_s_all", ...}``): tokens/s = generated tokens / wall seconds; CPU seconds per 1,000 generated
    tokens of the arm's own processes (``cpu_s``) and of the whole process tree (``cpu_s_all``: other engines'
    idle processes too)."""
    tps = [r["tokens"] / r["wall_s"] for r in rounds if r["wall_s"] > 0]
    cpk = [1000.0 * r["cpu_s"] / r["tokens"] for r in rounds if r["tokens"] > 0]
    cpk_all = [1000.0 * r["cpu_s_all"] / r["tokens"] for r in rounds if r["tokens"] > 0 and "cpu_s_all" in r]
    spin = [r["spin_cpu_s"] for r in rounds if "spin_cpu_s" in r]
    return {"tokens_per_s": statistics.median(tps) if tps else math.nan, "tokens_per_s_rounds": tps,
            "cpu_s_per_1k": statistics.median(cpk) if cpk else math.nan, "cpu_s_per_1k_rounds": cpk,
            "cpu_s_per_1k_all": statistics.median(cpk_all) if cpk_all else math.nan,
            "spin_cpu_s": statistics.median(spin) if spin else None,
            "cpu_per_wall": statistics.median([r["cpu_s"] / r["wall_s"] for r in rounds if r["wall_s"] > 0])
            if rounds else math.nan}


def _fmt(x: Optional[float], digits: int = 0) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "—"
    return f"{x:,.{digits}f}"


def markdown_table(result: dict) -> str:
    """One markdown table of a result (``bench_vllm.py``'s JSON): a row per point and arm with tokens/s (median
    and rounds), CPU seconds per 1k tokens, the CPU seconds vLLM's own processes spun after a call (median), the
    ratio to the built-in engine with the same routes setting at the same point (medians of interleaved rounds),
    the share of prompt tokens served from the prefix cache (G-seed arms) and of the route rows recorded (vLLM),
    and the 1-minute load average during the point; then vLLM's start-ups and one line of machine and
    versions."""
    head = ("| hidden | prompt | new tokens | arm | tokens/s (median) | per round | CPU s / 1k tokens | "
            "spin after, CPU s | vs built-in | cached prompt | route rows | load 1-min |")
    lines = [head, "| ---: | ---: | ---: | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for pt in result.get("points", []):
        ref = {a["arm"]["routes"]: a["tokens_per_s"] for a in pt["arms"] if a["arm"]["engine"] == "hf"}
        loads = pt.get("load", [])
        load = f"{min(loads):.2f}–{max(loads):.2f}" if loads else "—"
        for a in pt["arms"]:
            arm = a["arm"]
            base = ref.get(arm["routes"])
            ratio = "—" if arm["engine"] == "hf" or not base else f"{a['tokens_per_s'] / base:.2f}×"
            rounds = " / ".join(_fmt(x) for x in a["tokens_per_s_rounds"])
            cached = a.get("cached_prompt_fraction")
            cov = a.get("route_coverage")
            lines.append(f"| {pt['hidden']} | {pt['prompt_tokens']} | {pt['new_tokens']} | {arm['label']} | "
                         f"{_fmt(a['tokens_per_s'])} | {rounds} | {_fmt(a['cpu_s_per_1k'], 3)} | "
                         f"{_fmt(a.get('spin_cpu_s'), 2)} | {ratio} | "
                         f"{'—' if cached is None else f'{cached:.2f}'} | "
                         f"{'—' if cov is None else f'{cov:.3f}'} | {load} |")
    if result.get("instances"):
        lines += ["", "| hidden | vLLM engine | start-up s | worker threads | worker CPUs |",
                  "| ---: | --- | ---: | ---: | --- |"]
        for i in result["instances"]:
            w = i.get("worker") if isinstance(i.get("worker"), dict) else {}
            name = ", ".join([f"vLLM {i['mode']}", *(["prefix cache"] if i["prefix_caching"] else []),
                              *(["routes"] if i["routes"] else [])])
            lines.append(f"| {i['hidden']} | {name} | {i['start_s']:.1f} | {w.get('threads', '—')} | "
                         f"{w.get('affinity', '—')} |")
    if result.get("sync"):
        lines += ["", "| hidden | parameters | engine | seconds per weight version (median) | start-up s | load |",
                  "| ---: | ---: | --- | ---: | ---: | --- |"]
        for r in result["sync"]:
            lines.append(f"| {r['hidden']} | {r['params']:,} | {r['engine']} | {r['sync_s']:.4f} | "
                         f"{r['start_s']:.1f} | {min(r['load']):.2f}–{max(r['load']):.2f} |")
    m = result.get("machine", {})
    lines.append("")
    lines.append(f"{m.get('cpu_model')} ({m.get('cpus')} CPUs; avx512f {m.get('avx512f')}, amx {m.get('amx')}), "
                 f"torch {m.get('torch')}, vLLM {m.get('vllm')}, transformers {m.get('transformers')}; "
                 f"{result.get('args', {}).get('prompts')} prompts x {result.get('args', {}).get('group')} samples, "
                 f"{result.get('args', {}).get('rounds')} interleaved rounds after a discarded warm-up, "
                 f"{result.get('args', {}).get('threads')} torch thread(s) in this process.")
    return "\n".join(lines) + "\n"
