"""RouteTrace.from_vllm / from_sglang on arrays laid out as each engine documents them."""
from __future__ import annotations

import base64

import numpy as np
import pytest
import torch

from offpolicy_moe.routing import RouteTrace, cat_traces

E, K, LAYER_IDS, N_HIDDEN = 16, 2, (1, 2, 3), 4  # one dense first layer


def _routes(n, layers, seed):
    rng = np.random.default_rng(seed)
    return np.stack([np.stack([rng.permutation(E)[:K] for _ in range(layers)]) for _ in range(n)])


def test_vllm_prompt_and_completion_parts_int16():
    P, T = 5, 4
    prompt, comp = np.arange(10, 10 + P), np.arange(30, 30 + T)
    pr = _routes(P, 3, 0).astype(np.int16)
    gen = _routes(T - 1, 3, 1).astype(np.int16)  # the last sampled token is never fed
    t = RouteTrace.from_vllm(prompt, comp, gen, pr, num_experts=E, layer_ids=LAYER_IDS)
    assert t.ids.shape == (1, P + T, 3, K) and t.layer_ids == LAYER_IDS
    ids = t.long_ids()[0]
    assert torch.equal(ids[:P], torch.from_numpy(pr).long())
    assert torch.equal(ids[P:P + T - 1], torch.from_numpy(gen).long())
    assert bool((ids[-1] == -1).all())
    assert torch.equal(t.tokens[0].long(), torch.from_numpy(np.concatenate([prompt, comp])).long())
    full = RouteTrace.from_vllm(prompt, comp, _routes(T, 3, 1).astype(np.int16), pr, num_experts=E,
                                layer_ids=LAYER_IDS)
    assert bool(full.recorded_mask().all())


def test_vllm_old_layout_all_hidden_layers():
    P, T = 3, 3
    allr = _routes(P + T - 1, N_HIDDEN, 2).astype(np.int16)
    allr[:, 0] = -1  # the dense layer has nothing (ignored)
    t = RouteTrace.from_vllm(np.arange(P), np.arange(T), allr, num_experts=E, layer_ids=LAYER_IDS,
                             num_hidden_layers=N_HIDDEN)
    assert torch.equal(t.long_ids()[0, :P + T - 1], torch.from_numpy(allr[:, list(LAYER_IDS)]).long())
    assert not bool(t.recorded_mask()[0, -1])


def test_vllm_not_recorded_positions_and_errors():
    P, T = 4, 2
    pr = _routes(P, 3, 3).astype(np.int16)
    pr[1] = -1  # a prefix-cached position the engine did not record
    t = RouteTrace.from_vllm(np.arange(P), np.arange(T), _routes(T, 3, 4), pr, num_experts=E, layer_ids=LAYER_IDS)
    assert t.recorded_mask()[0].tolist() == [True, False, True, True, True, True]
    with pytest.raises(ValueError, match="routed_experts has 5 positions but the completion has 2 tokens"):
        RouteTrace.from_vllm(np.arange(P), np.arange(T), _routes(5, 3, 4), pr, num_experts=E, layer_ids=LAYER_IDS)
    with pytest.raises(ValueError, match="prompt_routed_experts has 3 positions but the prompt has 4"):
        RouteTrace.from_vllm(np.arange(P), np.arange(T), _routes(T, 3, 4), pr[:3], num_experts=E,
                             layer_ids=LAYER_IDS)
    with pytest.raises(ValueError, match="has 4 layers; expected 3 MoE layers"):
        RouteTrace.from_vllm(np.arange(P), np.arange(T), _routes(T, 4, 4), _routes(P, 4, 5), num_experts=E,
                             layer_ids=LAYER_IDS)
    with pytest.raises(TypeError, match="integer"):
        RouteTrace.from_vllm(np.arange(P), np.arange(T), _routes(T, 3, 4).astype(float), pr, num_experts=E,
                             layer_ids=LAYER_IDS)


def _b64(a):
    return base64.b64encode(np.ascontiguousarray(a, dtype="<i4").tobytes()).decode()


def test_sglang_base64_one_position_short():
    S = 7
    r = _routes(S - 1, 3, 6).astype(np.int32)
    tok = np.arange(40, 40 + S)
    t = RouteTrace.from_sglang(tok, _b64(r), num_experts=E, top_k=K, layer_ids=LAYER_IDS)
    assert torch.equal(t.long_ids()[0, :S - 1], torch.from_numpy(r).long())
    assert t.recorded_mask()[0].tolist() == [True] * (S - 1) + [False]
    # all hidden layers (dense first layer included) reduce to the MoE layers
    r_all = _routes(S - 1, N_HIDDEN, 7).astype(np.int32)
    t2 = RouteTrace.from_sglang(tok, _b64(r_all), num_experts=E, top_k=K, layer_ids=LAYER_IDS,
                                num_hidden_layers=N_HIDDEN)
    assert torch.equal(t2.long_ids()[0, :S - 1], torch.from_numpy(r_all[:, 1:]).long())
    both = cat_traces([t, RouteTrace.from_sglang(tok[:4], _b64(r[:3]), num_experts=E, top_k=K,
                                                 layer_ids=LAYER_IDS)], side="right")
    assert both.ids.shape[:2] == (2, S) and both.tokens[1, 4:].tolist() == [-1, -1, -1]


def test_sglang_lengths_that_do_not_fit():
    S = 6
    with pytest.raises(ValueError, match="holds 36 ids; 6 tokens need"):
        RouteTrace.from_sglang(np.arange(S), _b64(_routes(S, 3, 8)), num_experts=E, top_k=K, layer_ids=LAYER_IDS)
    with pytest.raises(ValueError):
        RouteTrace.from_sglang(np.arange(S), "not base64!", num_experts=E, top_k=K, layer_ids=LAYER_IDS)
