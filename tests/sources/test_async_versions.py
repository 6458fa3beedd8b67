"""Per-token policy versions: weights updated in flight inside the engine's sampling loop, and old log-probs taken
under the version that sampled each token (the preparation stage, offpolicy_moe.logprobs.stage)."""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from offpolicy_moe.logprobs.stage import PreparationStage
from offpolicy_moe.logprobs.versions import VersionRing
from offpolicy_moe.trainer.step_metrics import token_lag
from offpolicy_moe.rollout.worker import build_engine, generate_iteration
from offpolicy_moe.rollout.seeds import iteration_seed
from offpolicy_moe.trainer.trainer import Trainer
from tests.tiny import tiny_config


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    cfg = tiny_config(tmp_path_factory.mktemp("v") / "run", "rollout.max_new_tokens=4", "rollout.dtype=float32",
                      "algo.correction.mode=truncate")
    trainer = Trainer(cfg)
    v0 = {k: v.clone() for k, v in trainer.unwrapped.state_dict().items()}
    g = torch.Generator().manual_seed(1)
    v1 = {k: (v + 0.5 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v.clone())
          for k, v in v0.items()}
    return cfg, trainer, v0, v1


def _engine(cfg, trainer, state, version):
    engine = build_engine(cfg, copy.deepcopy(trainer.unwrapped), trainer.tok)
    engine.sync(state, version)
    return engine


def _switch_at(call: int, state: dict, version: int):
    calls = {"n": 0}

    def hook(engine):
        calls["n"] += 1
        if calls["n"] == call:
            engine.sync(state, version)
    return hook


def _gen(cfg, trainer, engine, it=0):
    return generate_iteration(engine, trainer.task, cfg.rollout, iteration=it, seed=iteration_seed(cfg.seed, it))


def test_versions_per_token_across_an_update_in_flight(parts):
    cfg, trainer, v0, v1 = parts
    plain = _gen(cfg, trainer, _engine(cfg, trainer, v0, 0))
    engine = _engine(cfg, trainer, v0, 0)
    engine.call_between_tokens(_switch_at(2, v1, 1))        # before the 2nd decode forward: tokens 0, 1 by v0, then v1
    mixed = _gen(cfg, trainer, engine)
    T = mixed.response_len
    assert T >= 3
    assert mixed.version == 0 and engine.version == 1
    expect = torch.tensor([0, 0] + [1] * (T - 2)).expand(mixed.size, T)
    assert torch.equal(mixed.token_versions, expect)
    assert plain.token_versions.unique().tolist() == [0]
    # the tokens sampled before the update are those of the run without it, with the same log-probs
    assert torch.equal(mixed.response_ids[:, :2], plain.response_ids[:, :2])
    assert torch.equal(mixed.behav_logp[:, :2], plain.behav_logp[:, :2])
    # after it the distribution is the new one
    m = mixed.response_mask[:, 2].bool() & plain.response_mask[:, 2].bool()
    assert not torch.equal(mixed.behav_logp[:, 2][m], plain.behav_logp[:, 2][m])
    lag_mean, lag_max = token_lag(2, mixed)
    mask = mixed.response_mask.bool()
    assert lag_max == 2.0 and lag_mean == pytest.approx(float((2 - mixed.token_versions[mask]).double().mean()))


def test_an_update_to_the_same_weights_changes_nothing_but_the_labels(parts):
    cfg, trainer, v0, _ = parts
    plain = _gen(cfg, trainer, _engine(cfg, trainer, v0, 0), it=1)
    engine = _engine(cfg, trainer, v0, 0)
    engine.call_between_tokens(_switch_at(1, v0, 1))
    same = _gen(cfg, trainer, engine, it=1)
    assert torch.equal(same.input_ids, plain.input_ids) and torch.equal(same.behav_logp, plain.behav_logp)
    assert same.token_versions[:, 0].unique().tolist() == [0] and same.token_versions[:, 1:].unique().tolist() == [1]


def test_old_logp_of_each_token_comes_from_its_own_version(parts):
    cfg, trainer, v0, v1 = parts
    engine = _engine(cfg, trainer, v0, 0)
    engine.call_between_tokens(_switch_at(2, v1, 1))
    batch = _gen(cfg, trainer, engine, it=2)
    refs = {}
    for v, state in ((0, v0), (1, v1)):           # each version's pass on a trainer that holds it
        holder = Trainer(tiny_config(cfg.run_dir + f"_v{v}", "rollout.max_new_tokens=4", "rollout.dtype=float32",
                                     "algo.correction.mode=truncate"))
        holder.unwrapped.load_state_dict(state)
        whole = dataclasses.replace(batch, token_versions=None)          # every token at the version held
        refs[v] = holder.stage.prepare(whole, current=whole.version).batch.old_logp
    assert not torch.equal(refs[0], refs[1])
    own = {k: v.clone() for k, v in trainer.unwrapped.state_dict().items()}
    stage = PreparationStage(trainer.stage.strategy, model=trainer.unwrapped, forward=trainer.forward,
                             accelerator=trainer.accelerator, keep=2)
    stage.keep(0, v0)
    stage.keep(1, v1)
    # current=2: neither version is the one the trainer's live model holds
    prepared = stage.prepare(batch, current=2)
    expect = torch.where(batch.token_versions == 1, refs[1], refs[0])
    assert torch.equal(prepared.batch.old_logp, expect) and batch.old_logp is None    # a new batch: the input kept
    assert all(torch.equal(v, own[k]) for k, v in trainer.unwrapped.state_dict().items())   # live model untouched


def test_a_stage_without_past_versions_refuses_an_older_batch_in_one_line(parts):
    cfg, trainer, v0, _ = parts
    batch = _gen(cfg, trainer, _engine(cfg, trainer, v0, 0), it=3)
    with pytest.raises(RuntimeError, match="keeps no past versions"):
        trainer.stage.prepare(batch, current=1)


def test_version_ring_forgets_old_versions_and_names_them():
    ring = VersionRing(keep=2)
    for v in range(3):
        ring.add(v, {"w": torch.full((2,), float(v))})
    assert 0 not in ring and float(ring[2]["w"][0]) == 2.0
    with pytest.raises(KeyError, match="version 0 is not kept"):
        ring[0]
    with pytest.raises(ValueError, match="keep=0"):
        VersionRing(0)
