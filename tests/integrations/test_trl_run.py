"""Real TRL runs with the plug-in on a tiny MoE (CPU): R3 lowers the train/inference mismatch, a short run completes
with the library's metrics, the behaviour log-probs are the sampling distribution's, bad input fails in one line."""
from __future__ import annotations

import copy
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from offpolicy_moe.integrations.trl import (GenerationRecord, OffPolicyGRPOTrainer, behaviour_logprobs,
                                            check_trl_version)
from offpolicy_moe.models.presets import build_preset
from offpolicy_moe.routing import RouteTrace, TraceValidationError
from offpolicy_moe.tasks.tokenizer import build_char_tokenizer
from trl_fixtures import config, expressive_moe, family_moe, tiny_moe, trainer


def _logged(tr) -> dict:
    merged: dict = {}
    for row in tr.state.log_history:
        for k, v in row.items():
            merged.setdefault(k, []).append(v)
    return merged


def test_r3_lowers_the_mismatch_under_trl(tmp_path):
    """Generation on a perturbed router (a fixed router-weight error, as another inference kernel gives): the
    trainer's log-probs with the generation's routes replayed are closer to the generation-time ones (k3 KL) than
    without, on the same samples; the old-log-prob pass the loss uses is the replayed one."""
    tr = trainer(tmp_path, model=expressive_moe(build_char_tokenizer()), per_device_train_batch_size=8,
                 routing_replay="r3", router_perturb=2.0, correction_mode="truncate")
    tr.train()
    row = tr.state.log_history[0]
    print({k: v for k, v in row.items() if k.startswith("mismatch/k3")})
    assert row["mismatch/k3_kl_r3"] < 0.8 * row["mismatch/k3_kl_no_r3"], row
    assert row["mismatch/k3_kl"] == pytest.approx(row["mismatch/k3_kl_r3"], rel=1e-6)
    assert row["mismatch/extreme_frac_r3"] <= row["mismatch/extreme_frac_no_r3"]


def test_without_replay_the_loss_sees_the_unreplayed_mismatch(tmp_path):
    tr = trainer(tmp_path, model=expressive_moe(build_char_tokenizer()), per_device_train_batch_size=8,
                 routing_replay="none", router_perturb=2.0, correction_mode="mask", correction_high=5.0,
                 correction_low=0.5, correction_opsm_delta=1e-4)       # IcePop's bounds, with OPSM on top
    tr.train()
    row = tr.state.log_history[0]
    assert 0.0 <= row["mismatch/opsm_masked_frac"] <= 1.0 and 0.0 <= row["mismatch/masked_frac"] <= 1.0
    assert row["mismatch/k3_kl"] == pytest.approx(row["mismatch/k3_kl_no_r3"], rel=1e-6)
    assert row["mismatch/k3_kl_r3"] < row["mismatch/k3_kl_no_r3"]


def test_short_run_completes_with_library_metrics(tmp_path):
    """Two optimizer steps of M2PO + TIS + R3 with two micro-batches each and two passes over each generation."""
    tr = trainer(tmp_path, max_steps=2, gradient_accumulation_steps=2, num_iterations=2, policy_loss="m2po",
                 policy_loss_options={"tau": 0.04}, correction_mode="truncate", routing_replay="r3")
    before = {n: p.detach().clone() for n, p in tr.model.named_parameters()}
    tr.train()
    logged = _logged(tr)
    for key in ("m2po/masked_frac", "m2po/m2_before", "actor/ppo_kl", "actor/loss", "mismatch/is_mean",
                "mismatch/ess", "mismatch/k3_kl", "mismatch/k3_kl_r3", "mismatch/k3_kl_no_r3", "entropy"):
        assert key in logged, key
        assert all(math.isfinite(v) for v in logged[key]), key
    assert tr.state.global_step == 2
    assert any(not torch.equal(before[n], p) for n, p in tr.model.named_parameters())
    # no router perturbation, float32: generate's log-probs are the trainer's up to float error
    assert logged["mismatch/abs_log_ratio_mean"][0] < 1e-4
    # evaluation goes through the same generation and loss (one micro-batch, local counts)
    ev = tr.evaluate(eval_dataset=tr.train_dataset.select(range(4)))
    for key in ("eval_m2po/masked_frac", "eval_mismatch/k3_kl_r3", "eval_actor/loss"):
        assert math.isfinite(ev[key]), key


def test_run_with_activation_checkpointing_and_reference_model(tmp_path):
    """TRL's default activation checkpointing recomputes the replayed forward with the same routes (otherwise
    backward raises); ``beta > 0`` adds the k3 KL to a reference model whose forward replays too."""
    tok = build_char_tokenizer()
    tiny_moe(tok).save_pretrained(tmp_path / "tiny")       # TRL loads the reference model from the policy's path
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "tiny")
    tr = trainer(tmp_path, model=model, routing_replay="r3", router_perturb=1.0, beta=0.1,
                 gradient_checkpointing=True, save_strategy="steps", save_steps=1)
    assert tr.args.activation_checkpointing
    tr.train()
    assert tr.model.is_activation_checkpointing
    assert math.isfinite(tr.state.log_history[0]["actor/kl_ref"])
    # the args that carry the replaying context_fn still serialise: JSON, deep copy, the checkpoint's pickle
    assert "offpolicy_moe.ReplayCheckpointContext" in tr.args.to_json_string()
    ctx = tr.args.activation_checkpointing_kwargs["context_fn"]
    assert copy.deepcopy(ctx).controller is tr.controller
    saved = torch.load(tmp_path / "out" / "checkpoint-1" / "training_args.bin", weights_only=False)
    with pytest.raises(RuntimeError, match="unpickled: build OffPolicyGRPOTrainer again"):
        saved.activation_checkpointing_kwargs["context_fn"]()


def test_behaviour_logprobs_are_the_processed_distribution():
    g = torch.Generator().manual_seed(0)
    scores = tuple(torch.randn(3, 11, generator=g) for _ in range(4))
    tokens = torch.randint(0, 11, (3, 4), generator=g)
    lp = behaviour_logprobs(scores, tokens)
    want = torch.stack([torch.log_softmax(s, -1)[torch.arange(3), tokens[:, t]] for t, s in enumerate(scores)], 1)
    torch.testing.assert_close(lp, want)
    with pytest.raises(ValueError, match="3 score steps for 4 generated tokens"):
        behaviour_logprobs(scores[:3], tokens)


def test_trace_layout_is_checked():
    seq = torch.arange(2 * 7).view(2, 7)
    trace = RouteTrace.from_ids(torch.zeros(2, 7, 1, 2, dtype=torch.long) + torch.tensor([0, 1]), 4)
    rec = GenerationRecord(seq, 3, torch.zeros(2, 4), trace)
    out = rec.trace_for(seq[:, :6], torch.ones(2, 6, dtype=torch.long), 3)
    assert tuple(out.ids.shape[:2]) == (2, 6)
    with pytest.raises(TraceValidationError, match="not laid out like the generate call"):
        rec.trace_for(seq[:, :6], torch.ones(2, 6, dtype=torch.long), 2)     # prompt width 4 != 3


@pytest.mark.parametrize("overrides,message", [
    ({"policy_loss": "m2p0"}, "unknown policy loss 'm2p0' (did you mean 'm2po'?)"),
    ({"policy_loss": "m2po", "policy_loss_options": {"tua": 0.1}}, "loss 'm2po' has no option 'tua'"),
    ({"policy_loss": "m2po", "policy_loss_options": {"tau": -1.0}}, "tau"),
    ({"loss_agg": "token-sum"}, "loss_agg must be one of"),
    ({"correction_mode": "clip"}, "correction_mode must be one of"),
    ({"correction_opsm_delta": 0.1}, "correction_opsm_delta needs a correction_mode"),
    ({"correction_mode": "mask", "correction_opsm_delta": -1.0}, "correction: opsm_delta"),
    ({"off_policy_mask_threshold": 0.1}, "set correction_opsm_delta (or correction_mode='opsm')"),
    ({"routing_replay": "r2"}, "routing_replay must be one of none, r3"),
    ({"loss_type": "cispo"}, "loss_type='cispo' is TRL's own loss setting"),
    ({"epsilon_high": 0.3}, "epsilon_high=0.3 is TRL's own loss setting"),
    ({"use_vllm": True, "routing_replay": "r3"}, "routing_replay='r3' records routes in TRL's model.generate"),
    ({"use_vllm": True}, "vllm_importance_sampling_correction=True is TRL's own correction"),
    ({"gradient_accumulation_steps": 2, "steps_per_generation": 3}, "steps_per_generation=3 must be a multiple"),
])
def test_bad_config_is_one_line_before_training(tmp_path, overrides, message):
    with pytest.raises(ValueError) as err:
        config(tmp_path, **overrides)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_bad_model_or_args_fail_at_construction(tmp_path):
    tok = build_char_tokenizer()
    ids = dict(pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    dense = build_preset("tiny-dense", len(tok), hidden_size=32, special_ids=ids, seed=0)
    with pytest.raises(ValueError, match="routing_replay='r3' needs an MoE model the routing layer supports: "
                                         ".*Qwen3ForCausalLM"):
        trainer(tmp_path, model=dense, routing_replay="r3")
    from trl import GRPOConfig
    with pytest.raises(TypeError, match="needs args=OffPolicyGRPOConfig"):
        OffPolicyGRPOTrainer(model=tiny_moe(tok), reward_funcs=lambda completions, **k: [0.0] * len(completions),
                             args=GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none"),
                             processing_class=tok)


def test_trl_version_range():
    check_trl_version("1.16.0")
    with pytest.raises(ImportError, match="supports trl >= 1.16.0, < 2.0.0; trl 1.15.0 is installed"):
        check_trl_version("1.15.0")


@pytest.mark.parametrize("family", ["mixtral", "olmoe", "deepseek_v3", "gpt_oss"])
def test_r3_under_trl_on_other_moe_families(tmp_path, family):
    """Other MoE families the routing layer supports: TRL's generate records, the replay (tied to the tokens)
    accepts TRL's layout in every pass, and replaying the perturbed generation's routes does not raise the
    mismatch."""
    tok = build_char_tokenizer()
    tr = trainer(tmp_path, model=family_moe(family, tok), routing_replay="r3", router_perturb=2.0,
                 policy_loss="m2po", gradient_accumulation_steps=2, gradient_checkpointing=True)
    tr.train()
    row = tr.state.log_history[0]
    assert math.isfinite(row["actor/loss"]) and math.isfinite(row["grad_norm"])
    assert row["mismatch/k3_kl_r3"] <= row["mismatch/k3_kl_no_r3"], row
