"""The per-group learning-rate probe (experiments/bench/probe_lr_groups.py) and probe_longtail.py's refusals of its
new options: the groups it builds, the weights a zero rate holds in a real run, and one-line errors on bad input."""
from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

BENCH = Path(__file__).resolve().parents[1] / "experiments" / "bench"
sys.path.insert(0, str(BENCH))

import probe_longtail  # noqa: E402
import probe_lr_groups  # noqa: E402
from offpolicy_moe.models.presets import tiny_qwen3_moe_config  # noqa: E402
from offpolicy_moe.trainer import build  # noqa: E402


def _model():
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(tiny_qwen3_moe_config(12, special_ids={"pad_token_id": 0, "bos_token_id": 1,
                                                                         "eos_token_id": 2}))


def test_parse_rules_keeps_order_and_values():
    assert probe_lr_groups.parse_rules(["self_attn=0", "embed=0.1", "mlp.gate=2"]) == [
        ("self_attn", 0.0), ("embed", 0.1), ("mlp.gate", 2.0)]


@pytest.mark.parametrize("bad", ["self_attn", "=0", "self_attn=-1", "self_attn=nan", "self_attn=inf", "embed=x"])
def test_parse_rules_refuses_bad_items(bad):
    with pytest.raises(ValueError, match="SUBSTRING=M"):
        probe_lr_groups.parse_rules([bad])


def test_first_matching_rule_wins():
    rules = [("self_attn.q_proj", 0.5), ("self_attn", 0.0)]
    assert probe_lr_groups.multiplier("model.layers.0.self_attn.q_proj.weight", rules) == 0.5
    assert probe_lr_groups.multiplier("model.layers.0.self_attn.k_proj.weight", rules) == 0.0
    assert probe_lr_groups.multiplier("model.layers.0.mlp.gate.weight", rules) == 1.0


def test_groups_partition_the_trainable_weights_at_their_rates():
    model = _model()
    model.lm_head.weight.requires_grad_(False)
    groups = probe_lr_groups.grouped_param_groups(model, 1e-4, [("self_attn", 0.0), ("embed", 0.5)])
    assert [g["lr"] for g in groups] == [0.0, 5e-5, 1e-4]
    names = {id(p): n for n, p in model.named_parameters()}
    got = [{names[id(p)] for p in g["params"]} for g in groups]
    assert got[0] and all("self_attn" in n for n in got[0])
    assert got[1] == {"model.embed_tokens.weight"}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert set().union(*got) == trainable and sum(len(s) for s in got) == len(trainable)
    assert "lm_head.weight" not in trainable


def test_a_substring_in_no_weight_is_refused():
    with pytest.raises(ValueError, match="'self_atn' is in no trainable weight"):
        probe_lr_groups.grouped_param_groups(_model(), 1e-4, [("self_atn", 0.0)])


def test_zero_rate_holds_weights_through_real_adamw_steps():
    """The stand-in builder's optimizer and schedule: after two AdamW steps on a real loss the held weights are
    bit-identical and every other weight has moved."""
    model = _model()
    cfg = SimpleNamespace(optim=SimpleNamespace(lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0, scheduler="constant",
                                                warmup_steps=0),
                          trainer=SimpleNamespace(steps=2, updates_per_step=1))
    opt, sched = probe_lr_groups.grouped_optimizer([("self_attn", 0.0)])(model, None, cfg)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = torch.randint(3, 12, (4, 9), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        opt.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        sched.step()
    for n, p in model.named_parameters():
        if "self_attn" in n:
            assert torch.equal(p, before[n]), n
        elif "mlp.gate" not in n:      # a router may get no gradient when no token changes its choice
            assert not torch.equal(p, before[n]), n


def test_pr2_predictors_are_refused():
    cfg = SimpleNamespace(optim=SimpleNamespace(lr=1e-3))
    with pytest.raises(ValueError, match="PR2"):
        probe_lr_groups.grouped_optimizer([("self_attn", 0.0)])(_model(), object(), cfg)


def test_a_run_through_the_command_line_holds_the_attention(tmp_path, monkeypatch):
    """End to end: two RL steps of the default job through the project's command line; between the two checkpoints
    the attention weights are bit-identical and every other tensor has moved."""
    monkeypatch.setattr(build, "build_optimizer", build.build_optimizer)     # undo the probe's patch afterwards
    rc = probe_lr_groups.main(["--lr-mult", "self_attn=0", "--", "train", "--quiet", "--run-dir", str(tmp_path / "run"),
                               "seed=0", "trainer.steps=2", "trainer.sft_warmup_steps=30", "trainer.eval_every=0",
                               "trainer.checkpoint_every=1", "trainer.export_final=false", "trainer.threads=1",
                               "logging.loggers=[jsonl]", "logging.progress=false"])
    assert rc == 0
    a = load_file(str(tmp_path / "run" / "checkpoints" / "step_1" / "model.safetensors"))
    b = load_file(str(tmp_path / "run" / "checkpoints" / "step_2" / "model.safetensors"))
    attn = [k for k in a if "self_attn" in k]
    assert attn and all(torch.equal(a[k], b[k]) for k in attn)
    assert all(not torch.equal(a[k], b[k]) for k in a if "self_attn" not in k)


def test_a_substring_in_no_weight_ends_the_run_with_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(build, "build_optimizer", build.build_optimizer)     # undo the probe's patch afterwards
    rc = probe_lr_groups.main(["--lr-mult", "self_atn=0", "--", "train", "--quiet", "--run-dir", str(tmp_path / "run"),
                               "trainer.steps=1", "trainer.sft_warmup_steps=0", "trainer.threads=1",
                               "logging.loggers=[jsonl]", "logging.progress=false"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert err[-1].endswith("--lr-mult 'self_atn' is in no trainable weight's name") and "Traceback" not in "".join(err)


@pytest.mark.parametrize("argv, message", [
    (["--", "train"], "at least one --lr-mult"),
    (["--lr-mult", "self_attn=0"], "command line after --"),
    (["--lr-mult", "self_attn=-2", "--", "train"], "SUBSTRING=M"),
])
def test_driver_refuses_in_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        probe_lr_groups.main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--task-set", "length_tail=1"], "--task-set takes task.KEY=VALUE"),
    (["--task-set", "task.length_tail"], "--task-set takes task.KEY=VALUE"),
    (["--lr-mult", "self_attn"], "SUBSTRING=M"),
    (["--task-set", "task.length_tail=-1"], "task.length_tail: must be >= 0"),
    (["--task-set", "task.tail=1"], "Key 'tail' not in 'TaskConfig'"),
    (["--set", "rollout.group_size=0"], "rollout.group_size"),
    (["--model", "model.hidden_size=x"], "model.hidden_size"),
])
def test_probe_longtail_refuses_bad_options_before_any_work(argv, message, tmp_path, capsys):
    work = tmp_path / "work"
    with pytest.raises(SystemExit) as e:
        probe_longtail.main(["--work", str(work), *argv])
    assert e.value.code == 2
    assert message in capsys.readouterr().err
    assert not work.exists()
