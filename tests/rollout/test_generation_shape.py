"""The decode shape a step reports (``rollout/prompt_len``, ``rollout/response_len_q<p>``) is exact."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from offpolicy_moe.rollout.batch import LENGTH_QUANTILES, generation_shape


def _batch(lengths: list[int], width: int = 12, prompt_len: int = 5) -> SimpleNamespace:
    mask = torch.zeros(len(lengths), width)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    return SimpleNamespace(response_mask=mask, prompt_len=prompt_len)


def test_the_percentiles_are_the_rows_lengths_at_their_ranks():
    shape = generation_shape(_batch([11, 1, 5, 2, 9, 3, 10, 4, 8, 6, 7]))     # 1..11, shuffled
    assert shape["rollout/prompt_len"] == 5.0
    assert [shape[f"rollout/response_len_q{p:03d}"] for p in LENGTH_QUANTILES] == [float(n) for n in range(1, 12)]


def test_lower_percentiles_are_lengths_a_row_has():
    lengths = [3, 3, 3, 12, 12]
    shape = generation_shape(_batch(lengths))
    assert {shape[f"rollout/response_len_q{p:03d}"] for p in LENGTH_QUANTILES} <= {3.0, 12.0}
    assert shape["rollout/response_len_q000"] == 3.0 and shape["rollout/response_len_q100"] == 12.0


def test_an_empty_batch_is_refused_in_one_line():
    with pytest.raises(ValueError, match="^generation_shape: the batch has no rows$"):
        generation_shape(_batch([]))
