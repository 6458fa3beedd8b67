"""How much signal one RL batch's policy gradient carries at a warm start, and how far a step along it may go.

Issue 44, item 1 (the ``longtail`` job does not learn): a diagnosis that needs no training run.  From a warm start
(an exported Hugging Face folder, e.g. bench_tta.py's cached longtail warm start) it

1. samples ``--batches`` independent batches of the job's shape (16 prompts x 8 samples, temperature 1 or
   ``--temperature``, top-p 1, no top-k, up to 225 new tokens, float32) from the task's training prompts, scores
   them with the final-answer reward (``--task default``: the default job, 3 new tokens, exact match), and takes
   each batch's gradient of the on-policy GRPO loss with token-mean aggregation,

       L = -(1 / sum_i |o_i|) sum_i A_i sum_t log pi(o_it | q, o_<t),   A_i = (r_i - mean_g r) / (std_g r + 1e-6),

   (at ratio 1 the clipped objective's gradient is this one, arXiv 2402.03300);
2. reports the mean pairwise cosine between the batch gradients.  For batch gradients ``g_k = mu + e_k`` with
   independent noise, ``E[cos] ~ |mu|^2 / (|mu|^2 + sigma^2 / B)``: the share of one batch's squared gradient norm
   that is signal;
3. moves the weights from the warm start by ``eta`` along a direction made from the mean of the batch gradients
   and measures the sampled reward on 1,024 fresh samples (the same prompts and sampling seeds at every ``eta``):
   ``--direction sign`` is Adam's first step, ``-lr sign(g)`` (``eta`` is then the learning rate);
   ``--direction unit`` the normalised gradient, ``-g / |g|`` (``eta`` is the step's L2 norm).

Usage (one thread, ``OMP_NUM_THREADS=1``)::

    python experiments/bench/probe_gradient.py --warm DIR --batches 32 --direction sign --eta 0,1e-5,3e-5,1e-4,-1e-4

Prints one JSON line for the batch statistics and one per ``eta``.  Per-parameter gradient norms with
``--by-parameter``.  The figures it gave are in experiments/results/tta/longtail/probes.md (fourth round).
"""
from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from offpolicy_moe.config.load import load_config
from offpolicy_moe.losses.advantages import group_advantages
from offpolicy_moe.losses.objectives import grpo_loss
from offpolicy_moe.models.token_logprobs import token_logprobs
from offpolicy_moe.tasks.make import make_task
from offpolicy_moe.tasks.tokenizer import decode_completions, encode_prompts

PROMPTS, GROUP = 16, 8
#: ``--task``: bench_tta's job of that name, as task overrides of the config and its max_new_tokens (``default``:
#: the default job's 3-term sums with 2-character answers, a positive control, since RL improves it: README)
TASKS = {"longtail": (["task.name=longtail"], 225), "default": ([], 3)}
#: held-out problems of bench_tta's jobs (the task's splits depend on it)
EVAL_SIZE = 256
#: the batches that measure the reward after a step: fresh training prompts (their steps are past the gradient's)
EVAL_BATCHES, EVAL_STEP0, GRAD_STEP0 = 8, 5000, 1000


def sample(model, tok, task, rows: list[dict], seed: int, temperature: float = 1.0, max_new_tokens: int = 225
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, np.ndarray]:
    """``GROUP`` samples of every row at ``temperature``: prompt ids, prompt mask, completion ids, and the
    task's rewards (the longtail task's: the final answer's exact match)."""
    prompts = [r["prompt"] for r in rows for _ in range(GROUP)]
    answers = [r["answer"] for r in rows for _ in range(GROUP)]
    ids, mask = encode_prompts(tok, prompts)
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=temperature, top_k=0,
                             top_p=1.0, max_new_tokens=max_new_tokens, eos_token_id=tok.eos_token_id,
                             pad_token_id=tok.pad_token_id)
    comp = out[:, ids.shape[1]:]
    return ids, mask, comp, np.array(task.reward(decode_completions(tok, comp), answers))


def response_mask(comp: torch.Tensor, eos: int) -> torch.Tensor:
    """1 on every completion token up to and including the first ``eos`` (all of a row that never ends)."""
    is_eos = (comp == eos).int()
    before = torch.cumsum(is_eos, 1) - is_eos          # eos tokens strictly before each position
    return (before == 0).long()


def grpo_gradient(model, params, ids, mask, comp, rewards: np.ndarray, eos: int, temperature: float = 1.0
                  ) -> torch.Tensor:
    """The flattened gradient of the module docstring's loss ``L`` for one batch (``pi``: the policy at
    ``temperature``, the distribution the samples were drawn from), through the project's own pieces: the group
    advantages the trainer uses, its token log-probs, and the ``grpo`` loss at ratio 1 (``old_logp`` = ``logp``)."""
    groups = torch.arange(len(rewards)) // GROUP
    adv = group_advantages(torch.as_tensor(rewards, dtype=torch.float32), groups)
    cm = response_mask(comp, eos)
    model.zero_grad()
    logits = model(input_ids=torch.cat([ids, comp], 1), attention_mask=torch.cat([mask, cm], 1)).logits
    logp = token_logprobs(logits[:, ids.shape[1] - 1:-1], comp, temperature)
    loss, _ = grpo_loss(logp, logp.detach(), adv, cm.float())
    loss.backward()
    return torch.cat([p.grad.reshape(-1) for p in params]).clone()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--warm", required=True, help="an exported warm start (Hugging Face folder)")
    p.add_argument("--batches", type=int, default=16)
    p.add_argument("--direction", choices=("sign", "unit"), default="sign")
    p.add_argument("--eta", default="0,1e-5,3e-5,1e-4", help="comma-separated step sizes (0 = the warm start)")
    p.add_argument("--by-parameter", action="store_true", help="also print the mean gradient's norm per tensor")
    p.add_argument("--task", choices=sorted(TASKS), default="longtail")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (the job's: 1)")
    p.add_argument("--hold", action="append", default=[], metavar="SUBSTRING",
                   help="leave the tensors whose name holds SUBSTRING where they are (the step is 0 there)")
    a = p.parse_args(argv)
    if not (a.temperature > 0 and np.isfinite(a.temperature)):
        p.error(f"--temperature must be finite and > 0, got {a.temperature}")
    if a.batches < 2:
        p.error(f"--batches must be >= 2 (cosines need pairs), got {a.batches}")
    try:
        etas = [float(e) for e in a.eta.split(",")]
    except ValueError:
        p.error(f"--eta must be comma-separated numbers, got {a.eta!r}")
    if not all(np.isfinite(etas)):
        p.error(f"--eta must be finite, got {a.eta!r}")
    if not (Path(a.warm) / "config.json").is_file():
        p.error(f"--warm {a.warm}: not an exported model folder (no config.json)")
    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(a.warm)
    model = AutoModelForCausalLM.from_pretrained(a.warm, dtype=torch.float32)
    task_overrides, max_new = TASKS[a.task]
    task = make_task(load_config(overrides=[*task_overrides, f"task.eval_size={EVAL_SIZE}"]).task)
    named = [(n, q) for n, q in model.named_parameters() if q.requires_grad]
    unmatched = [h for h in a.hold if not any(h in n for n, _ in named)]
    if unmatched:
        p.error(f"--hold {unmatched[0]!r} names no tensor of the model (see --by-parameter)")
    params = [q for _, q in named]
    t0 = time.time()
    grads, rewards = [], []
    for k in range(a.batches):
        rows = task.sample_prompts(GRAD_STEP0 + k, PROMPTS)
        ids, mask, comp, r = sample(model, tok, task, rows, k, a.temperature, max_new)
        rewards.append(float(r.mean()))
        grads.append(grpo_gradient(model, params, ids, mask, comp, r, tok.eos_token_id, a.temperature))
    cos = [torch.nn.functional.cosine_similarity(x, y, 0).item() for x, y in itertools.combinations(grads, 2)]
    mean = torch.stack(grads).mean(0)
    print(json.dumps({"warm": a.warm, "task": a.task, "temperature": a.temperature, "batches": a.batches,
                      "samples_per_batch": PROMPTS * GROUP,
                      "sampled_reward": float(np.mean(rewards)), "cos_mean": float(np.mean(cos)),
                      "cos_sd": float(np.std(cos)), "batch_grad_norm": float(np.mean([g.norm().item() for g in grads])),
                      "mean_grad_norm": mean.norm().item(), "params": mean.numel(), "s": round(time.time() - t0, 1)}),
          flush=True)
    if a.by_parameter:
        off = 0
        for n, q in named:
            k = q.numel()
            print(json.dumps({"tensor": n, "numel": k, "weight_norm": q.detach().norm().item(),
                              "mean_grad_norm": mean[off:off + k].norm().item()}))
            off += k
    held = torch.cat([torch.full((q.numel(),), any(h in n for h in a.hold)) for n, q in named])
    mean = torch.where(held, torch.zeros_like(mean), mean)
    direction = -torch.sign(mean) if a.direction == "sign" else -mean / mean.norm()
    theta = [q.detach().clone() for q in params]
    for eta in etas:
        off = 0
        for q, t in zip(params, theta):
            k = q.numel()
            q.data.copy_(t + eta * direction[off:off + k].view_as(q))
            off += k
        r = [sample(model, tok, task, task.sample_prompts(EVAL_STEP0 + j, PROMPTS), 100 + j, a.temperature,
                    max_new)[3].mean() for j in range(EVAL_BATCHES)]
        print(json.dumps({"direction": a.direction, "hold": a.hold, "eta": eta, "sampled_reward": float(np.mean(r)),
                          "samples": EVAL_BATCHES * PROMPTS * GROUP}), flush=True)


if __name__ == "__main__":
    main()
