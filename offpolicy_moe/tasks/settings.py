"""What a built-in task needs of the keys outside ``task.*``, worked out from its options alone.

The only such key today is ``rollout.max_new_tokens``, the most tokens generated per response: the RL rollouts and
the greedy evaluation (which generates as many) both read it.  A response is trained and scored as the reference
followed by eos (the SFT warm start teaches ``answer + eos``), so the task needs its longest reference plus one.

Each built-in task's longest reference follows from its options, without drawing a problem (so loading a config
stays cheap and imports no torch):

* ``arithmetic``: the longest of its largest value and, when ``-`` is an operator, its most negative one (every
  operand the largest number of ``max_digits`` digits; ``*`` multiplies them all);
* ``reverse``: ``max_digits`` digits;
* ``chain``: the worked sum of ``num_terms`` operands that all are the largest number of ``max_digits`` digits (each
  step is then as long as a step can be: ``"9+9+9="`` -> ``"18+9=27"``, 7);
* ``longtail``: the chain's longest at each number of terms up to ``max_terms``, cut to what the embedded model's
  :data:`POSITIONS` leave after bos, the prompt and eos (the task draws a longer problem again): 224 at 15 terms.

Lengths are counted in characters, one token each in the embedded character tokenizer (a checkpoint's byte-level
tokenizer takes no more for these ASCII answers); the start-up check
(``offpolicy_moe.config.preflight.check_answers_fit``) measures the built task's answers with the tokenizer in use.
:func:`task_settings` never goes below :data:`BASE_MAX_NEW_TOKENS` (4), so the default task (3 one-digit terms, up to
``"27"``: 2 tokens + eos) keeps 4.  A task read from disk
(``dataset:``, ``jsonl:``) is not read here: it gets :data:`BASE_MAX_NEW_TOKENS` and the start-up check; so do
options the task itself refuses.

This module imports no torch: the config schema imports it (:class:`offpolicy_moe.config.schema.TrainConfig`
resolves a ``rollout.max_new_tokens`` the config leaves out with it).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

#: ``rollout.max_new_tokens`` of a task whose references this module cannot know (a dataset on disk), and the least
#: a built-in task gets (the default task's answers need 3; it keeps 4)
BASE_MAX_NEW_TOKENS = 4
#: the embedded model's positions (``offpolicy_moe.models.presets.MAX_POSITIONS``; not imported: that module imports
#: torch): the longest bos + prompt + answer + eos a longtail problem may take
POSITIONS = 256
#: the fewest terms of a longtail problem (the head of its law of the number of terms)
LONGTAIL_MIN_TERMS = 4
#: a reference of more characters than this gets no default: the task refuses options that ask for one (or, for
#: products, cannot write such numbers), and working it out would cost more than loading a config should
LONGEST_WORKED_OUT = 1 << 16
_OPERATORS = "+-*"


@dataclass(frozen=True)
class TaskSettings:
    """The settings a task carries for keys outside ``task.*``; they apply where the config leaves the key out."""

    max_new_tokens: int                        # rollout.max_new_tokens: the longest reference + eos (>= the base)
    longest_reference: Optional[int] = None    # its tokens (characters), without eos; None: not known from options


def task_settings(task: Any) -> TaskSettings:
    """The settings of the task the ``task`` config section (a ``TaskConfig``) names (module docstring)."""
    longest = longest_reference(task)
    if longest is None:
        return TaskSettings(BASE_MAX_NEW_TOKENS)
    return TaskSettings(max(BASE_MAX_NEW_TOKENS, longest + 1), longest)


def longest_reference(task: Any) -> Optional[int]:
    """Characters of the longest reference the task named by ``task.name`` can draw with these options; ``None`` for
    a task read from disk, or options the task refuses."""
    name = getattr(task, "name", "arithmetic")
    if name == "arithmetic":
        return arithmetic_longest(task.min_digits, task.max_digits, task.num_terms, task.operators)
    if name == "reverse":
        return reverse_longest(task.min_digits, task.max_digits)
    if name == "chain":
        return chain_longest(task.min_digits, task.max_digits, task.num_terms)
    if name == "longtail":
        return longtail_longest(task.max_terms)
    return None


def arithmetic_longest(min_digits: int, max_digits: int, num_terms: int, operators: str) -> Optional[int]:
    """Characters of the arithmetic task's longest answer (its largest value, or its most negative one when ``-``
    is an operator: the first operand as small as it may be, minus the rest multiplied or subtracted)."""
    if not (_ints(min_digits, max_digits, num_terms) and 1 <= min_digits <= max_digits <= LONGEST_WORKED_OUT
            and num_terms >= 2):
        return None
    if not (isinstance(operators, str) and operators and set(operators) <= set(_OPERATORS)):
        return None
    if "*" in operators and max_digits * num_terms > LONGEST_WORKED_OUT:
        return None                 # a product of about that many digits (the task cannot even write it)
    top = 10 ** max_digits - 1
    low = 0 if min_digits == 1 else 10 ** (min_digits - 1)
    if "*" in operators:
        largest = top ** num_terms
    elif "+" in operators:
        largest = num_terms * top
    else:
        largest = top - (num_terms - 1) * low
    values = [largest]
    if "-" in operators:
        values.append(low - (top ** (num_terms - 1) if "*" in operators else (num_terms - 1) * top))
    return max(_chars(v) for v in values)


def reverse_longest(min_digits: int, max_digits: int) -> Optional[int]:
    """Characters of the reverse task's longest answer: ``max_digits`` digits."""
    if not (_ints(min_digits, max_digits) and 1 <= min_digits <= max_digits <= LONGEST_WORKED_OUT):
        return None
    return max_digits


def chain_longest(min_digits: int, max_digits: int, num_terms: int) -> Optional[int]:
    """Characters of the chain task's longest worked sum: ``num_terms`` operands that all are the largest number of
    ``max_digits`` digits.  Step ``k`` writes the sum of the first ``k + 1`` operands and the ``num_terms - k - 1``
    operands left (each with its ``+``); ``=`` joins the ``num_terms - 1`` steps."""
    if not (_ints(min_digits, max_digits, num_terms) and 1 <= min_digits <= max_digits <= LONGEST_WORKED_OUT
            and num_terms >= 2):
        return None
    operands = (max_digits + 1) * (num_terms - 1) * (num_terms - 2) // 2
    if operands > LONGEST_WORKED_OUT:
        return None
    top = 10 ** max_digits - 1
    sums = sum(_chars(k * top) for k in range(2, num_terms + 1))
    return sums + operands + (num_terms - 2)


def longtail_longest(max_terms: int) -> Optional[int]:
    """Characters of the longtail task's longest reference: at each number of terms ``n`` from
    :data:`LONGTAIL_MIN_TERMS` to ``max_terms``, the one-digit chain's longest, cut to the ``POSITIONS - 2 - 2 n``
    characters left after bos, the ``2 n``-character prompt and eos."""
    if not (_ints(max_terms) and max_terms >= LONGTAIL_MIN_TERMS):
        return None
    most = min(max_terms, (POSITIONS - 3) // 2)            # more terms leave no position for the reference
    longest = [min(POSITIONS - 2 - 2 * n, chain_longest(1, 1, n) or 0) for n in range(LONGTAIL_MIN_TERMS, most + 1)]
    return max(longest) if longest else None


def _ints(*values: Any) -> bool:
    return all(isinstance(v, int) and not isinstance(v, bool) for v in values)


def _chars(value: int) -> int:
    """``len(str(value))``, without writing the number (Python refuses to write integers of more than 4300
    digits)."""
    size = abs(value)
    digits = max(1, int(size.bit_length() * 0.30102999566398120))      # log10(2): within one of the answer
    while size >= 10 ** digits:
        digits += 1
    while digits > 1 and size < 10 ** (digits - 1):
        digits -= 1
    return digits + (value < 0)


__all__ = ["BASE_MAX_NEW_TOKENS", "LONGTAIL_MIN_TERMS", "POSITIONS", "TaskSettings", "arithmetic_longest",
           "chain_longest", "longest_reference", "longtail_longest", "reverse_longest", "task_settings"]
