"""Reward functions named in the config (``task.rewards``), their weighted sum and their failures.

``task.rewards: [{fn: "pkg.module:function", weight: 1.0, name: optional}, ...]``.  ``fn`` is one of

* a built-in kind: ``exact``, ``partial`` (:mod:`.rewards`) or ``math`` (:mod:`.math_answer`);
* an import path ``pkg.module:function`` (the module is imported as usual: it must be on ``sys.path``);
* a file path ``path/to/file.py:function`` for a module outside any package (relative to the working folder).

A reward function is called once per batch as ``fn(completions, answers, prompts=..., **columns)``: lists of equal
length, ``columns`` holding every other column of the rows by its dataset name (TRL's ``reward_funcs`` convention,
with verl's ``custom_reward_function`` path form); it returns one float per completion.  The task's reward is

    R_i = sum_k w_k * r_k(i)

(TRL ``GRPOTrainer``'s ``reward_weights``).  Each ``r_k`` is reported as ``reward/<name>`` (the batch mean, before the
weight); ``name`` defaults to the built-in kind or the function's ``__name__``.

A reward that raises, returns something that is not a sequence of one finite number per completion, raises
:class:`RewardError` naming the function and the row (under ``task.on_reward_error=stop``); under ``zero`` those rows
score 0 for that function and are counted in ``reward/errors``.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import math
import os
import re
import sys
from dataclasses import dataclass, field
from numbers import Real
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

from .math_answer import MathVerifier
from .reward_specs import BUILTIN_REWARDS, RESERVED_NAMES, RewardSpec, parse_reward_specs
from .rewards import compute_rewards
from .vocabulary import ON_REWARD_ERROR



class RewardError(RuntimeError):
    """A reward function failed on a batch: raised, returned the wrong length, or a non-finite / non-number value.

    ``str(err)`` is one line naming the function and the row; ``fn`` (the configured path), ``row`` (index in the
    batch, or None for the whole batch) are attributes.  Once the trainer has checkpointed the last good state
    before the error goes on (the message then says where), ``checkpoint_step`` is that state's step and
    ``checkpoint`` its folder (None on a process that does not write checkpoints); both are None before."""

    def __init__(self, message: str, *, fn: str, row: Optional[int], checkpoint_step: Optional[int] = None,
                 checkpoint: Optional[Path] = None) -> None:
        super().__init__(message)
        self.fn, self.row = fn, row
        self.checkpoint_step, self.checkpoint = checkpoint_step, checkpoint


class RewardImportError(ValueError):
    """A ``task.rewards`` entry does not resolve to a callable (one line naming the entry and the path)."""


def _file_module(path: str, what: str):
    """Import the Python file ``path`` once per process (cached in ``sys.modules`` under a name from its path)."""
    full = os.path.abspath(path)
    if not os.path.isfile(full):
        raise RewardImportError(f"{what}: file {path!r} does not exist (relative paths are read from {os.getcwd()})")
    mod_name = "offpolicy_moe_user_" + re.sub(r"\W", "_", os.path.basename(full)[:-3]) + "_" + \
        hashlib.sha1(full.encode()).hexdigest()[:10]
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    spec = importlib.util.spec_from_file_location(mod_name, full)
    if spec is None or spec.loader is None:
        raise RewardImportError(f"{what}: cannot import file {path!r}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - the user's module failed at import: one line naming it
        del sys.modules[mod_name]
        raise RewardImportError(f"{what}: importing {path!r} raised {type(exc).__name__}: {exc}") from exc
    return module


def resolve_reward(path: str, what: str = "task.rewards") -> Callable[..., Any]:
    """The callable at ``"pkg.module:function"`` or ``"path/to/file.py:function"`` (module docstring).

    Raises :class:`RewardImportError` (one line naming ``what`` and the path) when the module or the attribute is
    missing, the import fails, or the attribute is not callable."""
    target, sep, attr = path.rpartition(":")
    if not sep or not target or not attr:
        raise RewardImportError(f"{what}={path!r}: expected 'pkg.module:function' or 'file.py:function'")
    if target.endswith(".py") or os.sep in target or "/" in target:
        module = _file_module(target, f"{what}={path!r}")
    else:
        try:
            module = importlib.import_module(target)
        except ModuleNotFoundError as exc:
            raise RewardImportError(f"{what}={path!r}: cannot import module {target!r} ({exc})") from None
        except Exception as exc:  # noqa: BLE001 - the user's module failed at import: one line naming it
            raise RewardImportError(f"{what}={path!r}: importing {target!r} raised {type(exc).__name__}: "
                                    f"{exc}") from exc
    fn = module
    for part in attr.split("."):
        if not hasattr(fn, part):
            raise RewardImportError(f"{what}={path!r}: {target!r} has no attribute {attr!r}")
        fn = getattr(fn, part)
    if not callable(fn):
        raise RewardImportError(f"{what}={path!r}: {attr!r} is a {type(fn).__name__}, not a function")
    return fn


@dataclass
class RewardScores:
    """Rewards of one batch: ``total[i] = sum_k w_k parts[name_k][i]``; ``errors`` rows scored 0 after a failure
    (``on_reward_error=zero``); ``math_timeouts`` math-verify calls past their deadline (scored 0)."""

    total: list[float]
    parts: dict[str, list[float]] = field(default_factory=dict)
    errors: int = 0
    math_timeouts: int = 0

    def metrics(self) -> dict[str, float]:
        """``reward/<name>`` (batch mean of each reward, unweighted), ``reward/errors``, ``reward/math_timeouts``.

        With one reward named after the task's ``task.reward`` kind and no failures only ``reward/<kind>`` is
        reported."""
        out = {f"reward/{name}": (sum(v) / len(v) if v else 0.0) for name, v in self.parts.items()}
        out["reward/errors"] = float(self.errors)
        out["reward/math_timeouts"] = float(self.math_timeouts)
        return out


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


def _row_text(i: int, prompts: Sequence[str]) -> str:
    prompt = prompts[i] if i < len(prompts) else ""
    return f"row {i} (prompt {prompt[:60]!r})"


class RewardSet:
    """The configured rewards of a task, ready to score batches (see the module docstring).

    ``specs`` are resolved at construction (an unresolvable path raises :class:`RewardImportError` here, so a
    worker building the task fails at start, not at the first batch).  ``on_error`` is ``stop`` or ``zero``."""

    def __init__(self, specs: Sequence[RewardSpec], *, on_error: str = "stop", math_timeout_s: float = 5.0) -> None:
        if on_error not in ON_REWARD_ERROR:
            raise ValueError(f"task.on_reward_error={on_error!r} is not one of {ON_REWARD_ERROR}")
        if not specs:
            raise ValueError("a RewardSet needs at least one reward")
        self.specs = list(specs)
        self.on_error = on_error
        self.verifier: Optional[MathVerifier] = None
        self.fns: list[Callable[..., Any]] = []
        for i, s in enumerate(self.specs):
            self.fns.append(self._builtin(s.fn, math_timeout_s) if s.fn in BUILTIN_REWARDS
                            else resolve_reward(s.fn, f"task.rewards[{i}].fn"))

    def _builtin(self, kind: str, math_timeout_s: float) -> Callable[..., Any]:
        if kind == "math":
            if self.verifier is None:
                self.verifier = MathVerifier(math_timeout_s)
            verifier = self.verifier
            return lambda completions, answers, **_: verifier(completions, answers)
        return lambda completions, answers, **_: compute_rewards(completions, answers, kind)

    def score(self, completions: Sequence[str], answers: Sequence[str], *, prompts: Sequence[str] = (),
              columns: Optional[Mapping[str, Sequence[Any]]] = None) -> RewardScores:
        """Score a batch: every reward on every row, their weighted sum, per-reward values and failure counts."""
        n = len(completions)
        if len(answers) != n:
            raise ValueError(f"got {n} completions but {len(answers)} answers")
        columns = dict(columns or {})
        for key in ("completions", "answers", "prompts"):
            columns.pop(key, None)
        prompts = list(prompts)
        before = self.verifier.timeouts if self.verifier is not None else 0
        total = [0.0] * n
        parts: dict[str, list[float]] = {}
        errors = 0
        for spec, fn in zip(self.specs, self.fns):
            values, bad = self._call(spec, fn, list(completions), list(answers), prompts, columns)
            errors += bad
            parts[spec.name] = values
            total = [t + spec.weight * v for t, v in zip(total, values)]
        after = self.verifier.timeouts if self.verifier is not None else 0
        return RewardScores(total=total, parts=parts, errors=errors, math_timeouts=after - before)

    def _call(self, spec: RewardSpec, fn: Callable[..., Any], completions: list, answers: list, prompts: list,
              columns: dict) -> tuple[list[float], int]:
        """One reward on the batch: (values, rows zeroed).  A raise is retried row by row to name the row."""
        n = len(completions)
        where = f"reward {spec.name!r} ({spec.fn})"
        try:
            out = fn(completions, answers, prompts=prompts, **columns)
        except Exception as exc:  # noqa: BLE001 - a user function: reported with its row
            return self._per_row(spec, fn, completions, answers, prompts, columns, exc)
        if isinstance(out, (str, bytes)) or not isinstance(out, Sequence) and not hasattr(out, "tolist"):
            return self._fail(f"{where} returned a {type(out).__name__}, expected a list of {n} floats "
                              f"(the batch of {n} rows)", spec, None, n, list(range(n)))
        values = list(out.tolist() if hasattr(out, "tolist") else out)
        if len(values) != n:
            return self._fail(f"{where} returned {len(values)} values for a batch of {n} rows (rows 0..{n - 1})",
                              spec, None, n, list(range(n)))
        clean, bad = [], []
        for i, v in enumerate(values):
            ok = isinstance(v, Real) and not isinstance(v, bool) and math.isfinite(float(v))
            clean.append(float(v) if ok else 0.0)
            if not ok:
                bad.append(i)
        if bad:
            i = bad[0]
            msg = (f"{where} returned {values[i]!r} (not a finite number) on {_row_text(i, prompts)}"
                   + (f" and {len(bad) - 1} more row(s)" if len(bad) > 1 else ""))
            if self.on_error == "stop":
                raise RewardError(msg, fn=spec.fn, row=i)
            return clean, len(bad)
        return clean, 0

    def _per_row(self, spec, fn, completions, answers, prompts, columns, exc) -> tuple[list[float], int]:
        n = len(completions)
        where = f"reward {spec.name!r} ({spec.fn})"
        values, bad, first = [0.0] * n, [], None
        for i in range(n):
            one = {k: [v[i]] for k, v in columns.items()}
            try:
                out = fn([completions[i]], [answers[i]], prompts=prompts[i:i + 1], **one)
                v = list(out)[0] if len(out) == 1 else None
                if isinstance(v, Real) and not isinstance(v, bool) and math.isfinite(float(v)):
                    values[i] = float(v)
                    continue
            except Exception as row_exc:  # noqa: BLE001
                first = first or (i, row_exc)
                bad.append(i)
                continue
            bad.append(i)
        if first is None:          # no single row raises: the batch call itself is the problem
            msg = f"{where} raised {type(exc).__name__}: {_one_line(exc)} on the batch of {n} rows"
            return self._fail(msg, spec, None, n, list(range(n)))
        i, row_exc = first
        msg = f"{where} raised {type(row_exc).__name__}: {_one_line(row_exc)} on {_row_text(i, prompts)}"
        if self.on_error == "stop":
            raise RewardError(msg, fn=spec.fn, row=i) from row_exc
        return values, len(bad)

    def _fail(self, msg: str, spec: RewardSpec, row: Optional[int], n: int, rows: list[int]) -> tuple[list[float], int]:
        if self.on_error == "stop":
            raise RewardError(msg, fn=spec.fn, row=row)
        return [0.0] * n, len(rows)

    def close(self) -> None:
        """Stop the math-verify child process, if one runs."""
        if self.verifier is not None:
            self.verifier.close()
