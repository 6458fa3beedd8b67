"""Write a GSM8K-format JSONL of synthetic arithmetic problems (nothing downloaded).

Each line is ``{"question": ..., "answer": ...}`` like GSM8K's: the answer column holds the worked steps and ends with
``#### <final answer>``.  By default the questions stay inside the embedded character tokenizer's alphabet (digits,
``+-*=()`` and space); ``--words`` writes them as short word problems with a worked solution in sentences (letters,
punctuation, newlines, ``####``), which the embedded model reads through its byte fallback.

    python experiments/make_gsm8k_format.py --out runs/byo_task/gsm8k_synthetic.jsonl

Default: every 1-digit, 3-term sum ``a+b+c=`` (1,000 problems, the embedded default task's space), in a seeded order,
solved left to right: ``"7+5+9="`` -> ``"7+5=12\\n12+9=21\\n#### 21"``.  ``--operators "+-"`` mixes in
subtractions; ``--max-digits 2`` widens the operands (then ``--limit`` keeps the file small).
``--words``: ``"Ann has 7 pens. She gets 5, then gets 9. How many pens does she have?"`` ->
``"Ann starts with 7 pens.\n7+5=12\n12+9=21\nShe has 21 pens.\n#### 21"``.
"""
from __future__ import annotations

import argparse
import itertools
import json
import random
from pathlib import Path


def solve(operands: list[int], ops: list[str]) -> tuple[list[str], int]:
    """Left-to-right working of ``operands ops``: the step lines ``"a+b=s"`` and the final value."""
    steps, acc = [], operands[0]
    for op, x in zip(ops, operands[1:]):
        new = acc + x if op == "+" else acc - x
        steps.append(f"{acc}{op}{x}={new}")
        acc = new
    return steps, acc


NAMES = (("Ann", "She"), ("Bob", "He"), ("Eva", "She"), ("Tom", "He"))
ITEMS = ("pens", "apples", "cards", "books")


def in_words(operands: list[int], ops: list[str], steps: list[str], final: int, k: int) -> dict:
    """The ``k``-th word problem (name and item cycle with ``k``) of ``operands ops``, GSM8K-style."""
    (name, he), item = NAMES[k % len(NAMES)], ITEMS[(k // len(NAMES)) % len(ITEMS)]
    moves = [f"{'gets' if o == '+' else 'gives away'} {x}" for o, x in zip(ops, operands[1:])]
    question = (f"{name} has {operands[0]} {item}. {he} {', then '.join(moves)}. How many {item} does "
                f"{he.lower()} have?")
    answer = "\n".join([f"{name} starts with {operands[0]} {item}.", *steps, f"{he} has {final} {item}.",
                        f"#### {final}"])
    return {"question": question, "answer": answer}


def problems(num_terms: int, max_digits: int, operators: str, words: bool = False) -> list[dict]:
    """Every problem of the space as a GSM8K record (``question``, ``answer`` with ``####``)."""
    values = range(10 ** max_digits)
    out = []
    for operands in itertools.product(values, repeat=num_terms):
        for ops in itertools.product(operators, repeat=num_terms - 1):
            question = "".join(f"{a}{o}" for a, o in zip(operands, ops)) + f"{operands[-1]}="
            steps, final = solve(list(operands), list(ops))
            out.append(in_words(list(operands), list(ops), steps, final, len(out)) if words else
                       {"question": question, "answer": "\n".join(steps) + f"\n#### {final}"})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/byo_task/gsm8k_synthetic.jsonl")
    p.add_argument("--num-terms", type=int, default=3)
    p.add_argument("--max-digits", type=int, default=1)
    p.add_argument("--operators", default="+", help="a subset of '+-' (left-to-right working)")
    p.add_argument("--limit", type=int, default=0, help="keep the first N problems of the shuffled order (0: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--words", action="store_true", help="word problems with worked solutions in sentences")
    args = p.parse_args(argv)
    if args.num_terms < 2 or not 1 <= args.max_digits <= 3 or not args.operators or set(args.operators) - set("+-"):
        p.error("--num-terms >= 2, --max-digits in 1..3, --operators a non-empty subset of '+-'")
    rows = problems(args.num_terms, args.max_digits, args.operators, args.words)
    random.Random(args.seed).shuffle(rows)
    if args.limit > 0:
        rows = rows[:args.limit]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(rows)} GSM8K-format problems to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
