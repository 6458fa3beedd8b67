"""Zero-deviation shares, the PR2 same-token counterfactual, the predictor skill ratio and the bias's own route
change, against hand-computed values and a loop reference."""
import math

import pytest
import torch

from offpolicy_moe.routing import (PR2Features, PR2Predictors, RouteTrace, compare_traces, pr2_predictor_loss,
                                   zero_deviation)


def test_zero_deviation_hand_values():
    same = torch.tensor([[True, False], [True, True], [False, False]])
    valid = torch.ones(3, 2, dtype=torch.bool)
    assert zero_deviation(same, valid) == (pytest.approx(3 / 6), pytest.approx(1 / 3))
    valid[2] = False                       # token 2 not recorded: out of both shares
    assert zero_deviation(same, valid) == (pytest.approx(3 / 4), pytest.approx(1 / 2))
    valid[0, 1] = False                    # token 0's differing layer not recorded: token 0 counts as equal
    assert zero_deviation(same, valid) == (pytest.approx(3 / 3), pytest.approx(2 / 2))
    assert zero_deviation(same, torch.zeros(3, 2, dtype=torch.bool)) == (1.0, 1.0)


def _loop_zero_dev(a_ids, b_ids, mask):
    pairs = equal_pairs = tokens = equal_tokens = 0
    bsz, s, nl, _ = a_ids.shape
    for i in range(bsz):
        for t in range(s):
            if not mask[i, t] or (a_ids[i, t] < 0).any() or (b_ids[i, t] < 0).any():
                continue
            eq = [set(a_ids[i, t, l].tolist()) == set(b_ids[i, t, l].tolist()) for l in range(nl)]
            pairs += nl
            equal_pairs += sum(eq)
            tokens += 1
            equal_tokens += all(eq)
    return equal_pairs / pairs, equal_tokens / tokens, tokens


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_comparison_zero_deviation_matches_loop(seed):
    g = torch.Generator().manual_seed(seed)
    b, s, nl, k, e = 3, 9, 4, 2, 6

    def rand_ids():
        return torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(b * s * nl)]).view(b, s, nl, k)

    a_ids = rand_ids()
    b_ids = torch.where(torch.rand(b, s, nl, 1, generator=g) < 0.7, a_ids.flip(-1), rand_ids())
    b_ids[1, 3] = -1
    mask = torch.rand(b, s, generator=g) < 0.8
    got = compare_traces(RouteTrace.from_ids(a_ids, e), RouteTrace.from_ids(b_ids, e), mask) \
        .zero_deviation_metrics("drift/")
    layer, token, n = _loop_zero_dev(a_ids, b_ids, mask)
    assert got["drift/zero_dev_layer"] == pytest.approx(layer)
    assert got["drift/zero_dev_token"] == pytest.approx(token)
    assert got["drift/n_tokens"] == n
    routing = compare_traces(RouteTrace.from_ids(a_ids, e), RouteTrace.from_ids(b_ids, e), mask).metrics()
    assert got["drift/zero_dev_layer"] == pytest.approx(1 - routing["routing/decision_mismatch"])
    assert got["drift/zero_dev_token"] == pytest.approx(1 - routing["routing/token_mismatch"])


# 2 tokens x 2 layers, E = 4, K = 2 (see the comments for each pair's sets)
_OLD = torch.tensor([[[4.0, 3, 1, 0], [0, 1, 4, 3]],      # unbiased top-2: t0 L0 {0,1}, t0 L1 {2,3}
                     [[3.0, 0, 1, 4], [4, 3, 0, 1]]])     #                 t1 L0 {3,0}, t1 L1 {0,1}
_CUR_IDS = torch.tensor([[[0, 1], [2, 3]], [[1, 2], [0, 1]]])
_REP_IDS = torch.tensor([[[1, 0], [2, 0]], [[2, 1], [0, 1]]])
_CUR = torch.tensor([[[1.0, 0.5, -1, 0], [0, -1, 2, 1]], [[-1.0, 2, 1, 0], [1, 2, 0, -2]]])


def _kl_loop(cur, q_logits):
    tot = 0.0
    for t in range(cur.shape[0]):
        for l in range(cur.shape[1]):
            rho = torch.softmax(cur[t, l].double(), 0)
            logq = torch.log_softmax(q_logits[t, l].double(), 0)
            tot += float((rho * (rho.log() - logq)).sum())
    return tot / (cur.shape[0] * cur.shape[1])


def test_pr2_counterfactual_and_bias_change_hand_values():
    feats = PR2Features(torch.tensor([0, 1]), torch.tensor([4, 4]), torch.zeros(2, 2, 3), _OLD.clone())
    _, met = pr2_predictor_loss(PR2Predictors(3, 4, 2), feats, _CUR, current_ids=_CUR_IDS, replayed_ids=_REP_IDS)
    # replayed vs current: t0 L1 differs ({2,0} vs {2,3}) -> 3/4 pairs; token 0 not equal everywhere -> 1/2
    assert met["pr2/zero_dev_layer"] == pytest.approx(0.75) and met["pr2/zero_dev_token"] == pytest.approx(0.5)
    # unbiased (R3) route vs current: only t1 L0 differs ({3,0} vs {1,2})
    assert met["pr2/zero_dev_layer_r3"] == pytest.approx(0.75)
    assert met["pr2/zero_dev_token_r3"] == pytest.approx(0.5)
    # replayed vs unbiased: t0 L1 and t1 L0 differ
    assert met["pr2/bias_route_change"] == pytest.approx(0.5)
    # zero predictor: q = softmax(logits_old), so the skill ratio is exactly 1
    assert met["pr2/base_kl"] == pytest.approx(_kl_loop(_CUR, _OLD), rel=1e-5)
    assert met["pr2/pred_kl"] == pytest.approx(met["pr2/base_kl"], rel=1e-6)
    assert met["pr2/skill_ratio"] == pytest.approx(1.0, rel=1e-6)


def test_pr2_skill_ratio_of_a_perfect_and_a_partial_predictor():
    # one-hot router inputs, so a predictor weight column per token can hold any logit shift
    h = torch.zeros(2, 2, 2)
    h[0, :, 0] = 1.0
    h[1, :, 1] = 1.0
    feats = PR2Features(torch.tensor([0, 1]), torch.tensor([4, 4]), h, _OLD.clone())
    preds = PR2Predictors(2, 4, 2)
    with torch.no_grad():
        for l in range(2):
            for t in range(2):
                preds.layers[l].weight[:, t] = _CUR[t, l] - _OLD[t, l]
    _, perfect = pr2_predictor_loss(preds, feats, _CUR, top_k=2)
    assert perfect["pr2/pred_kl"] == pytest.approx(0.0, abs=1e-6)
    assert perfect["pr2/skill_ratio"] == pytest.approx(0.0, abs=1e-6)
    assert perfect["pr2/zero_dev_layer"] == 1.0      # replayed = top-k of the predicted logits = current top-k
    with torch.no_grad():
        for lin in preds.layers:
            lin.weight.mul_(0.5)                     # half-way: some skill
    _, half = pr2_predictor_loss(preds, feats, _CUR, top_k=2)
    pred = _kl_loop(_CUR, _OLD + 0.5 * (_CUR - _OLD))
    assert half["pr2/pred_kl"] == pytest.approx(pred, rel=1e-5)
    assert half["pr2/skill_ratio"] == pytest.approx(pred / _kl_loop(_CUR, _OLD), rel=1e-5)
    assert 0.0 < half["pr2/skill_ratio"] < 1.0


def test_pr2_metrics_empty_and_no_drift():
    preds = PR2Predictors(3, 4, 2)
    empty = PR2Features(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), torch.zeros(0, 2, 3),
                        torch.zeros(0, 2, 4))
    loss, met = pr2_predictor_loss(preds, empty, torch.zeros(0, 2, 4), top_k=2)
    assert loss.item() == 0.0 and met == {"pr2/num_tokens": 0.0}     # no made-up shares for an empty sample
    feats = PR2Features(torch.tensor([0, 1]), torch.tensor([4, 4]), torch.zeros(2, 2, 3), _OLD.clone())
    _, met = pr2_predictor_loss(preds, feats, _OLD.clone(), top_k=2)  # no drift at all
    assert met["pr2/base_kl"] == pytest.approx(0.0, abs=1e-7)
    assert "pr2/skill_ratio" not in met                               # undefined, not reported as 0/0
    assert all(math.isfinite(v) for v in met.values())
