"""Continuous batching on vLLM (rollout/vllm_stream.py) against the trainer: weights loaded between two engine
steps, each token's version and behaviour log-prob those of the weights that scored it, the engine's routes
replayed exactly, and ``buffer.mode=stream rollout.engine=vllm`` end to end."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from offpolicy_moe.rollout.group_batch import group_batch
from offpolicy_moe.rollout.slots import StreamSample
from offpolicy_moe.rollout.stream_worker import sample_seed
from offpolicy_moe.rollout.vllm_engine import VLLMRolloutEngine
from offpolicy_moe.rollout.vllm_stream import VLLMStreamSampler
from offpolicy_moe.routing.state import ModelShape
from offpolicy_moe.tasks import encode_prompts
from tests.vllm.conftest import PROMPTS, TEMPERATURE, assert_routes_replay_exactly, vllm_config

pytestmark = pytest.mark.vllm

SLOTS = 6
GROUP = 3


@pytest.fixture(scope="module")
def stream_engine(policies, tok):
    """An fp32 vLLM engine of policy 0, started for stepping, recording routes."""
    cfg = vllm_config("rollout.dtype=float32", "rollout.max_new_tokens=12", f"rollout.temperature={TEMPERATURE}",
                      f"rollout.batch_size={SLOTS}")
    eng = VLLMRolloutEngine(policies[0], tok, cfg.rollout, record_routes=True, seed=0, stream=True)
    yield eng
    eng.close()


def _samples(tok, seed=5):
    out = []
    for g, prompt in enumerate(PROMPTS):
        ids = encode_prompts(tok, [prompt])[0][0]
        out += [StreamSample((g, j), ids, sample_seed(seed + g, j)) for j in range(GROUP)]
    return out


def _run(sampler, samples, hook=None) -> dict:
    """Submit ``samples`` and step until all are done; ``hook(step)`` runs before each step."""
    sampler.submit(samples)
    done, step = {}, 0
    while sampler.active or sampler.queued:
        if hook is not None:
            hook(step)
        for s in sampler.step():
            done[s.key] = s
        step += 1
        assert step < 200
    return done


def test_a_sampler_needs_an_engine_started_for_stepping():
    with pytest.raises(ValueError, match="stream=True"):
        VLLMStreamSampler(object())


def test_bad_samples_are_refused_in_one_line_before_vllm_sees_them(stream_engine):
    sampler = VLLMStreamSampler(stream_engine)
    too_long = torch.ones(stream_engine.opts.max_model_len, dtype=torch.long)
    with pytest.raises(ValueError, match="rollout.vllm_max_model_len"):
        sampler.submit([StreamSample((0, 0), too_long, 1)])
    with pytest.raises(ValueError, match="non-empty 1-D integer tensor"):
        sampler.submit([StreamSample((0, 1), torch.ones(3), 1)])
    assert sampler.queued == 0 and sampler.active == 0


def _row_logp(p0, p1, ids: torch.Tensor, prompt_len: int, first_new: int) -> torch.Tensor:
    """``[n]`` log-probs (at the test's temperature) of the response tokens of one unpadded row whose tokens from
    response index ``first_new`` on were scored after the switch from ``p0`` to ``p1``: the positions fed before
    the switch (the prompt's prefill scored token 0; position ``P + t - 1`` scored token ``t``) are cached by
    ``p0``, the rest are fed to ``p1`` on top of that cache (a running request keeps its KV cache across a weight
    load)."""
    cut = prompt_len + first_new - 1 if first_new else 0      # positions [0, cut) were fed under p0
    with torch.no_grad():
        if cut == 0:
            logits = p1(ids.unsqueeze(0)).logits[0]
        elif cut >= ids.numel() - 1:
            logits = p0(ids.unsqueeze(0)).logits[0]
        else:
            first = p0(ids[:cut].unsqueeze(0), use_cache=True)
            rest = p1(ids[cut:].unsqueeze(0), past_key_values=first.past_key_values,
                      position_ids=torch.arange(cut, ids.numel()).unsqueeze(0))
            logits = torch.cat([first.logits[0], rest.logits[0]], 0)
    lp = torch.log_softmax(logits.float() / TEMPERATURE, -1)
    return lp[prompt_len - 1:-1].gather(-1, ids[prompt_len:, None]).squeeze(-1)


def test_weights_loaded_between_engine_steps_score_the_tokens_after_them(stream_engine, policies, tok):
    """Policy 0 until step 4, policy 1 from there, mid-flight (6 slots, 12 samples: the first six span the switch,
    the last six start after it): every token carries the version of the step that scored it, and its behaviour
    log-prob is exactly that step's (fp32 engine == fp32 trainer): the old weights' cache for the positions fed
    before the load, the new weights from there."""
    eng = stream_engine
    eng.sync(policies[0].state_dict(), 0)

    def hook(step):
        if step == 4:
            eng.sync(policies[1].state_dict(), 1)

    done = _run(VLLMStreamSampler(eng), _samples(tok), hook)
    assert len(done) == len(PROMPTS) * GROUP
    assert eng.unchecked_syncs >= 1           # the probe needs an idle engine: left out mid-flight
    kinds = {"spans": 0, "old": 0, "new": 0}
    for s in done.values():
        v = s.versions.tolist()
        assert v == sorted(v) and set(v) <= {0, 1}
        first_new = v.index(1) if 1 in v else len(v)
        kinds["new" if first_new == 0 else "old" if first_new == len(v) else "spans"] += 1
        ids = torch.cat([s.prompt_ids, s.response_ids])
        ref = _row_logp(policies[0], policies[1], ids, s.prompt_ids.numel(), first_new)
        assert (ref - s.behav_logp).abs().max() < 2e-5, s.key
        if 0 < first_new < len(v):            # not the new weights' own log-probs: the old cache was kept
            plain = _row_logp(policies[0], policies[1], ids, s.prompt_ids.numel(), 0)
            assert (plain - s.behav_logp)[first_new:].abs().max() > 1e-3, s.key
    assert kinds["spans"] > 0 and kinds["new"] > 0, kinds


def test_a_samples_tokens_depend_on_its_seed_not_on_when_it_was_admitted(stream_engine, policies, tok):
    """The same samples, submitted all at once or one group per step into fewer free slots, draw the same
    tokens."""
    eng = stream_engine
    eng.sync(policies[1].state_dict(), 2)
    samples = _samples(tok, seed=9)
    together = _run(VLLMStreamSampler(eng), samples)
    sampler = VLLMStreamSampler(eng)
    staggered = {}
    for g in range(len(PROMPTS)):
        sampler.submit(samples[g * GROUP:(g + 1) * GROUP])
        for s in sampler.step():
            staggered[s.key] = s
    staggered.update(_run(sampler, []))
    assert together.keys() == staggered.keys()
    for key in together:
        assert torch.equal(together[key].response_ids, staggered[key].response_ids), key


def test_the_streamed_routes_are_replayed_exactly(stream_engine, policies, tok):
    """One version throughout: the routes the stepped engine recorded are the trainer's own choice, and replaying
    them changes no logit, with no fallback."""
    eng = stream_engine
    eng.sync(policies[1].state_dict(), 3)
    done = _run(VLLMStreamSampler(eng), _samples(tok, seed=13))
    shape = ModelShape(eng.num_experts, eng.top_k_experts, tuple(eng.layer_ids))
    batch = group_batch([done[(1, j)] for j in range(GROUP)], answer="", group=1, tokenizer=tok, route_shape=shape)
    assert_routes_replay_exactly(policies[1], batch)


def test_a_stream_run_on_vllm_trains_rows_of_several_versions_with_r3(tmp_path):
    """``buffer.mode=stream rollout.engine=vllm``: rows span versions, staleness stays within k, R3 replays every
    route (bf16 engine, fp32 trainer: the real mismatch)."""
    run = tmp_path / "stream"
    job = ["rollout.engine=vllm", "rollout.dtype=bfloat16", "preset=[grpo,tis,r3]", "buffer.mode=stream",
           "buffer.staleness=1", "rollout.stream_slots=8", "rollout.prompts_per_step=4", "rollout.group_size=4",
           "rollout.max_new_tokens=16", "task.name=longtail", "trainer.sft_warmup_steps=5", "trainer.eval_every=0",
           "task.eval_size=16", "trainer.steps=6", "logging.progress=false", "logging.loggers=[jsonl]",
           "trainer.min_free_mb=1"]
    env = dict(os.environ, VLLM_LOGGING_LEVEL="ERROR")
    out = subprocess.run([sys.executable, "-m", "offpolicy_moe", "train", *job, "--run-dir", str(run)],
                         capture_output=True, text=True, timeout=900, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "offpolicy/versions_per_row_max" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert max(r["offpolicy/versions_per_row_max"] for r in rows) >= 2
    assert all(r["offpolicy/staleness_max"] <= 1 for r in rows)
    assert all(r["routing/replay_fallback"] == 0.0 for r in rows)
    assert all(r["mismatch/k3_kl"] > 0 for r in rows)
