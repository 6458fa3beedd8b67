"""Declared ranges and choices of config keys, and the one generic check that walks them.

A schema field declares its rule next to its default with :func:`ranged` (stored in the dataclass field's
``metadata``). :func:`field_problems` walks a config dataclass recursively and, for every leaf:

* every number (int or float, also inside lists/tuples such as ``optim.betas``) must be finite: NaN fails every
  ``<`` comparison, so it is refused here before any range test;
* a declared :class:`Rule` is then checked: bounds (``ge``/``gt``/``le``/``lt``), ``choices``, and ``None`` only where
  the rule says ``optional``.

Keys whose dataclass does not annotate them are checked with an explicit ``{dotted key: Rule}`` table passed as
``extra``.  Every message is one line that starts with the dotted key.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional

RULE = "offpolicy_moe.rule"


@dataclass(frozen=True)
class Rule:
    """Allowed values of one key: numeric bounds and/or a set of choices; ``optional`` admits ``None``."""

    ge: Optional[float] = None
    gt: Optional[float] = None
    le: Optional[float] = None
    lt: Optional[float] = None
    choices: Optional[tuple] = None
    optional: bool = False

    def describe(self) -> str:
        """The rule in words, e.g. ``in (0, 1]`` or ``>= 1``."""
        lo = f"[{self.ge}" if self.ge is not None else f"({self.gt}" if self.gt is not None else None
        hi = f"{self.le}]" if self.le is not None else f"{self.lt})" if self.lt is not None else None
        if lo and hi:
            return f"in {lo}, {hi}"
        if lo:
            return f">= {self.ge}" if self.ge is not None else f"> {self.gt}"
        if hi:
            return f"<= {self.le}" if self.le is not None else f"< {self.lt}"
        return "any value"

    def problem(self, value: Any) -> Optional[str]:
        """Why ``value`` breaks the rule (a phrase), or ``None`` when it is allowed."""
        if value is None:
            return None if self.optional else "must be set (null is not allowed)"
        if self.choices is not None:
            if value not in self.choices:
                return f"unknown value {value!r}; expected one of {', '.join(map(str, self.choices))}"
            return None
        bad = ((self.ge is not None and not value >= self.ge) or (self.gt is not None and not value > self.gt)
               or (self.le is not None and not value <= self.le) or (self.lt is not None and not value < self.lt))
        return f"must be {self.describe()}{' (or null)' if self.optional else ''}, got {value!r}" if bad else None


def ranged(default: Any = dataclasses.MISSING, *, default_factory: Any = dataclasses.MISSING, **rule: Any) -> Any:
    """A dataclass field with ``default`` (or ``default_factory``) whose :class:`Rule` is ``Rule(**rule)``."""
    kw: dict[str, Any] = {"metadata": {RULE: Rule(**rule)}}
    if default_factory is not dataclasses.MISSING:
        kw["default_factory"] = default_factory
    else:
        kw["default"] = default
    return dataclasses.field(**kw)


def _numbers(value: Any) -> list[float]:
    if isinstance(value, bool):
        return []
    if isinstance(value, (int, float)):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for item in value for v in _numbers(item)]
    return []


def is_finite_number(value: Any) -> bool:
    """True for an int, or a float that is neither NaN nor ±inf (bools are not numbers here)."""
    return isinstance(value, int) or (isinstance(value, float) and math.isfinite(value))


def field_problems(obj: Any, prefix: str = "", extra: Optional[Mapping[str, Rule]] = None) -> list[str]:
    """One-line problems of every leaf of the config dataclass ``obj`` (recursively), keys prefixed by ``prefix``.

    Non-finite numbers are reported first (and their range test skipped); then each field's declared rule, or the
    rule ``extra[dotted key]``.
    """
    problems: list[str] = []
    for f in dataclasses.fields(obj):
        key, value = f"{prefix}{f.name}", getattr(obj, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            problems += field_problems(value, f"{key}.", extra)
            continue
        bad = [v for v in _numbers(value) if not is_finite_number(v)]
        if bad:
            problems.append(f"{key}: must be a finite number, got {bad[0]!r}")
            continue
        rule = f.metadata.get(RULE) or (extra or {}).get(key)
        msg = rule.problem(value) if rule is not None else None
        if msg:
            problems.append(f"{key}: {msg}")
    return problems


def declared_rules(cls: type, prefix: str = "") -> dict[str, Rule]:
    """``{dotted key: Rule}`` of every field of the dataclass ``cls`` (recursively) that declares one."""
    out: dict[str, Rule] = {}
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        sub = f.default_factory if f.default_factory is not dataclasses.MISSING else None
        if isinstance(sub, type) and dataclasses.is_dataclass(sub):
            out.update(declared_rules(sub, f"{key}."))
        elif RULE in f.metadata:
            out[key] = f.metadata[RULE]
    return out
