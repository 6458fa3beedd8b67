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
