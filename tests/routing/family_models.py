"""Tiny random models of every scanned MoE family, built from each family's own config class (no download)."""
from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

VOCAB = 64
_SIZES = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
              intermediate_size=32, moe_intermediate_size=16, shared_expert_intermediate_size=16,
              max_position_embeddings=128, num_hidden_layers=2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
              tie_word_embeddings=False)
_EXPERTS = dict(num_experts=8, n_routed_experts=8, num_local_experts=8, moe_num_experts=8, num_experts_per_tok=2,
                top_k=2, moe_topk=2, moe_k=2, n_group=2, num_expert_group=2, topk_group=1, first_k_dense_replace=1)
_LORA = dict(q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
             qk_head_dim=16)


def tiny_config(model_type: str):
    """The family's default config shrunk: only attributes the config already has are overridden."""
    cfg = AutoConfig.for_model(model_type)
    cfg = getattr(cfg, "text_config", None) if model_type.endswith("_text") is False and \
        getattr(cfg, "text_config", None) is not None else cfg
    for table in (_SIZES, _EXPERTS, _LORA):
        for k, v in table.items():
            if hasattr(cfg, k) and getattr(cfg, k) is not None:
                setattr(cfg, k, v)
    n = cfg.num_hidden_layers
    for k in ("layer_types", "layers_block_type", "hybrid_override_pattern", "mlp_layer_types"):
        v = getattr(cfg, k, None)
        if isinstance(v, (list, tuple)) and len(v) != n:
            setattr(cfg, k, list(v[-n:]) if len(v) >= n else list(v) * n)
    return cfg


def make_family_model(model_type: str, seed: int = 0, dtype=torch.float32):
    """A tiny random model of ``model_type``; router weights get a spread so that selections differ."""
    cfg = tiny_config(model_type)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if any(t in n for t in ("gate.weight", "router.weight", "classifier.weight", "router.proj", "wg.")):
                p.normal_(0, 0.5)
            elif "bias" in n and ("gate" in n or "router" in n) or "e_score_correction" in n or "expert_bias" in n:
                p.normal_(0, 0.05)
    return model.to(dtype).eval()
