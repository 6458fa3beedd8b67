"""Where the engines refuse settings: a static walk of the calls that a constructor (or the run's checks) makes
inside this project, collecting each ``raise`` that refuses a setting (its message names a config key, and it is not
a conversion inside an ``except`` block).  tests/rollout/test_engine_refusals.py holds the two sets together."""
from __future__ import annotations

import ast
import importlib
import inspect
import re
import textwrap
import types
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

# a config key as an error names it: section.key
KEY = re.compile(r"\b(?:rollout|buffer|algo|model|trainer|task)\.[a-z_]+")
# the rooms whose functions the walk follows (the engines, their samplers, the run's checks and what they call,
# and the batch sources' checks of the engine)
FOLLOWED = ("offpolicy_moe.rollout", "offpolicy_moe.trainer.checks",
            "offpolicy_moe.config.preflight", "offpolicy_moe.sources.modes", "offpolicy_moe.sources.stream",
            "offpolicy_moe.sources.asynchronous", "offpolicy_moe.sources.sync", "offpolicy_moe.sources.base")


def _tree(fn: Callable) -> Optional[ast.AST]:
    try:
        return ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return None


def refusals(fn: Callable) -> list[str]:
    """The literal text of each setting refusal raised in ``fn``'s own body (nested closures included)."""
    tree = _tree(fn)
    found: list[str] = []

    def visit(node: ast.AST, converting: bool) -> None:
        converting = converting or isinstance(node, ast.ExceptHandler)
        if isinstance(node, ast.Raise) and node.exc is not None and not converting:
            text = "".join(c.value for c in ast.walk(node.exc) if isinstance(c, ast.Constant)
                           and isinstance(c.value, str))
            if KEY.search(text):
                found.append(text)
        for child in ast.iter_child_nodes(node):
            visit(child, converting)

    if tree is not None:
        visit(tree, False)
    return found


def _owner(fn: Callable) -> Optional[type]:
    parts = fn.__qualname__.split(".")
    if len(parts) < 2 or "<locals>" in parts:
        return None
    obj: Any = importlib.import_module(fn.__module__)
    for p in parts[:-1]:
        obj = getattr(obj, p, None)
    return obj if isinstance(obj, type) else None


def _function(obj: Any) -> Optional[Callable]:
    """The plain function behind ``obj`` (a function, method, classmethod, or a class's own ``__init__``)."""
    if isinstance(obj, type):
        obj = obj.__dict__.get("__init__")
    obj = getattr(obj, "__func__", obj)
    if isinstance(obj, types.FunctionType) and obj.__module__.startswith(FOLLOWED):
        return obj
    return None


def callees(fn: Callable) -> Iterator[Callable]:
    """The project functions ``fn`` calls by a name it can resolve: a global, ``module.attr``, ``Class.attr``,
    ``self.attr`` / ``cls.attr`` / ``type(self).attr`` on its own class."""
    tree = _tree(fn)
    if tree is None:
        return
    env, owner = fn.__globals__, _owner(fn)
    for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call)):
        f, target = call.func, None
        if isinstance(f, ast.Name):
            target = env.get(f.id)
        elif isinstance(f, ast.Attribute):
            base = f.value
            if isinstance(base, ast.Name) and base.id in ("self", "cls") and owner is not None:
                target = inspect.getattr_static(owner, f.attr, None)
            elif (isinstance(base, ast.Call) and isinstance(base.func, ast.Name) and base.func.id == "type"
                  and owner is not None):
                target = inspect.getattr_static(owner, f.attr, None)
            elif isinstance(base, ast.Name) and isinstance(env.get(base.id), (types.ModuleType, type)):
                holder = env[base.id]
                target = (inspect.getattr_static(holder, f.attr, None) if isinstance(holder, type)
                          else getattr(holder, f.attr, None))
        found = _function(target)
        if found is not None:
            yield found


def reachable(roots: list[Callable]) -> dict[str, list[str]]:
    """``{qualified name: refusals}`` of every function reached from ``roots`` that refuses a setting."""
    seen: set = set()
    out: dict[str, list[str]] = {}
    todo = [f for f in (_function(r) for r in roots) if f is not None]
    while todo:
        fn = todo.pop()
        if fn in seen:
            continue
        seen.add(fn)
        found = refusals(fn)
        if found:
            out[f"{fn.__module__}.{fn.__qualname__}"] = found
        todo.extend(callees(fn))
    return out


# ---------------------------------------------------------------------------------------------------- the cases
# train's modes: every refusal is made in each, before any engine, worker or actor starts
MODES = {"sync": (), "async": ("buffer.mode=async", "buffer.staleness=1"),
         "stream": ("buffer.mode=stream", "buffer.staleness=1"),
         "ray": ("buffer.mode=async", "buffer.staleness=1", "rollout.backend=ray")}


@dataclass(frozen=True)
class Case:
    """A setting that one refusing function refuses: the overrides that ask for it and the key its one line
    names; ``machine``: where it can be asked at all ("" any, "amx" an AMX CPU, "gpu" a CUDA machine)."""

    overrides: tuple[str, ...]
    key: str
    machine: str = ""


# every refusing function the walk finds, with a setting that reaches it through `train --dry-run`; the functions of
# the built-in engine and its slots, whose refusals need a model that the embedded default is not, are reached by
# tests/rollout/test_engine_refusals.py with the model's config instead (BUILT_IN)
VLLM_CASES: dict[str, Case] = {
    "offpolicy_moe.rollout.engine.check_capabilities": Case(("rollout.engine=vllm", "rollout.top_p=0.9"),
                                                            "rollout.top_p"),
    "offpolicy_moe.rollout.engine.check_engine_name": Case(("rollout.engine=sglang",), "rollout.engine"),
    "offpolicy_moe.rollout.vllm_engine.preflight": Case(("rollout.engine=vllm", "model.head_dim=16"),
                                                        "model.head_dim"),
    "offpolicy_moe.rollout.vllm_engine._check_amx": Case(("rollout.engine=vllm", "rollout.dtype=float32"),
                                                         "rollout.dtype", machine="amx"),
    "offpolicy_moe.rollout.vllm_start.max_model_len": Case(("rollout.engine=vllm",
                                                            "rollout.vllm_max_model_len=1000000"),
                                                           "rollout.vllm_max_model_len"),
    "offpolicy_moe.rollout.vllm_start.route_source": Case(("rollout.engine=vllm", "rollout.vllm_routes=native"),
                                                          "rollout.vllm_routes"),
    "offpolicy_moe.rollout.devices.engine_gpu": Case(("rollout.engine=vllm", "rollout.vllm_devices=[99]"),
                                                     "rollout.vllm_devices", machine="gpu"),
    "offpolicy_moe.rollout.vllm_start.check_gpu_memory": Case(
        ("rollout.engine=vllm", "rollout.vllm_gpu_memory_utilization=0.999"), "rollout.vllm_gpu_memory_utilization",
        machine="gpu"),
}
BUILT_IN = ("offpolicy_moe.rollout.engine.check_native_loop", "offpolicy_moe.rollout.slots.check_slot_settings")


def constructors() -> list[Callable]:
    """Every place an engine or a stream sampler is built: ``make_engine``, each registered engine's
    ``from_config`` and constructor, the two stream samplers."""
    from offpolicy_moe.rollout import vllm_engine  # noqa: F401 - registers rollout.engine=vllm
    from offpolicy_moe.rollout.engine import ENGINES, make_engine
    from offpolicy_moe.rollout.slots import SlotSampler
    from offpolicy_moe.rollout.vllm_stream import VLLMStreamSampler

    roots: list[Callable] = [make_engine, SlotSampler, VLLMStreamSampler]
    for cls in ENGINES.values():
        roots += [cls.from_config, cls]
    return roots


def run_checks() -> list[Callable]:
    """The run's checks (``train --dry-run`` and a real start): ``check_config``, the registered engines' own
    ``check_config``, which it dispatches to by ``rollout.engine``, and the batch sources' ``check_engine``, which it
    dispatches to by ``buffer.mode`` (both dispatches tested apart)."""
    from offpolicy_moe.rollout import vllm_engine  # noqa: F401
    from offpolicy_moe.rollout.engine import ENGINES
    from offpolicy_moe.sources.modes import MODES
    from offpolicy_moe.trainer.checks import check_config

    sources = {mode.source_class() for mode in MODES.values()}
    return ([check_config] + [cls.check_config for cls in ENGINES.values()]
            + [cls.check_engine for cls in sorted(sources, key=lambda c: c.__name__)])


# vLLM's own log lines (its import prints some) are not ours: `INFO 11-28 22:55:05 [file.py:53] ...`
VLLM_LOG = re.compile(r"^(?:DEBUG|INFO|WARNING) \d\d-\d\d \d\d:\d\d:\d\d ")


def error_lines(stderr: str) -> list[str]:
    """The lines of ``stderr`` that are the project's, vLLM's own log lines left out."""
    return [x for x in stderr.splitlines() if x.strip() and not VLLM_LOG.match(x)]
