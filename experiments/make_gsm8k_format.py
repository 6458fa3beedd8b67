"""Write a GSM8K-format JSONL of synthetic arithmetic problems (nothing downloaded).

Each line is ``{"question": ..., "answer": ...}`` like GSM8K's: the answer column holds the worked steps and ends with
``#### <final answer>``.  The questions stay inside the embedded character tokenizer's alphabet (digits, ``+-*=()``
and space), so the embedded model can train on them; a real checkpoint's tokenizer reads them as well.

    python experiments/make_gsm8k_format.py --out runs/byo_task/gsm8k_synthetic.jsonl

Default: every 1-digit, 3-term sum ``a+b+c=`` (1,000 problems, the embedded default task's space), in a seeded order,
solved left to right: ``"7+5+9="`` -> ``"7+5=12\\n12+9=21\\n#### 21"``.  ``--operators "+-"`` mixes in
subtractions; ``--max-digits 2`` widens the operands (then ``--limit`` keeps the file small).
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


def problems(num_terms: int, max_digits: int, operators: str) -> list[dict]:
    """Every problem of the space as a GSM8K record (``question``, ``answer`` with ``####``)."""
    values = range(10 ** max_digits)
    out = []
    for operands in itertools.product(values, repeat=num_terms):
        for ops in itertools.product(operators, repeat=num_terms - 1):
            question = "".join(f"{a}{o}" for a, o in zip(operands, ops)) + f"{operands[-1]}="
            steps, final = solve(list(operands), list(ops))
            out.append({"question": question, "answer": "\n".join(steps) + f"\n#### {final}"})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/byo_task/gsm8k_synthetic.jsonl")
    p.add_argument("--num-terms", type=int, default=3)
    p.add_argument("--max-digits", type=int, default=1)
    p.add_argument("--operators", default="+", help="a subset of '+-' (left-to-right working)")
    p.add_argument("--limit", type=int, default=0, help="keep the first N problems of the shuffled order (0: all)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.num_terms < 2 or not 1 <= args.max_digits <= 3 or not args.operators or set(args.operators) - set("+-"):
        p.error("--num-terms >= 2, --max-digits in 1..3, --operators a non-empty subset of '+-'")
    rows = problems(args.num_terms, args.max_digits, args.operators)
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
