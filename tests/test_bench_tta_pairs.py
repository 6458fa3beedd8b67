"""experiments/bench/tta/pairs.py: arms of several bench_tta records paired by seed, labels, the table."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments" / "bench"))

from tta.pairs import load_finals, paired, report  # noqa: E402


def _rec(path: Path, arm: str, finals: dict[int, float], clip: float = 0.0) -> str:
    runs = [{"arm": arm, "seed": s, "curve": {"final_accuracy": f, "accuracy": [0.0, f - 0.1, f]},
             "diagnostics": {"actor/clipfrac": clip}} for s, f in finals.items()]
    path.write_text(json.dumps({"runs": runs}))
    return str(path)


def test_arms_of_two_records_pair_by_seed_and_labels_keep_them_apart(tmp_path):
    a = _rec(tmp_path / "a.json", "sync", {5: 0.50, 6: 0.40, 7: 0.45})
    b = _rec(tmp_path / "b.json", "async-k1-grpo", {5: 0.58, 6: 0.50, 8: 0.9}, clip=0.02)
    c = _rec(tmp_path / "c.json", "async-k1-grpo", {5: 0.50, 6: 0.40})
    finals, diags = load_finals([a, b, f"{c}@prox"])
    assert set(finals) == {"sync", "async-k1-grpo", "async-k1-grpo@prox"}
    assert paired(finals["async-k1-grpo"], finals["sync"]).startswith("+0.090 [")   # seeds 5, 6 only
    assert "(n=2, above 2/2)" in paired(finals["async-k1-grpo"], finals["sync"])
    assert paired(finals["async-k1-grpo@prox"], finals["sync"]).startswith("+0.000")
    assert diags["async-k1-grpo"]["actor/clipfrac"] == [0.02, 0.02, 0.02]
    text = report([a, b], "sync", ["async-k1-grpo"])
    assert "| async-k1-grpo | 5,6,8 | 0.580 |" in text and "0.0200" in text
    two, _ = load_finals([b], last=2)
    assert two["async-k1-grpo"][5] == pytest.approx(0.53)                     # mean of 0.48 and 0.58
    assert "mean of the last 2 evals" in report([a, b], "sync", [], last=2)
    with pytest.raises(SystemExit):
        report([b], "sync", [])
