"""Benchmark of offpolicy_moe.routing overheads on small MoE models (random init, built from config).

Families (``--family``): ``qwen3_moe`` (softmax, hand adapter), ``glm4_moe`` (GLM-4.5 style: sigmoid scores plus a
selection bias, generic rule = the router's own forward with its top-k intercepted), ``granitemoe`` (softmax,
generic rule). The 1-minute load average (``os.getloadavg``) is printed with each figure.

Measures, interleaving the variants round by round and reporting medians:
  * train forward+backward with R3 replay vs without (ratio; target <= 1.03);
  * generate with route recording vs without (ratio; target <= 1.03); PR2 offsets + feature cache for reference;
  * bytes per token of a stored RouteTrace vs int32 storage (target L_moe * K bytes when experts <= 255).

Usage: python experiments/bench/bench_routing.py [--threads 2] [--rounds 7] [--device cpu] [--json out.json]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from offpolicy_moe.routing import FeatureCache, PR2Predictors, RoutingController


def build(device: str, layers: int, hidden: int, experts: int, top_k: int, vocab: int, family: str = "qwen3_moe"):
    """A random-init model of ``family``; only the shape keys its config class has are set."""
    shape = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, moe_intermediate_size=hidden,
                 num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
                 num_experts=experts, num_local_experts=experts, n_routed_experts=experts, num_experts_per_tok=top_k,
                 norm_topk_prob=True, n_group=1, topk_group=1, first_k_dense_replace=0, n_shared_experts=1,
                 max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    base = AutoConfig.for_model(family)
    cfg = AutoConfig.for_model(family, **{k: v for k, v in shape.items() if hasattr(base, k)})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).to(device)
    with torch.no_grad():  # a non-zero selection bias, as a trained GLM-4.5 router has
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.normal_(0, 0.05)
    return model


def sync(device: str):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, device: str, clock: str) -> float:
    """Seconds of ``fn``: wall clock, or process CPU time (all threads; robust on a shared, overloaded CPU)."""
    now = time.perf_counter if clock == "wall" else time.process_time
    sync(device)
    t = now()
    fn()
    sync(device)
    return now() - t


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="model dtype (bfloat16 on a GPU for realistic ratios)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="wall clock, or process CPU time (use on a shared CPU; meaningless for GPU work)")
    ap.add_argument("--family", default="qwen3_moe", help="qwen3_moe | glm4_moe | granitemoe (any MoE model_type)")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dev = args.device
    model = build(dev, args.layers, args.hidden, args.experts, args.top_k, 1024, args.family).to(
        getattr(torch, args.dtype))
    ctl = RoutingController(model)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(3, 1024, (args.batch, args.seq), generator=g).to(dev)
    prompts = torch.randint(3, 1024, (args.batch, args.prompt), generator=g).to(dev)
    with torch.no_grad(), ctl.record() as rec:
        model(x)
    trace = rec.trace()

    def train_step(replay: bool):
        model.zero_grad(set_to_none=True)
        with (ctl.replay(trace) if replay else torch.enable_grad()):
            loss = model(x, labels=x).loss
        loss.backward()

    def gen(mode: str):
        kw = dict(attention_mask=torch.ones_like(prompts), max_new_tokens=args.new_tokens,
                  min_new_tokens=args.new_tokens, do_sample=True, top_k=0, pad_token_id=0)
        with torch.no_grad():
            if mode == "plain":
                model.generate(prompts, **kw)
            elif mode == "record":
                with ctl.record() as r:
                    out = model.generate(prompts, **kw)
                r.trace()
            else:
                preds = PR2Predictors.from_controller(ctl, device=dev)
                with ctl.offsets(preds, feature_cache=FeatureCache(1 / 8)) as _, ctl.record() as r:
                    model.generate(prompts, **kw)
                r.trace()

    model.train()
    train_step(False), train_step(True)  # warm-up
    tr = {"plain": [], "replay": []}
    load = [os.getloadavg()[0]]
    for _ in range(args.rounds):
        for mode in ("plain", "replay") if _ % 2 == 0 else ("replay", "plain"):
            tr[mode].append(timed(lambda: train_step(mode == "replay"), dev, args.clock))
    model.eval()
    gen("plain"), gen("record")
    ge = {"plain": [], "record": [], "pr2": []}
    order = ["plain", "record", "pr2"]
    for r in range(args.rounds):
        for mode in order[r % 3:] + order[:r % 3]:
            ge[mode].append(timed(lambda: gen(mode), dev, args.clock))
    load.append(os.getloadavg()[0])
    med = {k: statistics.median(v) for k, v in tr.items()}
    gmed = {k: statistics.median(v) for k, v in ge.items()}
    ntok_train = args.batch * args.seq
    ntok_gen = args.batch * args.new_tokens
    bytes_tok = trace.nbytes() / (trace.batch_size * trace.seq_len)
    int32_tok = 4 * ctl.num_moe_layers * ctl.top_k
    res = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": f"{platform.machine()} {platform.processor() or ''} {dev} threads={args.threads} clock={args.clock}",
        "torch": torch.__version__, "args": vars(args),
        "train_fwd_bwd_s": med, "train_ratio_replay": med["replay"] / med["plain"],
        "train_tok_per_s": {k: ntok_train / v for k, v in med.items()},
        "generate_s": gmed, "generate_ratio_record": gmed["record"] / gmed["plain"],
        "generate_ratio_pr2": gmed["pr2"] / gmed["plain"],
        "generate_tok_per_s": {k: ntok_gen / v for k, v in gmed.items()},
        "trace_bytes_per_token": bytes_tok, "int32_bytes_per_token": int32_tok,
        "target_bytes_per_token": ctl.num_moe_layers * ctl.top_k,
        "family": args.family, "rule": ",".join(ctl.families), "loadavg_1min": load,
    }
    print(f"bench_routing  {res['date']}  {res['machine']}  torch {res['torch']}  rounds={args.rounds}")
    print(f"load average (1 min) before / after the timed runs / at print: {load[0]:.2f} / {load[1]:.2f} / "
          f"{os.getloadavg()[0]:.2f}")
    print(f"model: {args.family} (rule: {res['rule']}) L={args.layers} hidden={args.hidden} E={args.experts} K={args.top_k}; "
          f"train {args.batch}x{args.seq}; generate {args.batch}x({args.prompt}+{args.new_tokens})")
    print("| measurement | baseline | with routing | ratio | target |")
    print("| --- | --- | --- | --- | --- |")
    print(f"| train fwd+bwd (median s) | {med['plain']:.4f} | {med['replay']:.4f} (R3 replay) | "
          f"{res['train_ratio_replay']:.3f} | <= 1.03 |")
    print(f"| generate (median s) | {gmed['plain']:.3f} | {gmed['record']:.3f} (record) | "
          f"{res['generate_ratio_record']:.3f} | <= 1.03 |")
    print(f"| generate (median s) | {gmed['plain']:.3f} | {gmed['pr2']:.3f} (PR2 offsets + features + record) | "
          f"{res['generate_ratio_pr2']:.3f} | - |")
    print(f"| trace bytes / token | {int32_tok} (int32) | {bytes_tok:.0f} ({trace.ids.dtype}) | "
          f"{bytes_tok / int32_tok:.2f} | {ctl.num_moe_layers * ctl.top_k} (L_moe*K) |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
