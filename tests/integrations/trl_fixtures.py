"""A tiny MoE, the character tokenizer and a prompt dataset for real TRL runs on CPU (nothing downloaded)."""
from __future__ import annotations

import torch
from datasets import Dataset

from offpolicy_moe.integrations.trl import OffPolicyGRPOConfig, OffPolicyGRPOTrainer
from offpolicy_moe.models.presets import build_preset
from offpolicy_moe.tasks.tokenizer import build_char_tokenizer

PROMPTS = ["1+2=", "3+4=", "5+5=", "2*3=", "9-4=", "7+1=", "8*2=", "6-6="]


def length_reward(completions, **kwargs):
    """Reward = completion length: rewards differ inside every group, so advantages are non-zero."""
    return [float(len(c)) for c in completions]


def tiny_moe(tok, seed: int = 0, **kw):
    ids = dict(pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    model = build_preset("tiny-qwen3-moe", len(tok), hidden_size=32, special_ids=ids, seed=seed, **kw)
    with torch.no_grad():       # routers with a spread, so that routing decisions are not ties
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(seed + 1))
    return model


def expressive_moe(tok, seed: int = 0):
    """:func:`tiny_moe` with larger expert and output weights, so that which experts run changes the next-token
    distribution visibly (a random init at std 0.02 gives almost uniform logits whatever the routes)."""
    model = tiny_moe(tok, seed)
    g = torch.Generator().manual_seed(seed + 5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name == "lm_head.weight" or "mlp.experts" in name:
                p.normal_(0, 0.5, generator=g)
    return model


def config(tmp_path, **overrides) -> OffPolicyGRPOConfig:
    kw = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=4,
              max_completion_length=6, max_steps=1, logging_steps=1, report_to="none", use_cpu=True,
              save_strategy="no", bf16=False, seed=0, learning_rate=1e-2, disable_tqdm=True)
    kw.update(overrides)
    return OffPolicyGRPOConfig(**kw)


def trainer(tmp_path, model=None, **overrides) -> OffPolicyGRPOTrainer:
    tok = build_char_tokenizer()
    model = tiny_moe(tok) if model is None else model
    ds = Dataset.from_dict({"prompt": PROMPTS})
    return OffPolicyGRPOTrainer(model=model, reward_funcs=length_reward, args=config(tmp_path, **overrides),
                                train_dataset=ds, processing_class=tok)


FAMILY_SHAPES = {      # tiny shapes of a few other MoE families of transformers (vocab from the tokenizer)
    "mixtral": dict(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2),
    "olmoe": dict(intermediate_size=32, num_experts=4, num_experts_per_tok=2),
    "deepseek_v3": dict(intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2, num_key_value_heads=4,
                        n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
                        q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                        n_shared_experts=1),
    "gpt_oss": dict(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                    layer_types=["sliding_attention", "full_attention"], sliding_window=16),
}


def family_moe(family: str, tok, seed: int = 0):
    """A tiny random model of ``family`` built from config, with routers spread as in :func:`tiny_moe`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = dict(vocab_size=len(tok), hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
              num_hidden_layers=2, max_position_embeddings=64, pad_token_id=tok.pad_token_id,
              bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    kw.update(FAMILY_SHAPES[family])
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **kw))
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("mlp.gate.weight", "mlp.router.weight")) and p.dim() == 2:
                p.normal_(0, 0.5, generator=g)
    return model
