"""Procedural arithmetic task: seeded ``a+b=`` / ``a+b-c=`` / ``a*b+c=`` problems with difficulty knobs.

A problem is ``num_terms`` non-negative operands joined by operators drawn from ``operators``
(a subset of ``"+-*"``), written without spaces and closed by ``=``: prompt ``"12+7="``, answer
``"19"``.  The answer is the value with the usual precedence (``*`` before ``+``/``-``) and may be
negative (``"3-9="`` → ``"-6"``).

Sampling: each operand first draws its number of digits uniformly in ``[min_digits, max_digits]``,
then a value uniformly among the numbers with that many digits (``0`` counts as one digit), and each
operator uniformly from ``operators``.  So easy (short) operands stay frequent when ``max_digits``
grows.

Splits: the evaluation split is ``eval_size`` *distinct* problems drawn first; the training split is
``train_size`` problems drawn with rejection of every evaluation problem (repeats allowed), so the two
are disjoint.  If the problem space is too small to hold out ``eval_size`` problems and still leave at
least half of it for training, the evaluation split is capped at half the space (with a warning).
Both splits are a pure function of ``seed`` (numpy ``SeedSequence`` streams).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from .base import PromptAnswerTask

OPERATORS = "+-*"
_DEFAULTS = {"min_digits": 1, "max_digits": 1, "num_terms": 2, "operators": "+", "reward": "exact",
             "train_size": 4096, "eval_size": 128, "seed": 1234}


@dataclass(frozen=True)
class ArithmeticSpec:
    """Difficulty knobs of the arithmetic generator."""

    min_digits: int = 1
    max_digits: int = 1
    num_terms: int = 2
    operators: str = "+"

    def __post_init__(self) -> None:
        if not (isinstance(self.min_digits, int) and self.min_digits >= 1):
            raise ValueError(f"task.min_digits must be an int >= 1, got {self.min_digits!r}")
        if not (isinstance(self.max_digits, int) and self.max_digits >= self.min_digits):
            raise ValueError(f"task.max_digits must be an int >= min_digits={self.min_digits}, got {self.max_digits!r}")
        if self.max_digits > 9:
            raise ValueError(f"task.max_digits={self.max_digits} is too large for a char-level toy task (max 9)")
        if not (isinstance(self.num_terms, int) and self.num_terms >= 2):
            raise ValueError(f"task.num_terms must be an int >= 2, got {self.num_terms!r}")
        ops = self.operators
        if not isinstance(ops, str) or not ops or any(o not in OPERATORS for o in ops) or len(set(ops)) != len(ops):
            raise ValueError(f"task.operators must be a non-empty subset of {OPERATORS!r} without repeats, got {ops!r}")

    @property
    def space_size(self) -> int:
        """Number of distinct problems (prompts) the generator can produce."""
        lo = 0 if self.min_digits == 1 else 10 ** (self.min_digits - 1)
        n_values = 10 ** self.max_digits - lo
        return n_values ** self.num_terms * len(self.operators) ** (self.num_terms - 1)


def evaluate_expression(operands: list[int], ops: list[str]) -> int:
    """Value of ``operands[0] ops[0] operands[1] ...`` with ``*`` binding tighter than ``+`` and ``-``."""
    if len(ops) != len(operands) - 1:
        raise ValueError(f"{len(operands)} operands need {len(operands) - 1} operators, got {len(ops)}")
    total, product, sign = 0, operands[0], 1
    for op, x in zip(ops, operands[1:]):
        if op == "*":
            product *= x
        elif op in "+-":
            total += sign * product
            sign, product = (1 if op == "+" else -1), x
        else:
            raise ValueError(f"unknown operator {op!r}")
    return total + sign * product


def format_problem(operands: list[int], ops: list[str]) -> tuple[str, str]:
    """``([12, 7], ["+"])`` → ``("12+7=", "19")``."""
    expr = str(operands[0]) + "".join(op + str(x) for op, x in zip(ops, operands[1:]))
    return expr + "=", str(evaluate_expression(operands, ops))


def _draw(rng: np.random.Generator, spec: ArithmeticSpec) -> tuple[str, str]:
    operands = []
    for _ in range(spec.num_terms):
        d = int(rng.integers(spec.min_digits, spec.max_digits + 1))
        lo = 0 if d == 1 else 10 ** (d - 1)
        operands.append(int(rng.integers(lo, 10 ** d)))
    ops = [spec.operators[int(rng.integers(len(spec.operators)))] for _ in range(spec.num_terms - 1)]
    return format_problem(operands, ops)


def generate_splits(spec: ArithmeticSpec, train_size: int, eval_size: int, seed: int
                    ) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """Disjoint ``(train, eval)`` lists of ``(prompt, answer)``; deterministic for ``seed``."""
    return disjoint_splits(lambda rng: _draw(rng, spec), spec.space_size, train_size, eval_size, seed)


def disjoint_splits(draw: Callable[[np.random.Generator], tuple[str, str]], space: int, train_size: int,
                    eval_size: int, seed: int) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """Disjoint ``(train, eval)`` splits of a procedural task (module docstring, "Splits"): ``eval_size``
    distinct problems from ``draw`` first (capped at half of the ``space`` distinct problems, with a warning), then
    ``train_size`` problems with every held-out prompt rejected; a pure function of ``seed``."""
    if train_size < 1:
        raise ValueError(f"task.train_size must be >= 1, got {train_size}")
    if eval_size < 0:
        raise ValueError(f"task.eval_size must be >= 0, got {eval_size}")
    n_eval = eval_size
    if eval_size > space // 2:
        n_eval = space // 2
        warnings.warn(f"the problem space has only {space} problems; eval split capped at "
                      f"{n_eval} (asked {eval_size}) so that training keeps at least half of it", stacklevel=3)
    eval_ss, train_ss = np.random.SeedSequence([int(seed), 0xA817]).spawn(2)
    rng = np.random.default_rng(eval_ss)
    eval_rows: list[tuple[str, str]] = []
    held_out: set[str] = set()
    budget = 200 * n_eval + 1000
    while len(eval_rows) < n_eval:
        budget -= 1
        if budget < 0:
            raise RuntimeError(f"could not draw {n_eval} distinct eval problems from a space of {space}")
        row = draw(rng)
        if row[0] not in held_out:
            held_out.add(row[0])
            eval_rows.append(row)
    rng = np.random.default_rng(train_ss)
    train_rows: list[tuple[str, str]] = []
    budget = 200 * train_size + 1000
    while len(train_rows) < train_size:
        budget -= 1
        if budget < 0:
            raise RuntimeError("the eval split holds nearly all the probability mass; lower task.eval_size")
        row = draw(rng)
        if row[0] not in held_out:
            train_rows.append(row)
    return train_rows, eval_rows


class ArithmeticTask(PromptAnswerTask):
    """The embedded procedural arithmetic task (see the module docstring).

    ``ArithmeticTask(cfg)`` with a :class:`~offpolicy_moe.config.schema.TaskConfig`, or keywords
    (``min_digits``, ``max_digits``, ``num_terms``, ``operators``, ``reward``, ``train_size``,
    ``eval_size``, ``seed``) that override the config's fields.
    """

    def __init__(self, cfg: Optional[object] = None, **overrides) -> None:
        # Duck-typed config (a TaskConfig or anything with these attributes); tasks sit below config
        # in the architecture, so the schema is not imported here.
        fields = {k: getattr(cfg, k, d) for k, d in _DEFAULTS.items()}
        unknown = set(overrides) - set(fields)
        if unknown:
            raise TypeError(f"unknown ArithmeticTask option(s): {sorted(unknown)}")
        fields.update(overrides)
        self.spec = ArithmeticSpec(fields["min_digits"], fields["max_digits"], fields["num_terms"],
                                   fields["operators"])
        train, eval_ = generate_splits(self.spec, int(fields["train_size"]), int(fields["eval_size"]),
                                       int(fields["seed"]))
        super().__init__(train, eval_, reward=fields["reward"], seed=int(fields["seed"]))

    def __repr__(self) -> str:
        s = self.spec
        return (f"ArithmeticTask(digits={s.min_digits}..{s.max_digits}, terms={s.num_terms}, "
                f"operators={s.operators!r}, train={len(self.train_prompts)}, eval={len(self.eval_prompts)}, "
                f"reward={self.reward_kind!r})")
