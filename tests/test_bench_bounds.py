"""experiments/bench/bench_bounds.py on tiny shapes: its tables, and a decode grid whose cache keeps its width."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments" / "bench"))
import bench_bounds  # noqa: E402


def test_the_bounds_are_printed_for_every_cell(capsys):
    bench_bounds.main(["--rows", "1", "3", "--columns", "4", "8", "--batch", "2", "--tokens", "6", "--repeats", "1",
                       "--warmup", "0", "--matmul", "32"])
    out = capsys.readouterr().out
    cells = re.findall(r"\| (\d+) \| ([\d.]+) \(([\d,]+)\) \| ([\d.]+) \(([\d,]+)\) \|", out)
    assert [c[0] for c in cells] == ["1", "3", "1", "3"]       # the lean grid, then transformers' forward
    assert all(float(x) > 0 for c in cells for x in (c[1], c[3]))
    assert re.search(r"forward \+ backward [\d.]+ ms, forward alone [\d.]+ ms", out)
    assert re.search(r"peak: [\d,.]+ GFLOP/s .* MFU [\d.]+%", out)


def test_a_decode_forward_reads_the_whole_cache_and_leaves_it_as_wide(monkeypatch):
    """The cell's forward attends ``columns`` positions every time: the cache is cut back after each call."""
    model, _ = bench_bounds.load_policy(bench_bounds.ModelConfig(num_layers=1, hidden_size=32, num_experts=4), seed=0)
    seen = []
    real = torch.nn.Module.__call__

    def spy(self, *args, **kwargs):
        cache = kwargs.get(bench_bounds.cache_kwarg(model))
        if self is model and cache is not None:
            seen.append(cache.get_seq_length())
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "__call__", spy)
    bench_bounds.decode_ms(model.eval(), rows=2, columns=5, repeats=3, warmup=1)
    assert seen == [5] * 4


def test_the_lean_cell_runs_the_lean_forward_on_a_cache_as_wide_every_time(monkeypatch):
    from offpolicy_moe.rollout.decode_step import DecodeForward

    model, _ = bench_bounds.load_policy(bench_bounds.ModelConfig(num_layers=1, hidden_size=32, num_experts=4), seed=0)
    seen = []
    real = DecodeForward._forward

    def spy(self, input_ids, attention_mask, position_ids, cache):
        seen.append((cache.get_seq_length(), attention_mask.shape[1]))
        return real(self, input_ids, attention_mask, position_ids, cache)

    monkeypatch.setattr(DecodeForward, "_forward", spy)
    bench_bounds.decode_ms(model.eval(), rows=2, columns=5, repeats=3, warmup=1, lean=True)
    assert seen == [(5, 6)] * 4
    assert model.config._attn_implementation == "sdpa"        # the caller's model is left as it was


def test_bad_shapes_are_refused(capsys):
    with pytest.raises(SystemExit):
        bench_bounds.main(["--rows", "0"])
    assert "--rows must be >= 1" in capsys.readouterr().err


def test_active_parameters_count_a_tokens_share_of_the_experts():
    model, _ = bench_bounds.load_policy(bench_bounds.ModelConfig(num_layers=1, hidden_size=32, num_experts=4, top_k=2),
                                        seed=0)
    named = dict(model.named_parameters())
    experts = sum(t.numel() for n, t in named.items() if ".experts." in n)
    rest = sum(t.numel() for n, t in named.items() if ".experts." not in n) - named["model.embed_tokens.weight"].numel()
    assert experts > 0 and bench_bounds.active_parameters(model) == rest + experts // 2
