"""Unit tests: behaviour log-probs of the sampling distribution, response log-probs, loggers, checkpoints."""
from __future__ import annotations

import json
import os

import pytest
import torch

from tests.tiny import rollout_engine
from offpolicy_moe.run.loggers import JsonlLogger, WandbLogger, clean_metrics
from offpolicy_moe.models.response_logprobs import response_logprobs
from offpolicy_moe.rollout.engine import HFRolloutEngine, resolve_dtype


@pytest.fixture(scope="module")
def tiny():
    from offpolicy_moe.config.schema import ModelConfig
    from offpolicy_moe.models import load_policy

    model, tok = load_policy(ModelConfig(num_layers=1, hidden_size=32, num_experts=4, top_k=2), seed=0)
    return model, tok


PROMPTS = ["1+2=", "7+8=", "3+3=", "9+0="]


def brute_force_logp(model, seq, am, P, temperature=1.0, top_p=1.0):
    """Sampling log-prob of each response token: full forward, logits/temperature, nucleus renormalised."""
    with torch.no_grad():
        logits = model(input_ids=seq, attention_mask=am,
                       position_ids=(am.cumsum(-1) - 1).clamp(min=0)).logits.float()
    out = torch.zeros(seq.shape[0], seq.shape[1] - P)
    for b in range(seq.shape[0]):
        for t in range(seq.shape[1] - P):
            z = logits[b, P - 1 + t] / temperature
            p = torch.softmax(z, -1)
            if top_p < 1.0:
                order = torch.argsort(p, descending=True)
                cum = torch.cumsum(p[order], 0)
                keep = torch.zeros_like(p, dtype=torch.bool)
                keep[order[(cum - p[order]) < top_p]] = True    # smallest prefix reaching top_p
                p = torch.where(keep, p, torch.zeros_like(p))
                p = p / p.sum()
            out[b, t] = torch.log(p[seq[b, P + t]])
    return out


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 1.0), (1.3, 0.8)])
def test_behaviour_logp_is_the_sampling_distribution(tiny, temperature, top_p):
    model, tok = tiny
    eng = rollout_engine(model, tok, dtype="float32", max_new_tokens=4, temperature=temperature, top_p=top_p)
    batch = eng.generate(PROMPTS, ["3", "15", "6", "9"], group_size=3, seed=5)
    assert batch.size == 12 and batch.group_ids.tolist() == [g for g in range(4) for _ in range(3)]
    ref = brute_force_logp(model, batch.input_ids, batch.attention_mask, batch.prompt_len, temperature, top_p)
    m = batch.response_mask.bool()
    assert torch.allclose(batch.behav_logp[m], ref[m], atol=1e-4), (batch.behav_logp[m] - ref[m]).abs().max()
    assert (batch.behav_logp[~m] == 0).all() and torch.isfinite(batch.behav_logp).all()
    # the response mask ends at the first EOS (inclusive)
    for r, mk in zip(batch.response_ids, batch.response_mask):
        n = int(mk.sum())
        assert (r[:n - 1] != tok.eos_token_id).all()
        assert n == r.numel() or r[n - 1] == tok.eos_token_id
    # and the trainer's recompute (temperature-scaled, no top-p) agrees when top_p = 1
    if top_p == 1.0:
        lp = response_logprobs(model, batch.input_ids, batch.attention_mask, batch.prompt_len,
                               temperature=temperature, response_mask=batch.response_mask)
        assert torch.allclose(lp[m], batch.behav_logp[m], atol=1e-4)


def test_engine_is_a_separate_copy_in_its_dtype_and_sync_sets_version(tiny):
    model, tok = tiny
    eng = rollout_engine(model, tok, dtype="bfloat16", max_new_tokens=2)
    assert next(eng.model.parameters()).dtype == torch.bfloat16
    assert next(model.parameters()).dtype == torch.float32
    sd = {k: v + 1.0 for k, v in model.state_dict().items()}
    eng.sync(sd, 7)
    assert eng.version == 7
    k = next(iter(sd))
    assert torch.equal(eng.model.state_dict()[k], sd[k].to(torch.bfloat16))
    assert not torch.equal(model.state_dict()[k], sd[k])
    b = eng.generate(PROMPTS[:2], ["3", "15"], group_size=2, seed=0)
    assert b.version == 7
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype("float8")
    from offpolicy_moe.config import load_config
    from offpolicy_moe.config.validate import ConfigError, validate

    with pytest.raises(ConfigError, match="rollout.top_p"):
        validate(load_config(overrides=["rollout.top_p=0.0"]))


def test_same_seed_same_batch(tiny):
    model, tok = tiny
    eng = rollout_engine(model, tok, dtype="float32", max_new_tokens=3)
    a = eng.generate(PROMPTS, ["3", "15", "6", "9"], group_size=2, seed=11)
    b = eng.generate(PROMPTS, ["3", "15", "6", "9"], group_size=2, seed=11)
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.behav_logp, b.behav_logp)


def test_response_logprobs_matches_full_log_softmax(tiny):
    model, tok = tiny
    torch.manual_seed(0)
    seq = torch.randint(3, len(tok), (3, 7))
    am = torch.ones_like(seq)
    am[0, :2] = 0
    lp = response_logprobs(model, seq, am, 4)
    ref = brute_force_logp(model, seq, am, 4)
    assert lp.shape == (3, 3) and torch.allclose(lp, ref, atol=1e-5)
    with pytest.raises(ValueError, match="prompt_len"):
        response_logprobs(model, seq, am, 7)
    with pytest.raises(ValueError, match="attention_mask"):
        response_logprobs(model, seq, am[:, :3], 4)


def test_jsonl_logger_writes_floats_and_truncates(tmp_path):
    lg = JsonlLogger(tmp_path)
    lg.log(0, {"eval/accuracy": torch.tensor(0.5)})
    off = lg.offset()
    lg.log(1, {"reward/mean": 1, "actor/loss": float("nan"), "note": "text"})
    lg.close()
    rows = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    assert rows == [{"step": 0, "eval/accuracy": 0.5}, {"step": 1, "reward/mean": 1.0, "actor/loss": None}]
    JsonlLogger.truncate(tmp_path / "metrics.jsonl", off)
    assert [json.loads(x)["step"] for x in open(tmp_path / "metrics.jsonl")] == [0]
    assert clean_metrics({"a": float("inf"), "b": True}) == {"a": None, "b": 1.0}


def test_wandb_logger_is_lazy_and_offline_capable(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    lg = WandbLogger(tmp_path, {"seed": 0}, project="test")
    lg.log(1, {"reward/mean": 0.5})
    lg.close()
    import offpolicy_moe.trainer.trainer  # noqa: F401  importing the trainer must not import wandb by itself
    import subprocess
    import sys

    code = "import sys, offpolicy_moe.trainer.trainer, offpolicy_moe.cli; print('wandb' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "False"
