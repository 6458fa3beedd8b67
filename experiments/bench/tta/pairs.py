"""Paired final-accuracy differences across bench_tta records (issue 35, item 4: why async k=1 GRPO ends above
on-policy sync).

    python experiments/bench/tta/pairs.py experiments/results/tta/full/runs.json \\
        experiments/results/tta/item4/runs.json --reference sync --out experiments/results/tta/item4/pairs.md

Runs of several bench_tta invocations on the same seeds start from the same warm start (the SFT warm start is a
pure function of the seed), so an arm of one record pairs with an arm of another by seed.  For every arm: the
median final accuracy, the paired mean difference to ``--reference`` (and to every other arm given with
``--against``) with its 95% Student-t interval (offpolicy_moe/report/stats.py ``compare``), the seeds where the arm
is above, and the run means of the training diagnostics bench_tta records (clip fraction, staleness, reward).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))


def load_finals(paths: list[str], last: int = 1
                ) -> tuple[dict[str, dict[int, float]], dict[str, dict[str, list[float]]]]:
    """``{arm: {seed: final accuracy}}`` and ``{arm: {diagnostic: [run means]}}`` over the records (a later record's
    run of the same arm and seed replaces an earlier one).  ``path@label`` names that record's arms
    ``<arm>@<label>`` (a record made with another ``--set``, e.g. another learning rate).  ``last`` > 1: the mean
    of the last ``last`` evaluations instead of the final one (less noise from a single evaluation)."""
    finals: dict[str, dict[int, float]] = {}
    diags: dict[str, dict[str, list[float]]] = {}
    for spec in paths:
        path, _, label = str(spec).partition("@")
        for r in json.loads(Path(path).read_text())["runs"]:
            arm = f"{r['arm']}@{label}" if label else r["arm"]
            acc = r["curve"].get("accuracy") or [r["curve"]["final_accuracy"]]
            finals.setdefault(arm, {})[int(r["seed"])] = (float(r["curve"]["final_accuracy"]) if last <= 1
                                                         else statistics.fmean(acc[-last:]))
            for k, v in (r.get("diagnostics") or {}).items():
                diags.setdefault(arm, {}).setdefault(k, []).append(float(v))
    return finals, diags


def paired(a: dict[int, float], b: dict[int, float]) -> str:
    """``mean(a - b) [lo, hi] (n, above k/n)`` over the common seeds."""
    from offpolicy_moe.report.stats import compare

    common = sorted(set(a) & set(b))
    if not common:
        return "—"
    d = compare({s: a[s] for s in common}, {s: b[s] for s in common})
    above = sum(a[s] > b[s] for s in common)
    ci = f" [{d.lo:+.3f}, {d.hi:+.3f}]" if d.lo is not None else ""
    return f"{d.estimate:+.3f}{ci} (n={len(common)}, above {above}/{len(common)})"


def report(paths: list[str], reference: str, against: list[str], last: int = 1) -> str:
    """The markdown table (module docstring)."""
    finals, diags = load_finals(paths, last)
    if reference not in finals:
        raise SystemExit(f"pairs.py: no arm {reference!r} in the records (arms: {', '.join(finals)})")
    refs = [reference] + [x for x in against if x in finals and x != reference]
    keys = ["actor/clipfrac", "offpolicy/staleness_steps", "reward/mean"]
    what = "final acc" if last <= 1 else f"mean of the last {last} evals"
    head = (f"| arm | seeds | {what} (median) | " + " | ".join(f"− {r} [95%]" for r in refs) + " | "
            + " | ".join(keys) + " |")
    lines = [head, "|" + " --- |" * (3 + len(refs) + len(keys))]
    for arm, f in finals.items():
        cells = [paired(f, finals[r]) if r != arm else "—" for r in refs]
        dv = [f"{statistics.fmean(diags[arm][k]):.4f}" if k in diags.get(arm, {}) else "—" for k in keys]
        lines.append(f"| {arm} | {','.join(str(s) for s in sorted(f))} | {statistics.median(f.values()):.3f} | "
                     + " | ".join(cells) + " | " + " | ".join(dv) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("records", nargs="+", help="runs.json (or partial.json) files of bench_tta; PATH@LABEL suffixes "
                                              "that record's arm names with @LABEL")
    p.add_argument("--reference", default="sync")
    p.add_argument("--against", action="append", default=[], help="another arm to pair against (repeatable)")
    p.add_argument("--last", type=int, default=1, help="mean of the last K evaluations (default 1: the final one)")
    p.add_argument("--out", type=Path, default=None, help="also write the table here")
    a = p.parse_args(argv)
    text = report(a.records, a.reference, a.against, a.last)
    print(text)
    if a.out:
        a.out.write_text(f"command: `python experiments/bench/tta/pairs.py {' '.join(sys.argv[1:] if argv is None else argv)}`"
                         f"\n\n{text}\n")


if __name__ == "__main__":
    main()
