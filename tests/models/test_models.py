"""Tiny presets, offline loading from a local directory, compatibility errors."""
import os

import pytest
import torch

from offpolicy_moe.config.schema import ModelConfig
from offpolicy_moe.models import (CheckpointNotFoundError, build_preset, check_compatibility, is_moe, load_policy,
                                  moe_info)
from offpolicy_moe.models.experts import NAME as EXPERTS_AUTO
from offpolicy_moe.tasks import build_char_tokenizer

SMALL = dict(num_layers=2, hidden_size=32, num_experts=4, top_k=2)


def test_offline_env():
    assert os.environ.get("HF_HUB_OFFLINE") == "1"  # conftest: any download attempt would fail


def test_moe_preset_shapes():
    model, tok = load_policy(ModelConfig(**SMALL), seed=0)
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok) == (2, 32, 4, 2)
    assert cfg.norm_topk_prob is True and cfg.vocab_size == len(tok) == 20
    assert (cfg.pad_token_id, cfg.bos_token_id, cfg.eos_token_id) == (0, 1, 2)
    assert is_moe(model) and moe_info(model).num_moe_layers == 2
    assert model.config._experts_implementation == EXPERTS_AUTO        # model.experts_implementation=auto
    gate = model.model.layers[0].mlp.gate
    assert gate.weight.shape == (4, 32)
    logits, weights, idx = gate(torch.randn(5, 32))
    assert idx.shape == (5, 2) and torch.allclose(weights.sum(-1), torch.ones(5))  # norm_topk_prob
    out = model(torch.tensor([[1, 4, 13, 5, 16]]))
    assert out.logits.shape == (1, 5, 20)


@pytest.mark.parametrize("hidden, heads, kv", [(16, 1, 1), (32, 2, 1), (48, 3, 1), (64, 4, 2), (80, 5, 1),
                                               (96, 6, 3), (144, 9, 3), (128, 8, 4)])
def test_every_head_count_gets_kv_heads_that_divide_it(hidden, heads, kv):
    """An odd head count (hidden 80: 5 heads) got 5 // 2 = 2 KV heads, which attention refuses at the first
    forward; even counts keep heads / 2."""
    model, _ = load_policy(ModelConfig(**{**SMALL, "hidden_size": hidden}), seed=0)
    cfg = model.config
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (heads, kv)
    ids = torch.tensor([[1, 4, 13, 5, 16]])
    assert model(ids).logits.shape == (1, 5, 20)
    assert torch.isfinite(model(ids, attention_mask=torch.tensor([[0, 1, 1, 1, 1]])).logits).all()


def test_dense_preset_is_not_moe_and_refused_when_moe_required():
    model, tok = load_policy(ModelConfig(preset="tiny-dense", num_layers=1, hidden_size=32))
    assert type(model).__name__ == "Qwen3ForCausalLM" and not is_moe(model)
    with pytest.raises(ValueError, match="no Mixture-of-Experts layer"):
        check_compatibility(model, tok, require_moe=True)


def test_seeded_init_is_deterministic_and_leaves_global_rng_alone():
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    a = build_preset("tiny-qwen3-moe", 20, seed=5, hidden_size=32)
    assert torch.equal(torch.random.get_rng_state(), before)
    b = build_preset("tiny-qwen3-moe", 20, seed=5, hidden_size=32)
    c = build_preset("tiny-qwen3-moe", 20, seed=6, hidden_size=32)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)


def test_dtype_and_bad_preset():
    model, _ = load_policy(ModelConfig(dtype="bfloat16", **SMALL))
    assert next(model.parameters()).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype"):
        load_policy(ModelConfig(dtype="float8", **SMALL))
    with pytest.raises(ValueError, match="unknown model.preset"):
        load_policy(ModelConfig(preset="giant", **SMALL))
    with pytest.raises(ValueError, match="hidden_size"):
        load_policy(ModelConfig(hidden_size=40))
    with pytest.raises(ValueError, match="top_k"):
        load_policy(ModelConfig(num_experts=4, top_k=5))


def test_save_and_load_offline_gives_identical_logits(tmp_path):
    model, tok = load_policy(ModelConfig(experts_implementation="eager", **SMALL), seed=1)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    loaded, tok2 = load_policy(ModelConfig(path=str(tmp_path)), expected_num_experts=4, expected_top_k=2)
    assert type(loaded).__name__ == "Qwen3MoeForCausalLM"
    assert loaded.config._experts_implementation == EXPERTS_AUTO  # cfg default applied to the checkpoint
    assert len(tok2) == len(tok) and tok2.padding_side == "left"
    ids = torch.tensor([[1, 4, 13, 5, 16, 8], [1, 9, 15, 3, 16, 3]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)
    # the tokenizer can come from elsewhere
    loaded2, tok3 = load_policy(ModelConfig(path=str(tmp_path)), tokenizer=build_char_tokenizer())
    assert tok3("1+1=")["input_ids"] == tok("1+1=")["input_ids"]


def test_compatibility_errors(tmp_path):
    model, tok = load_policy(ModelConfig(**SMALL))
    info = check_compatibility(model, tok, num_experts=4, top_k=2)
    assert (info.num_experts, info.top_k) == (4, 2)
    with pytest.raises(ValueError, match=r"expected 8 experts .* has 4"):
        check_compatibility(model, tok, num_experts=8)
    with pytest.raises(ValueError, match="top_k=1"):
        check_compatibility(model, tok, top_k=1)
    # a tokenizer with more tokens than the embedding rows
    big = build_char_tokenizer()
    big.add_tokens(["a", "b"])
    with pytest.raises(ValueError, match="tokenizer has 22 tokens but the model embedding has 20 rows"):
        check_compatibility(model, big)
    # a checkpoint whose expert count differs from what the run expects
    model.save_pretrained(tmp_path / "ckpt")
    tok.save_pretrained(tmp_path / "ckpt")
    with pytest.raises(ValueError, match="expected 16 experts"):
        load_policy(ModelConfig(path=str(tmp_path / "ckpt")), expected_num_experts=16)
    # missing directories
    with pytest.raises(CheckpointNotFoundError, match="not an existing directory"):
        load_policy(ModelConfig(path=str(tmp_path / "nope")))
    with pytest.raises(ValueError, match="no config.json"):
        load_policy(ModelConfig(path=str(tmp_path)), tokenizer=tok)
    with pytest.raises(ValueError, match="model.preset='path' needs model.path"):
        load_policy(ModelConfig(preset="path"))


def test_task_alphabet_check():
    class Letters:
        alphabet = {"1", "x"}

    model, tok = load_policy(ModelConfig(**SMALL))
    with pytest.raises(ValueError, match="cannot encode"):
        check_compatibility(model, tok, task=Letters())


def test_loading_a_checkpoint_shows_transformers_bar_only_when_progress_is_on(tmp_path, capfd):
    """``--quiet`` and ``logging.progress=false`` runs printed transformers' "Loading weights" bar anyway."""
    from transformers.utils import logging as hf_logging

    model, tok = load_policy(ModelConfig(**SMALL), seed=1)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    capfd.readouterr()
    was_on = hf_logging.is_progress_bar_enabled()
    load_policy(ModelConfig(path=str(tmp_path)), progress=False)
    assert "Loading weights" not in capfd.readouterr().err
    assert hf_logging.is_progress_bar_enabled() == was_on          # the switch is restored after the load
    hf_logging.enable_progress_bar()
    try:
        load_policy(ModelConfig(path=str(tmp_path)), progress=True)
        assert "Loading weights" in capfd.readouterr().err
    finally:
        (hf_logging.enable_progress_bar if was_on else hf_logging.disable_progress_bar)()
