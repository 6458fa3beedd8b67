"""The shape of ``task.rewards`` entries (:func:`parse_reward_specs`), without importing the reward functions: the
config validator checks it before any compute; :mod:`.custom_rewards` resolves and calls the functions."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from numbers import Real
from typing import Any, Mapping, Sequence

from .vocabulary import REWARD_KINDS

__all__ = ["BUILTIN_REWARDS", "RESERVED_NAMES", "RewardSpec", "parse_reward_specs"]

BUILTIN_REWARDS = REWARD_KINDS
# reward/* keys the trainer already writes, and the two counters of custom_rewards: no reward may take these names
RESERVED_NAMES = ("mean", "std", "frac_zero_std", "response_len", "adv_abs_mean", "errors", "math_timeouts")
_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


@dataclass(frozen=True)
class RewardSpec:
    """One entry of ``task.rewards``: the metric ``name``, the ``fn`` path or built-in kind, its ``weight``."""

    name: str
    fn: str
    weight: float = 1.0


def parse_reward_specs(entries: Any) -> list[RewardSpec]:
    """``task.rewards`` as :class:`RewardSpec` s; a malformed entry raises ``ValueError`` naming ``task.rewards[i]``.

    Each entry is a mapping with ``fn`` (a non-empty string), optional ``weight`` (a finite number, default 1) and
    optional ``name``; names are unique, made of ``[A-Za-z0-9_.-]``, and not one of :data:`RESERVED_NAMES`."""
    if entries is None:
        return []
    if isinstance(entries, (str, bytes)) or not isinstance(entries, Sequence):
        raise ValueError(f"task.rewards: expected a list of {{fn: ..., weight: ...}} entries, got {entries!r}")
    specs: list[RewardSpec] = []
    for i, entry in enumerate(entries):
        key = f"task.rewards[{i}]"
        if not isinstance(entry, Mapping):
            raise ValueError(f"{key}: expected a mapping {{fn: 'pkg.module:function', weight: 1.0}}, got {entry!r}")
        unknown = sorted(set(entry) - {"fn", "weight", "name"})
        if unknown:
            raise ValueError(f"{key}: unknown key(s) {unknown}; expected fn, weight, name")
        fn = entry.get("fn")
        if not isinstance(fn, str) or not fn.strip():
            raise ValueError(f"{key}.fn: expected 'pkg.module:function', 'file.py:function' or one of "
                             f"{', '.join(BUILTIN_REWARDS)}, got {fn!r}")
        fn = fn.strip()
        if fn not in BUILTIN_REWARDS and ":" not in fn:
            raise ValueError(f"{key}.fn={fn!r}: expected 'pkg.module:function', 'file.py:function' or one of "
                             f"{', '.join(BUILTIN_REWARDS)}")
        weight = entry.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, Real) or not math.isfinite(weight):
            raise ValueError(f"{key}.weight: expected a finite number, got {weight!r}")
        name = entry.get("name") or (fn if fn in BUILTIN_REWARDS else fn.rsplit(":", 1)[1])
        if not isinstance(name, str) or not _NAME.match(name):
            raise ValueError(f"{key}.name: {name!r} is not a metric name (letters, digits, _ . -)")
        if name in RESERVED_NAMES:
            raise ValueError(f"{key}.name: {name!r} is taken by the metric reward/{name}; set another name")
        if any(s.name == name for s in specs):
            raise ValueError(f"{key}.name: {name!r} is used twice; give one of them a name")
        specs.append(RewardSpec(name=name, fn=fn, weight=float(weight)))
    return specs
