"""experiments/bench/bench_sampler_copies.py on tiny shapes: both tables printed with a ratio (the script itself
asserts that the ways sample the same tokens and log-probs), the old ways restored after it, bad sizes refused."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments" / "bench"))
import bench_sampler_copies  # noqa: E402
from offpolicy_moe.rollout import slots as slots_module  # noqa: E402
from offpolicy_moe.rollout.kv_cache import PreallocatedLayer  # noqa: E402

TINY = ["--set", "model.num_layers=1", "model.hidden_size=32", "model.num_experts=4", "model.top_k=2"]


def test_both_savings_are_timed_against_the_old_ways(capsys):
    repeat, select = PreallocatedLayer.batch_repeat_interleave, PreallocatedLayer.batch_select_indices
    ahead = slots_module.RACE_TOKENS
    bench_sampler_copies.main(["--prompts", "2", "--group", "3", "--max-new-tokens", "6", "--slots", "4",
                               "--steps", "2", "--forwards", "2", "--rounds", "1", *TINY])
    out = capsys.readouterr().out
    assert re.search(r"\| filled columns \| [\d.]+ \|", out) and re.search(r"\| whole buffer \| [\d.]+ \|", out)
    assert re.search(r"whole buffer / filled columns \(median of per-round ratios\): [\d.]+x", out)
    assert re.search(r"\| ahead \| [\d.]+ \|", out) and re.search(r"\| per token \| [\d.]+ \|", out)
    assert re.search(r"per token / ahead \(median of per-round ratios\): [\d.]+x", out)
    assert (PreallocatedLayer.batch_repeat_interleave, PreallocatedLayer.batch_select_indices) == (repeat, select)
    assert slots_module.RACE_TOKENS == ahead


def test_the_old_whole_buffer_copies_are_what_the_layer_computes():
    """The bench's 'before' must be the same computation, or its ratio compares different work."""
    import torch

    g = torch.Generator().manual_seed(0)
    now, before = PreallocatedLayer(capacity=16), PreallocatedLayer(capacity=16)
    k, v = torch.randn(2, 2, 3, 4, generator=g), torch.randn(2, 2, 3, 4, generator=g)
    now.update(k, v), before.update(k, v)
    now.batch_repeat_interleave(3)
    with bench_sampler_copies.whole_buffer_copies():
        before.batch_repeat_interleave(3)
        idx = torch.tensor([5, 0, 2])
        before.batch_select_indices(idx)
    now.batch_select_indices(idx)
    assert torch.equal(now.keys, before.keys) and torch.equal(now.values, before.values)


def test_bad_sizes_are_refused():
    with pytest.raises(SystemExit):
        bench_sampler_copies.main(["--slots", "0"])
