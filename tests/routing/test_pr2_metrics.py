"""PR2 predictor loss (vs a loop), param group, state-dict sync, drift learning; routing metrics (vs a loop)."""
import copy
import io
import math

import pytest
import torch

from routing_models import markov_batch, trained_qwen
from offpolicy_moe.routing import (FeatureCache, PR2Features, PR2Predictors, RouteTrace, RoutingController,
                                   compare_traces, pr2_param_group, pr2_predictor_loss, routing_metrics)


def _features(m=5, layers=2, h=6, e=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return PR2Features(torch.arange(m), torch.zeros(m, dtype=torch.long), torch.randn(m, layers, h, generator=g),
                       torch.randn(m, layers, e, generator=g))


def test_predictor_loss_matches_loop_and_only_wp_gets_grad():
    feats = _features()
    preds = PR2Predictors(6, 4, 2)
    with torch.no_grad():
        for lin in preds.layers:
            lin.weight.normal_(0, 0.3)
    cur = torch.randn(5, 2, 4, generator=torch.Generator().manual_seed(1), requires_grad=True)
    feats.h.requires_grad_(True)
    loss, met = pr2_predictor_loss(preds, feats, cur, top_k=2)
    ref = 0.0
    for l in range(2):
        tot = 0.0
        for t in range(5):
            q = feats.logits[t, l].double() + feats.h[t, l].double() @ preds.layers[l].weight.double().T
            logq = q - torch.logsumexp(q, 0)
            rho = torch.softmax(cur[t, l].double(), 0)
            tot += float((rho * (rho.log() - logq)).sum().detach())
        ref += tot / 5
    assert loss.item() == pytest.approx(ref, rel=1e-5)
    assert met["pr2/pred_kl"] == pytest.approx(ref / 2, rel=1e-5)
    loss.backward()
    assert all(lin.weight.grad is not None and lin.weight.grad.abs().sum() > 0 for lin in preds.layers)
    assert cur.grad is None and feats.h.grad is None  # targets and features are detached


def test_predictor_metrics_known_values():
    # 1 token, 1 layer, E=4, K=2: current logits favour {0, 1}; replayed route {0, 2}
    feats = PR2Features(torch.tensor([0]), torch.tensor([3]), torch.zeros(1, 1, 2), torch.tensor([[[1.0, 2.0, 3.0, 4.0]]]))
    preds = PR2Predictors(2, 4, 1)
    cur = torch.log(torch.tensor([[[0.4, 0.3, 0.2, 0.1]]]))
    _, met = pr2_predictor_loss(preds, feats, cur, current_ids=torch.tensor([[[0, 1]]]),
                                replayed_ids=torch.tensor([[[2, 0]]]))
    assert met["pr2/topk_agreement"] == pytest.approx(0.5)
    assert met["pr2/coverage_gap"] == pytest.approx(1 - 0.6)
    assert met["pr2/zero_dev_token"] == 0.0 and met["pr2/zero_dev_layer"] == 0.0
    assert met["pr2/bias_ratio"] == 0.0  # zero predictor
    with pytest.raises(ValueError, match=r"current_logits shape \(1, 1, 3\) does not match"):
        pr2_predictor_loss(preds, feats, cur[..., :3], top_k=2)
    empty = PR2Features(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), torch.zeros(0, 1, 2),
                        torch.zeros(0, 1, 4))
    loss, met = pr2_predictor_loss(preds, empty, torch.zeros(0, 1, 4), top_k=2)
    assert loss.item() == 0.0 and all(math.isfinite(v) for v in met.values())


def test_param_group_and_state_dict_sync_to_bf16_engine():
    preds = PR2Predictors(8, 4, 3)
    assert all(bool((lin.weight == 0).all()) and lin.bias is None for lin in preds.layers)
    group = pr2_param_group(preds, base_lr=1e-6)
    assert group["lr"] == pytest.approx(1e-3) and len(group["params"]) == 3 and group["weight_decay"] == 0.0
    opt = torch.optim.AdamW([group])
    with torch.no_grad():
        preds.layers[1].weight.normal_()
    buf = io.BytesIO()
    torch.save(preds.state_dict(), buf)
    buf.seek(0)
    engine = PR2Predictors(8, 4, 3)
    engine.load_state_dict(torch.load(buf, weights_only=True))
    h = torch.randn(5, 8, dtype=torch.bfloat16)
    assert torch.equal(engine(1, h), preds(1, h))  # bf16 input cast to the fp32 predictor
    assert engine(1, h).dtype == torch.float32
    assert opt.param_groups[0]["name"] == "pr2_predictors"
    with pytest.raises(ValueError, match="lr_mult"):
        pr2_param_group(preds, 1e-6, lr_mult=0)


@pytest.fixture(scope="module")
def trained():
    return trained_qwen(60)


def test_predictors_learn_known_router_drift(trained):
    """Trainer router = engine router + fixed perturbation. PR2 predictors trained on the rollout features raise
    the share of (token, layer) routes equal to the drifted router's top-k, compared with R3 (zero predictors)."""
    engine, table = trained
    trainer = copy.deepcopy(engine)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for r in RoutingController(trainer).routers:
            r.weight.add_(torch.randn(r.weight.shape, generator=g) * r.weight.std() * 0.5)
    ectl, tctl = RoutingController(engine), RoutingController(trainer)
    preds = PR2Predictors.from_controller(ectl)
    opt = torch.optim.Adam(preds.parameters(), lr=2e-2)

    def agreement(p):
        x = markov_batch(16, 16, torch.Generator().manual_seed(99), table)
        with torch.no_grad():
            with ectl.offsets(p), ectl.record() as rec:
                engine(x)
            with tctl.replay(rec.trace()), tctl.record(which="own") as own:
                trainer(x)
        return routing_metrics(rec.trace(), own.trace())["routing/topk_agreement"]

    r3 = agreement(PR2Predictors.from_controller(ectl))
    assert agreement(preds) == r3  # zero predictors are R3
    first = None
    for step in range(25):
        x = markov_batch(16, 16, g, table)
        cache = FeatureCache(sample_rate=0.5, generator=g)
        with torch.no_grad(), ectl.offsets(preds, feature_cache=cache), ectl.record() as rec:
            engine(x)
        feats = cache.collect()
        with torch.no_grad(), tctl.replay(rec.trace()), tctl.capture_router_logits(feats) as cap:
            trainer(x)
        loss, met = pr2_predictor_loss(preds, feats, cap.logits(), current_ids=cap.own_ids(),
                                       replayed_ids=feats.gather_trace(rec.trace()))
        opt.zero_grad()
        loss.backward()
        opt.step()
        first = met["pr2/pred_kl"] if first is None else first
    assert met["pr2/pred_kl"] < 0.5 * first
    pr2 = agreement(preds)
    assert pr2 > r3 + 0.5 * (1 - r3), (r3, pr2)  # closes at least half of R3's gap to the drifted router


def _loop_metrics(a, b, mask, probs):
    la, lb = a.long_ids(), b.long_ids()
    n_tok = n_dec = n_flip_dec = n_flip_tok = 0
    agree = gap = 0.0
    bsz, s, nl, k = la.shape
    for i in range(bsz):
        for t in range(s):
            if not mask[i, t] or (la[i, t] < 0).any() or (lb[i, t] < 0).any():
                continue
            n_tok += 1
            any_flip = False
            for l in range(nl):
                sa, sb = set(la[i, t, l].tolist()), set(lb[i, t, l].tolist())
                n_dec += 1
                agree += len(sa & sb) / k
                gap += 1 - sum(float(probs[i, t, l, j]) for j in sa)
                if sa != sb:
                    n_flip_dec += 1
                    any_flip = True
            n_flip_tok += any_flip
    return {"routing/decision_mismatch": n_flip_dec / n_dec, "routing/token_mismatch": n_flip_tok / n_tok,
            "routing/topk_agreement": agree / n_dec, "routing/coverage_gap": gap / n_dec,
            "routing/n_tokens": float(n_tok)}


def test_routing_metrics_match_loop():
    g = torch.Generator().manual_seed(0)
    b, s, nl, k, e = 3, 7, 3, 2, 6

    def rand_ids():
        return torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(b * s * nl)]).view(b, s, nl, k)

    a_ids = rand_ids()
    b_ids = torch.where(torch.rand(b, s, nl, 1, generator=g) < 0.6, a_ids.flip(-1), rand_ids())
    b_ids[0, 2] = -1  # not recorded in b
    ta, tb = RouteTrace.from_ids(a_ids, e), RouteTrace.from_ids(b_ids, e)
    mask = torch.rand(b, s, generator=g) < 0.8
    probs = torch.softmax(torch.randn(b, s, nl, e, generator=g), -1)
    got = routing_metrics(ta, tb, mask, probs_b=probs, per_layer=True)
    want = _loop_metrics(ta, tb, mask, probs)
    for key, v in want.items():
        assert got[key] == pytest.approx(v, abs=1e-6), key
    per_layer = [got[f"routing/decision_mismatch/layer_{l}"] for l in range(nl)]
    assert sum(per_layer) / nl == pytest.approx(got["routing/decision_mismatch"])
    assert routing_metrics(ta, ta)["routing/decision_mismatch"] == 0.0
    with pytest.raises(ValueError, match="trace shapes differ"):
        compare_traces(ta, tb.slice(0, 5))
    with pytest.raises(ValueError, match=r"mask shape \(3, 6\)"):
        compare_traces(ta, tb, mask[:, :6])
