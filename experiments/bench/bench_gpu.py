"""Training and generation throughput of a Qwen3-MoE-style model built from config (random init, nothing
downloaded): training tokens/s and model FLOPs utilisation (MFU), generation tokens/s.  Meant for a GPU
(``--size 0.9b``: 16 layers, hidden 1024, 32 experts, top-4, ~0.9B parameters, ~0.2B active); ``--size tiny`` runs
anywhere (the CPU smoke test).  R3 record/replay overhead ratios at the same size come from
``experiments/bench/bench_routing.py --device cuda --dtype bfloat16 --layers 16 --hidden 1024 --experts 32 --top-k 4``.

Training step: bf16 autocast forward + backward of next-token cross-entropy on ``--batch x --seq`` random tokens,
fp32 master weights, fused AdamW.  FLOPs per token = 6 * N_active (non-embedding parameters a token touches: the
attention, the router and top-k of the experts, plus the LM head) + 6 * L * S * d_attn (causal attention scores and
values, forward + backward); MFU = FLOPs/s / ``--peak-tflops`` (default: 989 for H100/H200 bf16 dense, else none).
Generation: ``model.generate`` with a KV cache on a bf16 copy, ``--batch`` prompts of ``--prompt`` tokens, exactly
``--new-tokens`` sampled tokens each.

    python experiments/bench/bench_gpu.py --size 0.9b --device cuda --json gpu.json
    python experiments/bench/bench_gpu.py --size tiny --device cpu --steps 2
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

SIZES = {   # layers, hidden, heads, kv heads, head dim, experts, top-k, expert width, vocab
    "tiny": dict(layers=2, hidden=64, heads=4, kv=2, head_dim=16, experts=8, top_k=2, moe_inter=64, vocab=512),
    "0.9b": dict(layers=16, hidden=1024, heads=16, kv=4, head_dim=64, experts=32, top_k=4, moe_inter=512,
                 vocab=32768),
}
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}


def build(size: dict, seed: int = 0):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(
        "qwen3_moe", vocab_size=size["vocab"], hidden_size=size["hidden"], num_hidden_layers=size["layers"],
        num_attention_heads=size["heads"], num_key_value_heads=size["kv"], head_dim=size["head_dim"],
        intermediate_size=4 * size["hidden"], moe_intermediate_size=size["moe_inter"], num_experts=size["experts"],
        num_experts_per_tok=size["top_k"], norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        max_position_embeddings=4096, tie_word_embeddings=False, router_aux_loss_coef=0.0,
        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg)


def param_counts(model, size: dict) -> dict:
    """Total parameters and the non-embedding parameters one token touches (top-k of the experts)."""
    total = sum(p.numel() for p in model.parameters())
    embed = model.get_input_embeddings().weight.numel()
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    active = total - embed - experts + experts * size["top_k"] // size["experts"]
    return {"total": total, "active_non_embedding": active, "experts": experts, "embedding": embed}


def flops_per_token(counts: dict, size: dict, seq: int) -> float:
    """6 * N_active + 6 * L * S * d_attn (causal attention, forward + backward)."""
    return 6.0 * counts["active_non_embedding"] + 6.0 * size["layers"] * seq * size["heads"] * size["head_dim"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=sorted(SIZES), default="0.9b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--steps", type=int, default=10, help="timed training steps (3 warm-up steps before)")
    ap.add_argument("--experts-implementation", default="grouped_mm")
    ap.add_argument("--peak-tflops", type=float, default=None, help="device peak bf16 TFLOP/s for MFU")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    size = SIZES[args.size]
    model = build(size)
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation(args.experts_implementation)
    counts = param_counts(model, size)
    model.to(dev).train()

    def sync():
        if cuda:
            torch.cuda.synchronize()

    # ---- training
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=cuda or None)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, size["vocab"], (args.batch, args.seq), generator=g).to(dev)

    def train_step():
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cuda):
            out = model(input_ids=ids, labels=ids, use_cache=False)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        train_step()
    times = []
    for _ in range(args.steps):
        sync()
        t = time.perf_counter()
        train_step()
        sync()
        times.append(time.perf_counter() - t)
    step_s = statistics.median(times)
    train_tps = args.batch * args.seq / step_s
    fpt = flops_per_token(counts, size, args.seq)
    peak = args.peak_tflops
    name = torch.cuda.get_device_name(dev) if cuda else platform.processor() or platform.machine()
    if peak is None and cuda:
        peak = next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)
    mfu = train_tps * fpt / (peak * 1e12) if peak else None
    mem = torch.cuda.max_memory_allocated(dev) / 2**30 if cuda else None
    del opt
    # ---- generation (bf16 copy, KV cache, exactly new_tokens per row)
    model.zero_grad(set_to_none=True)
    gen_model = model.to(torch.bfloat16).eval() if cuda else model.eval()
    prompts = torch.randint(3, size["vocab"], (args.batch, args.prompt), generator=g).to(dev)

    def generate():
        with torch.no_grad():
            return gen_model.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts), do_sample=True,
                                      top_k=0, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                                      pad_token_id=0, eos_token_id=2)

    generate()
    gtimes = []
    for _ in range(3):
        sync()
        t = time.perf_counter()
        out = generate()
        sync()
        gtimes.append(time.perf_counter() - t)
    assert out.shape == (args.batch, args.prompt + args.new_tokens)
    gen_tps = args.batch * args.new_tokens / statistics.median(gtimes)

    res = {"size": args.size, "device": name, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
           "params_total": counts["total"], "params_active_non_embedding": counts["active_non_embedding"],
           "batch": args.batch, "seq": args.seq, "train_step_s": step_s, "train_tokens_per_s": train_tps,
           "flops_per_token": fpt, "peak_tflops": peak, "mfu": mfu, "max_memory_gib": mem,
           "generation_tokens_per_s": gen_tps, "prompt": args.prompt, "new_tokens": args.new_tokens}
    print(f"{args.size}: {counts['total'] / 1e6:.1f}M parameters ({counts['active_non_embedding'] / 1e6:.1f}M active "
          f"non-embedding) on {name}")
    print(f"training  {train_tps:,.0f} tokens/s ({step_s * 1e3:.1f} ms/step, {args.batch}x{args.seq})"
          + (f", MFU {100 * mfu:.1f}% of {peak:.0f} TFLOP/s" if mfu is not None else ", MFU: no peak given"))
    print(f"generation {gen_tps:,.0f} tokens/s ({args.batch} prompts x {args.prompt} + {args.new_tokens} new)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
