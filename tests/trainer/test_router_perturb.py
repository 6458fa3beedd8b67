"""``rollout.router_perturb``: a fixed, seeded perturbation ``dW`` of the engine's router weights (the engine routes on
``logits + h dW^T``, the trainer does not), drawn from the run's seed alone (tiny MoE, CPU, one thread)."""
from __future__ import annotations

import copy
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from offpolicy_moe.config import load_config, validate
from offpolicy_moe.config.schema import ModelConfig, TaskConfig
from offpolicy_moe.trainer.callbacks import FunctionCallback
from offpolicy_moe.trainer.launch import train
from offpolicy_moe.rollout.worker import build_engine
from offpolicy_moe.rollout.engine import HFRolloutEngine, make_engine
from offpolicy_moe.trainer.trainer import Trainer
from offpolicy_moe.models import load_policy
from offpolicy_moe.routing import (FeatureCache, PR2Predictors, RoutingController, compare_traces,
                                   perturbation_seed, router_perturbation)
from offpolicy_moe.tasks import make_task

from tests.tiny import rollout_engine, tiny_config, tiny_policy


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def _prompts(n: int = 4):
    rows = make_task(TaskConfig()).sample_prompts(0, n)
    return [r["prompt"] for r in rows], [r["answer"] for r in rows]


def _engine(sigma: float, seed: int = 0, *, layers: int = 2, **kw) -> HFRolloutEngine:
    model, tok = tiny_policy(num_layers=layers, seed=3)
    kw.setdefault("dtype", "float32")
    kw.setdefault("max_new_tokens", 4)
    return rollout_engine(model, tok, record_routes=True, router_perturb=sigma, seed=seed, **kw)


def _weights(pert: PR2Predictors) -> list[torch.Tensor]:
    return [lin.weight.detach().cpu().clone() for lin in pert.layers]


# ---------------------------------------------------------------------------------------------- the draw
def test_perturbation_is_a_function_of_the_seed_with_the_documented_scale():
    a = router_perturbation(64, 8, 3, 0.5, seed=11)
    b = router_perturbation(64, 8, 3, 0.5, seed=11)
    c = router_perturbation(64, 8, 3, 0.5, seed=12)
    assert all(torch.equal(x, y) for x, y in zip(_weights(a), _weights(b)))
    assert all(not torch.equal(x, y) for x, y in zip(_weights(a), _weights(c)))
    w = torch.stack(_weights(a))                           # [L, E, H]
    assert w.shape == (3, 8, 64) and not any(p.requires_grad for p in a.parameters())
    assert abs(float(w.std()) - 0.5 / math.sqrt(64)) < 0.1 * 0.5 / math.sqrt(64)
    assert not torch.equal(w[0], w[1])                      # each layer its own draw
    # sigma scales one fixed draw; the seed derivation is a pure function (negative seeds wrap)
    half = torch.stack(_weights(router_perturbation(64, 8, 3, 0.25, seed=11)))
    torch.testing.assert_close(half * 2, w, rtol=0, atol=1e-7)
    assert perturbation_seed(11) == perturbation_seed(11) != perturbation_seed(12)
    assert 0 <= perturbation_seed(-1) < 2 ** 63
    with pytest.raises(ValueError, match="sigma"):
        router_perturbation(64, 8, 3, float("nan"), seed=0)


def test_engines_draw_the_same_perturbation_for_a_seed_and_keep_it_across_syncs():
    e1, e2, e3 = _engine(1.0, seed=5), _engine(1.0, seed=5), _engine(1.0, seed=6)
    assert all(torch.equal(x, y) for x, y in zip(_weights(e1.router_perturbation), _weights(e2.router_perturbation)))
    assert not any(torch.equal(x, y) for x, y in zip(_weights(e1.router_perturbation),
                                                     _weights(e3.router_perturbation)))
    before = _weights(e1.router_perturbation)
    other, _ = tiny_policy(num_layers=2, seed=9)            # new policy weights: dW does not follow them
    e1.sync(other.state_dict(), version=1)
    assert all(torch.equal(x, y) for x, y in zip(before, _weights(e1.router_perturbation)))
    # sigma = 0: nothing drawn, no router hook beyond recording
    assert _engine(0.0).router_perturbation is None


def test_trainer_engine_and_async_worker_engine_get_the_same_perturbation(make_cfg):
    cfg = make_cfg("rollout.router_perturb=0.7", "seed=21", "buffer.mode=async", "preset=[grpo,r3]")
    model, tok = load_policy(cfg.model, seed=cfg.seed, task=make_task(cfg.task))
    mine = make_engine(model, tok, cfg.rollout, record_routes=True, seed=cfg.seed)
    worker = build_engine(cfg, model, tok)
    assert all(torch.equal(x, y) for x, y in zip(_weights(mine.router_perturbation),
                                                 _weights(worker.router_perturbation)))
    assert mine.router_perturbation.layers[0].weight.shape == (cfg.model.num_experts, cfg.model.hidden_size)


# ------------------------------------------------------------------------------------------ the routing
def test_engine_routes_and_logprobs_are_those_of_router_weights_w_plus_dw():
    """The engine with perturbation sigma routes exactly as a copy of the policy whose router weights are W + dW."""
    eng = _engine(1.0, seed=2, layers=2)
    prompts, answers = _prompts(4)
    batch = eng.generate(prompts, answers, group_size=2, seed=4)
    shifted = copy.deepcopy(eng.model)
    ctl = RoutingController(shifted)
    with torch.no_grad():
        for router, lin in zip(ctl.routers, eng.router_perturbation.layers):
            router.weight += lin.weight
        am = batch.attention_mask
        pos = (am.cumsum(-1) - 1).clamp_min(0)
        with ctl.record() as rec:
            logits = shifted(input_ids=batch.input_ids, attention_mask=am, position_ids=pos).logits.float()
    own = rec.trace()
    seen = batch.routes.recorded_mask() & am.bool()
    same = ~compare_traces(batch.routes, own, mask=seen).differs.any(-1)
    assert float(same[seen].float().mean()) >= 0.99          # (W + dW) h and W h + dW h: equal up to near-ties
    P = batch.prompt_len
    lp = torch.log_softmax(logits[:, P - 1:-1], -1).gather(-1, batch.input_ids[:, P:, None]).squeeze(-1)
    m = batch.response_mask.bool()
    torch.testing.assert_close(lp[m], batch.behav_logp[m], rtol=0, atol=1e-4)


def test_shared_prefill_and_compaction_stay_exact_under_the_perturbation(monkeypatch):
    """dW is a function of each token's router input, so a prompt prefilled once for its G samples and finished
    rows leaving the decode batch give the same samples and routes as the plain loop."""
    prompts, answers = _prompts(3)
    out = {}
    for shared in (True, False):
        eng = _engine(1.0, seed=1, layers=2, max_new_tokens=6, temperature=1.5, compact_finished=shared)
        with torch.no_grad():      # make EOS likely so that rows finish at different steps
            eng.model.lm_head.weight[eng.tokenizer.eos_token_id] += 0.6 * eng.model.lm_head.weight[3:13].mean(0)
        if not shared:
            monkeypatch.setattr(eng, "_shared_prefill_groups", lambda ids, am, g: 1)
        else:
            assert eng._shared_prefill_groups(*_group_rows(eng, prompts, 4), 4) == 4
        out[shared] = eng.generate(prompts, answers, group_size=4, seed=8)
    a, b = out[True], out[False]
    assert torch.equal(a.input_ids, b.input_ids) and a.completions == b.completions
    torch.testing.assert_close(a.behav_logp, b.behav_logp, rtol=0, atol=1e-5)
    both = a.routes.recorded_mask() & b.routes.recorded_mask() & a.attention_mask.bool()
    assert torch.equal(a.routes.ids[both], b.routes.ids[both])


def _group_rows(eng: HFRolloutEngine, prompts: list[str], g: int) -> tuple[torch.Tensor, torch.Tensor]:
    from offpolicy_moe.tasks import encode_prompts
    ids, am = encode_prompts(eng.tokenizer, prompts)
    return ids.repeat_interleave(g, 0), am.repeat_interleave(g, 0)


def test_pr2_offsets_compose_with_the_perturbation_and_features_see_the_perturbed_router():
    """PR2 on top of the perturbation: zero predictors route as the perturbation alone; the cached features' logits
    are the perturbed router's, ``h (W + dW)^T``."""
    prompts, answers = _prompts(4)
    plain = _engine(1.0, seed=3)
    pred = PR2Predictors.from_controller(plain.controller)
    pr2 = _engine(1.0, seed=3, pr2_predictors=pred, pr2_feature_sample_rate=1.0)
    a = plain.generate(prompts, answers, group_size=2, seed=6)
    b = pr2.generate(prompts, answers, group_size=2, seed=6)
    assert torch.equal(a.input_ids, b.input_ids)
    seen = a.routes.recorded_mask() & a.attention_mask.bool()
    assert torch.equal(a.routes.ids[seen], b.routes.ids[seen])
    f = b.pr2_features
    assert f is not None and f.num_tokens > 0
    for layer, (router, lin) in enumerate(zip(pr2.controller.routers, pr2.router_perturbation.layers)):
        want = F.linear(f.h[:, layer].float(), router.weight.float() + lin.weight)
        torch.testing.assert_close(f.logits[:, layer].float(), want, rtol=0, atol=1e-5)
    # the weights see the perturbation even when the PR2 bias stays out of them (in_weights=False)
    ctl = RoutingController(plain.model)
    ids = a.input_ids[:2]
    outs = []
    for in_w in (True, False):
        with torch.no_grad(), ctl.offsets(pred, in_weights=in_w, fixed=plain.router_perturbation):
            outs.append(plain.model(input_ids=ids).logits)
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=1e-6)


def test_dense_model_ignores_router_noise_and_perturbation():
    """Validation warns that they have no effect on a dense model; the engine then does nothing with them."""
    task = make_task(TaskConfig())
    model, tok = load_policy(ModelConfig(preset="tiny-dense", num_layers=1, hidden_size=32), seed=0, task=task)
    eng = rollout_engine(model, tok, dtype="float32", max_new_tokens=2, router_noise=0.5, router_perturb=1.0)
    assert eng.controller is None and eng.router_perturbation is None
    prompts, answers = _prompts(2)
    assert eng.generate(prompts, answers, group_size=2, seed=0).routes is None
    cfg = load_config(overrides=["model.preset=tiny-dense", "rollout.router_perturb=1.0"])
    assert any("rollout.router_perturb" in w for w in validate(cfg, model_is_moe=False))
    ok = load_config(overrides=["rollout.router_perturb=1.0", "buffer.mode=async"], presets=["r3"])
    assert validate(ok, model_is_moe=True) == []
    assert validate(load_config(overrides=["rollout.router_perturb=1.0"], presets=["pr2"]), model_is_moe=True) == []


# ------------------------------------------------------------------------------------------- the trainer
def _metrics(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows]


TRAIN = ("model.num_layers=2", "rollout.dtype=float32", "trainer.steps=2", "trainer.threads=1",
         "trainer.log_every=1", "trainer.sft_warmup_steps=10", "trainer.export_final=false", "preset=[grpo,r3]")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[float, list[dict]]:
    """Two steps of GRPO + R3 (float32 engine: no other source of mismatch) per sigma; every row's metrics."""
    out = {}
    for sigma in (0.0, 1.0):
        d = tmp_path_factory.mktemp("perturb") / "run"
        assert train(tiny_config(d, *TRAIN, f"rollout.router_perturb={sigma}"))["status"] == "completed"
        out[sigma] = [r for r in _metrics(d) if "routing/decision_mismatch" in r]
    return out


def test_perturbed_engine_routes_differ_from_the_trainers_and_the_mismatch_goes_up(runs):
    base, pert = runs[0.0], runs[1.0]
    assert base and pert
    for r in base:                                       # float32 engine, no perturbation: the same model
        assert r["routing/decision_mismatch"] == 0.0 and r["mismatch/k3_kl_no_r3"] < 1e-6
    for r0, r in zip(base, pert):
        assert r["routing/decision_mismatch"] > 0.2         # a clear share of (token, layer) pairs
        assert r["mismatch/k3_kl_no_r3"] > max(10 * r0["mismatch/k3_kl_no_r3"], 1e-6)


def test_r3_replays_the_perturbed_routes(runs):
    """R3 replays the engine's (perturbed) choices: the routes still differ from the trainer's own, yet replaying
    them removes most of the k3 mismatch (what is left: the gating weights of W + dW vs W)."""
    for r in runs[1.0]:
        assert r["routing/decision_mismatch"] > 0
        assert r["mismatch/k3_kl_r3"] < 0.5 * r["mismatch/k3_kl_no_r3"]
        assert r["mismatch/k3_kl"] == r["mismatch/k3_kl_r3"]     # R3's old_logp is the replayed pass


RESUME = ("buffer.staleness=1", "trainer.steps=3", "trainer.checkpoint_every=1", "algo.routing.replay=r3",
          "trainer.threads=1", "trainer.keep_checkpoints=0", "rollout.router_perturb=1.0",
          "trainer.export_final=false")


def test_resume_with_the_perturbation_is_bit_identical(tmp_path):
    ref = tmp_path / "ref"
    assert train(tiny_config(ref, *RESUME))["status"] == "completed"
    d = tmp_path / "resumed"
    shutil.copytree(ref, d)
    (d / "summary.json").unlink()
    for p in (d / "checkpoints").iterdir():
        if int(p.name.split("_")[1]) > 1:
            shutil.rmtree(p)
    assert train(tiny_config(d, *RESUME), resume=True)["status"] == "completed"
    a = load_file(str(ref / "checkpoints" / "step_3" / "model.safetensors"))
    b = load_file(str(d / "checkpoints" / "step_3" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert _metrics(d) == _metrics(ref)
    assert any(r.get("routing/decision_mismatch", 0) > 0 for r in _metrics(ref))


def test_async_workers_sample_what_the_synchronous_trainer_samples_under_the_perturbation(make_cfg):
    """staleness 0: the worker process (its own engine, its own dW from the run's seed) samples exactly what the
    synchronous loop samples."""
    seen: dict[str, list] = {"fixed": [], "async": []}
    for mode in ("fixed", "async"):
        cfg = make_cfg(f"buffer.mode={mode}", "buffer.staleness=0", "trainer.steps=2", "rollout.router_perturb=1.0",
                       "seed=5", "preset=[grpo,r3]", "trainer.export_final=false")
        cb = FunctionCallback(on_batch=lambda tr, b, mode=mode: seen[mode].append(
            (b.input_ids.clone(), b.behav_logp.clone(), b.routes.ids.clone())))
        assert Trainer(cfg, callbacks=[cb]).run()["status"] == "completed"
    assert len(seen["async"]) == len(seen["fixed"]) == 2
    for (ids_a, lp_a, r_a), (ids_s, lp_s, r_s) in zip(seen["async"], seen["fixed"]):
        assert torch.equal(ids_a, ids_s) and torch.equal(lp_a, lp_s) and torch.equal(r_a, r_s)
