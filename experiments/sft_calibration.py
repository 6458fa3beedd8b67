"""Calibrate the embedded default: task difficulty × tiny-model size × SFT steps → accuracy after SFT.

For each setting it builds the task and the preset, runs the SFT warm start, and measures greedy
eval accuracy (``evaluate_greedy``), SFT wall time, sampled-generation throughput for one RL step
(prompts × group sampled responses, KV cache, fp32 and bf16 engine copies) and the time of one
fwd+bwd over that rollout batch.  Prints one JSON line per setting.

    python experiments/sft_calibration.py --threads 2 --digits 1 2 --terms 2 --steps 30 60 \
        --hidden 64 --layers 2 --experts 8

Each SFT step count in ``--steps`` is a fresh model and one ``sft_warm_start`` call; RL (``--rl-steps``)
starts from the last one.
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
from offpolicy_moe.trainer.sft import sft_warm_start  # noqa: E402
from offpolicy_moe.models import load_policy  # noqa: E402
from offpolicy_moe.tasks import encode_prompts, evaluate_greedy, make_task  # noqa: E402


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


def quick_rl(model, tok, task, *, steps: int, lr: float, prompts: int, group: int, max_new_tokens: int,
             seed: int, eval_every: int, reward: str = "exact") -> list[dict]:
    """A bare on-policy GRPO loop (one update per batch, so the ratio is 1 and the clipped objective is
    the policy gradient with group-normalised advantages, arXiv:2402.03300) — only to check that the
    calibrated SFT regime leaves RL headroom.  The real trainer lives in ``offpolicy_moe.engine``."""
    from offpolicy_moe.tasks import compute_rewards, decode_completions

    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.99))
    gen = torch.Generator().manual_seed(seed)
    log = []
    t_start = time.perf_counter()
    for step in range(steps):
        rows = task.sample_prompts(step, prompts)
        ps = [r["prompt"] for r in rows for _ in range(group)]
        answers = [r["answer"] for r in rows for _ in range(group)]
        ids, mask = encode_prompts(tok, ps)
        model.eval()
        torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_p=1.0,
                                 top_k=None, max_new_tokens=max_new_tokens, eos_token_id=tok.eos_token_id,
                                 pad_token_id=tok.pad_token_id)
        new = out[:, ids.shape[1]:]
        r = torch.tensor(compute_rewards(decode_completions(tok, new), answers, reward))
        rg = r.view(prompts, group)
        adv = ((rg - rg.mean(1, keepdim=True)) / (rg.std(1, keepdim=True) + 1e-6)).view(-1)
        # response mask: tokens up to and including the first eos
        is_eos = (new == tok.eos_token_id).long()
        before_eos = (is_eos.cumsum(1) - is_eos) == 0
        resp_mask = before_eos.float()
        full_mask = torch.cat([mask, resp_mask.long()], 1)
        model.train()
        logits = model(input_ids=out, attention_mask=full_mask, use_cache=False).logits[:, ids.shape[1] - 1:-1]
        logp = torch.log_softmax(logits.float(), -1).gather(-1, new.unsqueeze(-1)).squeeze(-1)
        loss = -(adv[:, None] * logp * resp_mask).sum() / resp_mask.sum().clamp_min(1)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        rec = {"rl_step": step + 1, "reward": round(float(r.mean()), 3)}
        if (step + 1) % eval_every == 0 or step + 1 == steps:
            rec.update({k: round(v, 3) for k, v in evaluate_greedy(model, tok, task.eval_dataset,
                                                                   max_new_tokens=max_new_tokens).items()})
            rec["elapsed_s"] = round(time.perf_counter() - t_start, 1)
            print(json.dumps(rec), flush=True)
        log.append(rec)
    return log


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
    ap.add_argument("--schedule", default="cosine", choices=["cosine", "constant"])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--eval-size", type=int, default=256)
    ap.add_argument("--timing", action="store_true", help="also time one rollout batch (16×8) and fwd+bwd")
    ap.add_argument("--rl-steps", type=int, default=0, help="after SFT, run a bare on-policy GRPO loop this long")
    ap.add_argument("--rl-lr", type=float, default=1e-3)
    ap.add_argument("--rl-eval-every", type=int, default=25)
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
                                    for target in sorted(args.steps):
                                        # a fresh model and ONE sft call per step count: exactly what the trainer does
                                        model, tok = load_policy(ModelConfig(num_layers=L, hidden_size=h,
                                                                             num_experts=E), seed=seed)
                                        m = sft_warm_start(model, tok, task, steps=target, lr=args.lr,
                                                           batch_size=args.batch, seed=seed, schedule=args.schedule)
                                        t0 = time.perf_counter()
                                        acc = evaluate_greedy(model, tok, task.eval_dataset, max_new_tokens=max_new)
                                        rec = {"digits": f"{mind}..{d}", "terms": terms, "ops": ops, "hidden": h,
                                               "layers": L, "experts": E, "seed": seed, "sft_steps": target,
                                               "sft_s": round(m["sft/time_s"], 2), "loss": round(m["sft/loss"], 4),
                                               "eval_s": round(time.perf_counter() - t0, 2),
                                               "params": sum(p.numel() for p in model.parameters()),
                                               **{k: round(v, 3) for k, v in acc.items()}}
                                        print(json.dumps(rec), flush=True)
                                    if args.rl_steps:
                                        quick_rl(model, tok, task, steps=args.rl_steps, lr=args.rl_lr, prompts=16,
                                                 group=8, max_new_tokens=max_new, seed=seed,
                                                 eval_every=args.rl_eval_every)
                                    if args.timing:
                                        for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
                                            t = rollout_timing(model, tok, task, 16, 8, max_new, dt)
                                            print(json.dumps({"engine": name, "max_new_tokens": max_new,
                                                              **{k: round(v, 3) for k, v in t.items()}}), flush=True)


if __name__ == "__main__":
    main()
