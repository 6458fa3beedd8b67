"""Tiny random-init MoE models of every supported family (no download)."""
from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

VOCAB = 64
COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
              max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2)

FAMILIES = {
    "qwen3_moe": dict(intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2, num_experts=8,
                      num_experts_per_tok=2, norm_topk_prob=True),
    "qwen2_moe": dict(intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2, num_experts=8,
                      num_experts_per_tok=2, shared_expert_intermediate_size=32, norm_topk_prob=False),
    "olmoe": dict(intermediate_size=32, num_hidden_layers=2, num_experts=8, num_experts_per_tok=2),
    "mixtral": dict(intermediate_size=32, num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=2),
    "deepseek_v3": dict(intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3, num_key_value_heads=4,
                        n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
                        q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                        n_shared_experts=1, norm_topk_prob=True, routed_scaling_factor=2.5),
    "gpt_oss": dict(intermediate_size=32, num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=2,
                    layer_types=["sliding_attention", "full_attention"], sliding_window=16),
}


def make_model(family: str, seed: int = 0, dtype=torch.float32, experts: str | None = None,
               router_std: float | None = 0.5, **overrides):
    """A tiny model of ``family`` with random weights (routers get non-trivial weights and, for DeepSeek-V3, a
    non-zero correction bias so that group selection matters)."""
    kw = dict(COMMON)
    kw.update(FAMILIES[family])
    kw.update(overrides)
    cfg = AutoConfig.for_model(family, **kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for n, m in model.named_modules():
            if (router_std is not None and n.endswith(("mlp.gate", "mlp.router")) and hasattr(m, "weight")
                    and m.weight.dim() == 2):
                m.weight.normal_(0, router_std)
                if getattr(m, "bias", None) is not None:
                    m.bias.normal_(0, 0.1)
                if hasattr(m, "e_score_correction_bias"):
                    m.e_score_correction_bias.normal_(0, 0.05)
            if family == "gpt_oss" and n.endswith("mlp.experts"):
                for p in m.parameters():
                    p.normal_(0, 0.05)
    if experts is not None:
        model.set_experts_implementation(experts)
    return model.to(dtype).eval()


def batch(b: int = 3, s: int = 10, seed: int = 0, left_pad: bool = True):
    """Random ids with left padding in rows > 0; returns (input_ids, attention_mask, position_ids)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (b, s), generator=g)
    mask = torch.ones(b, s, dtype=torch.long)
    for r in range(1, b):
        pad = min(r * 2, s - 2)
        if left_pad:
            mask[r, :pad] = 0
        else:
            mask[r, s - pad:] = 0
    ids = ids.masked_fill(mask == 0, 0)
    pos = (mask.cumsum(1) - 1).clamp_min(0)
    return ids, mask, pos


def markov_batch(b: int, s: int, gen: torch.Generator, table: torch.Tensor) -> torch.Tensor:
    """Sequences of an order-1 Markov language: each token has 4 allowed successors (``table[V, 4]``)."""
    x = torch.empty(b, s, dtype=torch.long)
    x[:, 0] = torch.randint(3, VOCAB, (b,), generator=gen)
    for t in range(1, s):
        choice = torch.randint(0, table.shape[1], (b,), generator=gen)
        x[:, t] = table[x[:, t - 1], choice]
    return x


_TRAINED = {}


def trained_qwen(steps: int = 60, seed: int = 0, num_experts: int = 8, lr: float = 3e-3):
    """Tiny Qwen3-MoE (hidden 64, 3 layers, 8 experts, top-2) briefly trained on a Markov language so that
    routers and experts matter (a scaled-down stand-in for a trained MoE checkpoint). Cached per process; returns a
    fresh copy."""
    key = (steps, seed, num_experts, lr)
    if key not in _TRAINED:
        model = make_model("qwen3_moe", seed=seed, router_std=None, num_experts=num_experts, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=16, intermediate_size=64, moe_intermediate_size=48, num_hidden_layers=3)
        g = torch.Generator().manual_seed(seed)
        table = torch.randint(3, VOCAB, (VOCAB, 4), generator=g)
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        model.train()
        for _ in range(steps):
            x = markov_batch(16, 24, g, table)
            loss = model(x, labels=x).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
        model.eval()
        _TRAINED[key] = ({k: v.clone() for k, v in model.state_dict().items()}, model.config, table)
    state, cfg, table = _TRAINED[key]
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_config(cfg)
    m.load_state_dict(state)
    return m.eval(), table
