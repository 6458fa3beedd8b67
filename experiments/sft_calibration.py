"""Calibrate the embedded default: task difficulty × tiny-model size × SFT steps → accuracy after SFT.

For each setting it builds the task and the preset, runs the SFT warm start, and measures greedy
eval accuracy (``evaluate_greedy``), SFT wall time, sampled-generation throughput for one RL step
(prompts × group sampled responses, KV cache, fp32 and bf16 engine copies) and the time of one
fwd+bwd over that rollout batch.  Prints one JSON line per setting.

    python experiments/sft_calibration.py --threads 2 --digits 1 2 --terms 2 --steps 30 60 \
        --hidden 64 --layers 2 --experts 8

Accuracy is read at several SFT step counts in one run (``--steps`` is a list of checkpoints).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from offpolicy_moe.config.schema import ModelConfig, TaskConfig  # noqa: E402
from offpolicy_moe.engine.sft import answer_nll, build_sft_batch, sft_warm_start  # noqa: E402
from offpolicy_moe.models import load_policy  # noqa: E402
from offpolicy_moe.tasks import encode_prompts, encode_texts, evaluate_greedy, make_task  # noqa: E402


def rollout_timing(model, tok, task, prompts_per_step: int, group: int, max_new_tokens: int, dtype) -> dict:
    """Time one sampled rollout batch (prompts × group) and one fwd+bwd over it."""
    rows = task.sample_prompts(0, prompts_per_step)
    prompts = [r["prompt"] for r in rows for _ in range(group)]
    engine = copy.deepcopy(model).to(dtype).eval()
    ids, mask = encode_prompts(tok, prompts)
    torch.manual_seed(0)
    with torch.no_grad():
        t0 = time.perf_counter()
        out = engine.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_p=1.0,
                              top_k=None, max_new_tokens=max_new_tokens, eos_token_id=tok.eos_token_id,
                              pad_token_id=tok.pad_token_id)
        gen_s = time.perf_counter() - t0
    new = out[:, ids.shape[1]:]
    n_new = int((new != tok.pad_token_id).sum())
    full_mask = torch.cat([mask, (new != tok.pad_token_id).long()], dim=1)
    model.train()
    t0 = time.perf_counter()
    logits = model(input_ids=out, attention_mask=full_mask, use_cache=False).logits
    logits.float().log_softmax(-1).mean().backward()
    upd_s = time.perf_counter() - t0
    model.zero_grad(set_to_none=True)
    model.eval()
    return {"gen_s": gen_s, "gen_new_tokens": n_new, "gen_tok_per_s": n_new / gen_s, "fwd_bwd_s": upd_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--min-digits", type=int, nargs="+", default=[1])
    ap.add_argument("--digits", type=int, nargs="+", default=[1], help="max_digits values")
    ap.add_argument("--terms", type=int, nargs="+", default=[2])
    ap.add_argument("--operators", nargs="+", default=["+"])
    ap.add_argument("--hidden", type=int, nargs="+", default=[64])
    ap.add_argument("--layers", type=int, nargs="+", default=[2])
    ap.add_argument("--experts", type=int, nargs="+", default=[8])
    ap.add_argument("--steps", type=int, nargs="+", default=[30, 45, 60])
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--eval-size", type=int, default=256)
    ap.add_argument("--timing", action="store_true", help="also time one rollout batch (16×8) and fwd+bwd")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(json.dumps({"load": os.getloadavg(), "threads": args.threads}), flush=True)
    for mind in args.min_digits:
        for d in args.digits:
            if d < mind:
                continue
            for terms in args.terms:
                for ops in args.operators:
                    task_cfg = TaskConfig(min_digits=mind, max_digits=d, num_terms=terms, operators=ops,
                                          eval_size=args.eval_size)
                    task = make_task(task_cfg)
                    max_new = task.max_answer_chars + 1
                    for h in args.hidden:
                        for L in args.layers:
                            for E in args.experts:
                                for seed in args.seeds:
                                    model, tok = load_policy(ModelConfig(num_layers=L, hidden_size=h, num_experts=E),
                                                             seed=seed)
                                    done, sft_s = 0, 0.0
                                    for target in sorted(args.steps):
                                        m = sft_warm_start(model, tok, task, steps=target - done, lr=args.lr,
                                                           batch_size=args.batch, seed=seed * 1000 + done)
                                        sft_s += m["sft/time_s"]
                                        done = target
                                        t0 = time.perf_counter()
                                        acc = evaluate_greedy(model, tok, task.eval_dataset, max_new_tokens=max_new)
                                        rec = {"digits": f"{mind}..{d}", "terms": terms, "ops": ops, "hidden": h,
                                               "layers": L, "experts": E, "seed": seed, "sft_steps": done,
                                               "sft_s": round(sft_s, 2), "loss": round(m["sft/loss"], 4),
                                               "eval_s": round(time.perf_counter() - t0, 2),
                                               "params": sum(p.numel() for p in model.parameters()),
                                               **{k: round(v, 3) for k, v in acc.items()}}
                                        print(json.dumps(rec), flush=True)
                                    if args.timing:
                                        for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
                                            t = rollout_timing(model, tok, task, 16, 8, max_new, dt)
                                            print(json.dumps({"engine": name, "max_new_tokens": max_new,
                                                              **{k: round(v, 3) for k, v in t.items()}}), flush=True)


if __name__ == "__main__":
    main()
