"""Continuous batching (``streaming/slots.py``, :class:`SlotSampler`) against the engine's static batches (generate).

    python experiments/bench/bench_slots.py --slots 32 64 --samples 256 --max-new-tokens 256 --mean-len 24

Both arms sample the same ``--samples`` responses (``longtail`` task prompts, ``--group`` samples each) with one
engine.  The response lengths are made long-tailed by pinning the EOS probability of every step to ``1 / --mean-len``
(a hook on the engine's ``lm_head``: an untrained model rarely stops), capped at ``--max-new-tokens``: geometric
lengths, so a static batch of ``B`` rows runs about ``mean-len * ln B`` steps while most of its rows are done.  The
static arm is ``generate`` with ``rollout.batch_size`` = the slot count (the same number of rows decoded at once).
Rounds interleave the arms; the figure is tokens (response tokens up to and including EOS) per wall-clock second,
median over rounds, and the ratio slots / static.  ``uptime``'s load average is printed before and after (a shared
machine steals time from both arms alike).  ``--check`` also verifies a few slot samples against a teacher-forced
forward (log-probs, float32 only).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import time


def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "load average: %.2f, %.2f, %.2f" % os.getloadavg()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--slots", type=int, nargs="+", default=[32, 64])
    p.add_argument("--samples", type=int, default=256, help="responses per arm and round")
    p.add_argument("--group", type=int, default=4, help="samples per prompt")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--mean-len", type=float, default=24.0, help="1 / EOS probability per step")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dtype", default="float32", help="engine dtype")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--check", action="store_true", help="teacher-forced check of a few slot samples")
    a = p.parse_args(argv)

    import torch

    torch.set_num_threads(a.threads)
    from offpolicy_moe.config.load import load_config
    from offpolicy_moe.config.schema import ModelConfig, RolloutConfig
    from offpolicy_moe.models import load_policy
    from offpolicy_moe.rollout.engine import HFRolloutEngine
    from offpolicy_moe.streaming.slots import SlotSampler, StreamSample
    from offpolicy_moe.tasks import encode_prompts, make_task

    task = make_task(load_config(None, ["task.name=longtail"]).task)
    model, tok = load_policy(ModelConfig(num_layers=a.layers, hidden_size=a.hidden, num_experts=a.experts, top_k=2),
                             seed=0, task=task)
    dev = torch.device(a.device)
    n_prompts = a.samples // a.group
    rows = task.sample_prompts(0, n_prompts)
    prompts, answers = [r["prompt"] for r in rows], [r["answer"] for r in rows]
    ids, am = encode_prompts(tok, prompts)
    prompt_ids = [ids[i][am[i].bool()] for i in range(n_prompts)]
    log_odds = float(torch.tensor(1.0 / a.mean_len).logit())

    def eos_hazard(module, args, out):
        """EOS logit = logsumexp(other logits) + logit(h): P(EOS) = h at every step."""
        others = out.float().clone()
        others[..., tok.eos_token_id] = float("-inf")
        out = out.clone()
        out[..., tok.eos_token_id] = (others.logsumexp(-1) + log_odds).to(out.dtype)
        return out

    engines = {}
    for s in a.slots:
        rollout = RolloutConfig(dtype=a.dtype, max_new_tokens=a.max_new_tokens, batch_size=s)
        eng = HFRolloutEngine(model, tok, rollout, device=dev)
        eng.model.lm_head.register_forward_hook(eos_hazard)
        engines[s] = eng

    def run_static(s: int, seed: int) -> int:
        batch = engines[s].generate(prompts, answers, group_size=a.group, seed=seed)
        return int(batch.response_mask.sum())

    def run_slots(s: int, seed: int, check: bool = False) -> int:
        sampler = SlotSampler(engines[s], s)
        sampler.submit(StreamSample((g, j), prompt_ids[g], seed * 100003 + g * a.group + j)
                       for g in range(n_prompts) for j in range(a.group))
        done = []
        while sampler.queued or sampler.active:
            done += sampler.step()
        if check:
            worst = 0.0
            for f in done[:8]:
                full = torch.cat([f.prompt_ids, f.response_ids]).unsqueeze(0).to(dev)
                with torch.no_grad():
                    lg = engines[s].model(input_ids=full).logits[0].float()
                pl = f.prompt_ids.numel()
                ref = lg[pl - 1:-1].log_softmax(-1).gather(1, f.response_ids.to(dev).unsqueeze(1)).squeeze(1)
                worst = max(worst, float((ref.cpu() - f.behav_logp).abs().max()))
            print(f"check slots={s}: max |behav_logp - teacher-forced| over 8 samples = {worst:.2e}")
        return sum(int(f.response_ids.numel()) for f in done)

    print(f"model: {a.layers} layers, hidden {a.hidden}, {a.experts} experts, engine {a.dtype} on {dev}, "
          f"{torch.get_num_threads()} thread(s); {a.samples} samples ({n_prompts} longtail prompts x {a.group}), "
          f"max_new_tokens {a.max_new_tokens}, P(EOS) 1/{a.mean_len:g} per step")
    print("before:", _uptime())
    for s in a.slots:        # warm-up (and the optional check)
        run_static(s, 0)
        run_slots(s, 0, check=a.check)
    rates: dict[tuple[str, int], list[float]] = {}
    for r in range(a.rounds):
        for s in a.slots:
            for arm, fn in (("static", run_static), ("slots", run_slots)):
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                tokens = fn(s, r + 1)
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                dt = time.perf_counter() - t0
                rates.setdefault((arm, s), []).append(tokens / dt)
                print(f"round {r} rows={s:3d} {arm:6s}: {tokens} tokens in {dt:.2f} s = {tokens / dt:.0f} tok/s")
    print("after:", _uptime())
    for s in a.slots:
        st, sl = statistics.median(rates[("static", s)]), statistics.median(rates[("slots", s)])
        print(f"rows={s}: static {st:.0f} tok/s, slots {sl:.0f} tok/s, ratio slots/static {sl / st:.2f}")


if __name__ == "__main__":
    main()
