"""Tiny random models of every scanned MoE family, built from each family's own config class (no download)."""
from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

VOCAB = 64
_SIZES = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_key_value_heads=4, head_dim=8,
              intermediate_size=32, moe_intermediate_size=16, shared_expert_intermediate_size=16,
              max_position_embeddings=128, num_hidden_layers=2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
              tie_word_embeddings=False, unpadded_vocab_size=VOCAB)
_EXPERTS = dict(num_experts=8, n_routed_experts=8, num_local_experts=8, moe_num_experts=8, num_experts_per_tok=2,
                top_k=2, moe_topk=2, num_experts_per_token=2, n_shared_experts=1, num_shared_experts=1, n_group=2, num_expert_group=2, topk_group=1, first_k_dense_replace=1)
_LORA = dict(q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
             qk_head_dim=16)


#: Families whose defaults need more than shrinking (hybrid layer patterns, nested configs).
_SPECIAL = {
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=1, expert_layer_offset=0),
    "granitemoehybrid": dict(hidden_size=32, num_hidden_layers=2, layer_types=["mamba", "attention"], mamba_n_heads=4, mamba_d_head=16,
                             mamba_d_state=8, mamba_n_groups=1, mamba_expand=2),
    "flint": dict(mlp_only_layers=[0]),
    "lfm2_moe": dict(num_hidden_layers=2, num_dense_layers=1, layer_types=["conv", "full_attention"]),
    "doge": dict(is_moe=True, num_experts=16),   # product keys: sqrt(16) = 4 keys per half
    "mimo_v2_flash": dict(num_key_value_heads=2),   # its sliding layers double the KV heads: 2 x 2 <= 4 heads
    "qwen4_exp_text": dict(head_dim=8, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                           indexer_budget=16, indexer_compress_ratio=1, indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=8, linear_key_head_dim=8,
                           linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4),
    "qwen3_next": dict(linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
                       linear_num_value_heads=4),
    "gemma4_text": dict(allow_global_per_layer_attribute_access=True, enable_moe_block=True, num_experts=8,
                        top_k_experts=2, moe_intermediate_size=16),
    "dots3_note_text": dict(allow_global_per_layer_attribute_access=True),
    "dbrx": dict(d_model=32, n_heads=4, n_layers=2, max_seq_len=128,
                 attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
                 ffn_config=dict(ffn_hidden_size=32, moe_num_experts=8, moe_top_k=2, moe_normalize_expert_weights=1.0)),
}


def tiny_config(model_type: str):
    """The family's default config shrunk: only attributes the config already has are overridden."""
    cfg = AutoConfig.for_model(model_type, **_SPECIAL.get(model_type, {}))
    cfg = getattr(cfg, "text_config", None) if model_type.endswith("_text") is False and \
        getattr(cfg, "text_config", None) is not None else cfg
    for table in (_SIZES, _EXPERTS, _LORA):
        for k, v in table.items():
            if hasattr(cfg, k) and (getattr(cfg, k) is not None or table is _EXPERTS or k == "head_dim") \
                    and k not in _SPECIAL.get(model_type, {}):
                setattr(cfg, k, v)
    n = cfg.num_hidden_layers
    for k in ("layer_types", "layers_block_type", "hybrid_override_pattern", "mlp_layer_types"):
        v = getattr(cfg, k, None)
        if isinstance(v, (list, tuple)) and len(v) != n and k not in _SPECIAL.get(model_type, {}):
            kinds = list(dict.fromkeys(v))  # distinct kinds in order: keep one layer of each (dense first)
            setattr(cfg, k, (kinds + [kinds[-1]] * n)[:n])
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
