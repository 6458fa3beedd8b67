"""experiments/bench/bench_decode_forward.py on tiny shapes: its three tables, each cell a ratio of two timings of
the same work (the script itself asserts both ways sample the same tokens and decode the same completions)."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments" / "bench"))
import bench_decode_forward  # noqa: E402

TINY = ["--set", "model.num_layers=1", "model.hidden_size=32", "model.num_experts=4", "model.top_k=2",
        "task.eval_size=6"]


def test_the_three_levels_are_printed(capsys):
    bench_decode_forward.main(["--rows", "1", "3", "--columns", "4", "--repeats", "2", "--prompts", "2", "--group",
                               "2", "--max-new-tokens", "4", "--rounds", "1", *TINY])
    out = capsys.readouterr().out
    cells = re.findall(r"\| (\d+) \| ([\d.]+) / ([\d.]+) \(([\d.]+)x\) \|", out)
    assert [c[0] for c in cells] == ["1", "3"] and all(float(c[1]) > 0 and float(c[2]) > 0 for c in cells)
    assert re.search(r"\| lean \| [\d.]+ \| [\d,]+ \|", out) and re.search(r"\| model \| [\d.]+ \| [\d,]+ \|", out)
    assert re.search(r"model / lean \(median of per-round ratios\): [\d.]+x", out)
    assert re.search(r"greedy evaluation of 6 held-out prompts: lean [\d.]+ s, model [\d.]+ s", out)


def test_bad_sizes_are_refused():
    with pytest.raises(SystemExit):
        bench_decode_forward.main(["--rows", "0"])
