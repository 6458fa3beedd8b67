"""Where the engine's per-token log-probs are exact (float32 built-in engine, R3, nothing measured), a worker
source's preparation takes them and skips the old-log-prob pass; they agree with the pass under every version a
row spans."""
from __future__ import annotations

import copy
import dataclasses
from types import SimpleNamespace

import pytest
import torch

from offpolicy_moe.config import load_config
from offpolicy_moe.logprobs.strategies import AtConsumption, FromEngine
from offpolicy_moe.logprobs.stage import PreparationStage, engine_logp_exact, one_version_rows
from offpolicy_moe.rollout.seeds import iteration_seed
from offpolicy_moe.rollout.worker import build_engine, generate_iteration
from offpolicy_moe.trainer.trainer import Trainer
from tests.tiny import tiny_config

EXACT = ("rollout.dtype=float32", "algo.routing.replay=r3", "trainer.mismatch_metrics=false",
         "algo.routing.metrics=false")
STREAM = ("buffer.mode=stream", "buffer.staleness=1", "rollout.early_start=false")
#: float32 rounding between the engine's cached decode and the pass's full forward of the same routes
ROUNDING = 1e-5


def test_the_conditions_of_exact_engine_log_probs():
    base = list(EXACT)
    assert engine_logp_exact(load_config(None, base), is_moe=True, measure_routing=False)
    assert engine_logp_exact(load_config(None, [*base, "algo.routing.replay=none"]), is_moe=False,
                             measure_routing=False)                           # a dense model has no routes to replay
    for spoiler in ("rollout.dtype=bfloat16", "model.dtype=bfloat16", "trainer.mismatch_metrics=true",
                    "algo.routing.replay=none", "rollout.router_noise=0.1", "rollout.router_perturb=0.1",
                    "rollout.top_k=5", "rollout.top_p=0.9"):
        assert not engine_logp_exact(load_config(None, [*base, spoiler]), is_moe=True, measure_routing=False), spoiler
    assert not engine_logp_exact(load_config(None, base), is_moe=True, measure_routing=True)


@pytest.fixture(scope="module")
def stream_trainer(tmp_path_factory):
    cfg = tiny_config(tmp_path_factory.mktemp("exact") / "run", *EXACT, *STREAM, "rollout.max_new_tokens=4")
    trainer = Trainer(cfg)
    yield cfg, trainer
    trainer.source.close()


def test_only_a_worker_source_with_exact_log_probs_skips_the_pass(stream_trainer, tmp_path):
    _, trainer = stream_trainer
    assert trainer.stage.engine_exact
    sync = Trainer(tiny_config(tmp_path / "sync", *EXACT, "buffer.staleness=1", "trainer.steps=3"))
    assert not sync.stage.engine_exact                  # an in-process source keeps its pass: its numbers never move
    measured = Trainer(tiny_config(tmp_path / "measured", *EXACT, *STREAM, "trainer.mismatch_metrics=true"))
    assert not measured.stage.engine_exact
    measured.source.close()


def test_the_engine_log_probs_agree_with_the_pass_under_each_version(stream_trainer):
    cfg, trainer = stream_trainer
    v0 = {k: v.clone() for k, v in trainer.unwrapped.state_dict().items()}
    g = torch.Generator().manual_seed(3)
    v1 = {k: (v + 0.05 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v.clone())
          for k, v in v0.items()}
    engine = build_engine(cfg, copy.deepcopy(trainer.unwrapped), trainer.tok)
    engine.sync(v0, 0)
    calls = {"n": 0}

    def switch(eng):                     # in-flight weights: tokens 0, 1 by version 0, the rest by version 1
        calls["n"] += 1
        if calls["n"] == 2:
            eng.sync(v1, 1)
    engine.call_between_tokens(switch)
    batch = generate_iteration(engine, trainer.task, cfg.rollout, iteration=0, seed=iteration_seed(cfg.seed, 0))
    assert batch.token_versions.unique().tolist() == [0, 1] and batch.routes is not None

    passed = PreparationStage(trainer.stage.strategy, model=trainer.unwrapped, forward=trainer.forward,
                              accelerator=trainer.accelerator, keep=2)
    passed.keep(0, v0)
    passed.keep(1, v1)
    trainer.stage.keep(0, v0)
    trainer.stage.keep(1, v1)
    reference = passed.prepare(batch, current=2).batch.old_logp          # the pass, each token under its version
    exact = trainer.stage.prepare(batch, current=2).batch.old_logp
    single = one_version_rows(batch)
    spans = ~single
    assert bool(single.any()) and bool(spans.any())           # rows that ended before the switch, and rows across it
    mask = batch.response_mask.bool()
    # a row of one version: the engine's log-probs, taken as they are, agree with that version's pass
    assert torch.equal(exact[single], batch.behav_logp[single])
    assert float((reference - batch.behav_logp)[single][mask[single]].abs().max()) <= ROUNDING
    # a row across the switch: its later tokens were sampled over version 0's KV cache, so the engine's log-probs
    # are not version 1's; the stage keeps the pass for it
    assert float((reference - batch.behav_logp)[spans][mask[spans]].abs().max()) > 100 * ROUNDING
    assert float((reference - exact)[spans][mask[spans]].abs().max()) <= ROUNDING


def test_non_finite_behaviour_log_probs_get_the_pass(stream_trainer):
    cfg, trainer = stream_trainer
    engine = build_engine(cfg, copy.deepcopy(trainer.unwrapped), trainer.tok)
    engine.sync(trainer.unwrapped.state_dict(), 0)
    batch = generate_iteration(engine, trainer.task, cfg.rollout, iteration=1, seed=iteration_seed(cfg.seed, 1))
    spoiled = batch.behav_logp.clone()
    spoiled[0, 0] = float("nan")
    assert not trainer.stage.takes_engine_logp(dataclasses.replace(batch, behav_logp=spoiled))
    assert trainer.stage.takes_engine_logp(batch) and bool(one_version_rows(batch).all())
    strategy = trainer.stage.strategy
    for other in (AtConsumption, FromEngine):          # old log-probs not taken in a pass: nothing to skip
        stage = PreparationStage(other(strategy.passes, strategy.corr, strategy.device, trainer.unwrapped),
                                 model=trainer.unwrapped, forward=trainer.forward, accelerator=trainer.accelerator,
                                 engine_exact=True)
        assert not stage.takes_engine_logp(batch)
    exact = trainer.stage.prepare(batch, current=0).batch.old_logp
    reference = PreparationStage(trainer.stage.strategy, model=trainer.unwrapped, forward=trainer.forward,
                                 accelerator=trainer.accelerator).prepare(batch, current=0).batch.old_logp
    assert torch.equal(exact, batch.behav_logp) and exact is not batch.behav_logp
    assert float((reference - exact)[batch.response_mask.bool()].abs().max()) <= ROUNDING


def test_one_version_rows_reads_the_response_tokens_only():
    tv = torch.tensor([[0, 0, 1], [2, 2, 2], [0, 1, 1], [5, 5, 5]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 1, 0], [0, 0, 0]])
    batch = SimpleNamespace(token_versions=tv, response_mask=mask)
    assert one_version_rows(batch).tolist() == [True, True, False, True]
    assert one_version_rows(SimpleNamespace(token_versions=None, response_mask=mask)).tolist() == [True] * 4
