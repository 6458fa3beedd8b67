"""The slot sampler (``rollout/slots.py``, :class:`SlotSampler`): its decode of the occupied rows against the
full-slot decode (``--compare full-slot``, the default), or continuous batching against the engine's static batches
(``--compare static``).

    python experiments/bench/bench_slots.py                      # occupied rows vs every slot, longtail shapes
    python experiments/bench/bench_slots.py --compare static --slots 32 64 --samples 256 --max-new-tokens 256 \\
        --mean-len 24

**full-slot**: one sampler of ``--slots`` (128) rows on the embedded model (2 layers, hidden 64, 8 experts, top-2,
float32, one thread) samples ``--batches`` batches of ``--prompts`` ``longtail`` prompts x ``--group`` samples (the
``longtail`` job's step: 16 x 8, ``max_new_tokens`` 225, bench_tta.py), each batch submitted when the previous one
drained, three times per round: ``occupied`` (``free_rows`` = :data:`FREE_ROWS`: the occupied rows and at most 3 free
ones, the default), ``full-slot`` (``free_rows=None``: every slot, as the sampler decoded before it fed only the
occupied rows; kept as a sampler option so that the same code, but for the rows fed, is timed and its outputs compared
bit for bit here) and ``bare`` (``free_rows=0``: the occupied rows alone, which may round otherwise).  The
untrained model rarely stops, so the lengths are made long-tailed by an EOS hazard that falls with the position
``t``: ``P(EOS at t) = a / (t + c)`` (``--tail-alpha`` 2.5, ``--tail-scale`` 20; survival ``((c + t0) / (c + t))^a``,
a Pareto tail capped at ``max_new_tokens``: about 11 rows occupied per decode step and a third of the steps with one,
as a profile of the job's stream found).  Figures: response tokens per second, wall ms per step and decode-forward ms
per step (median over interleaved rounds), their ratios, the samples that are not bit-identical to the full-slot
decode's, and the distribution of the occupied rows and cache columns of the decode forwards.

**static**: both arms sample the same ``--samples`` responses (``--group`` samples each) with one engine; lengths
geometric (EOS probability ``1 / --mean-len`` per step), capped at ``--max-new-tokens``; the static arm is
``generate`` with ``rollout.batch_size`` = the slot count.  Tokens per wall-clock second, median over rounds, and
the ratio slots / static; ``--check`` verifies a few slot samples against a teacher-forced forward.

The load average (``os.getloadavg()``) and the CPU model are printed before and after: a shared machine steals
time from both arms alike.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from _machine import cpu_model
from offpolicy_moe.config.load import load_config
from offpolicy_moe.config.schema import ModelConfig, RolloutConfig
from offpolicy_moe.models import load_policy
from offpolicy_moe.rollout.engine import HFRolloutEngine
from offpolicy_moe.rollout.slots import FREE_ROWS, SlotSampler, StreamSample
from offpolicy_moe.tasks import encode_prompts, make_task


def load() -> str:
    return "load average " + "/".join(f"{x:.2f}" for x in os.getloadavg())


def build(a):
    """``(task, model, tokenizer)``: the embedded model of ``a``'s shape and the ``longtail`` task."""

    task = make_task(load_config(None, ["task.name=longtail"]).task)
    model, tok = load_policy(ModelConfig(num_layers=a.layers, hidden_size=a.hidden, num_experts=a.experts, top_k=2),
                             seed=0, task=task)
    return task, model, tok


def engine_of(a, model, tok, batch_size: int):
    """An :class:`HFRolloutEngine` of ``model`` at ``a``'s dtype, device and ``max_new_tokens``."""


    rollout = RolloutConfig(dtype=a.dtype, max_new_tokens=a.max_new_tokens, batch_size=batch_size)
    return HFRolloutEngine(model, tok, rollout, device=torch.device(a.device))


def prompt_ids(task, tok, n: int, offset: int = 0) -> list:
    """The unpadded token ids of ``n`` ``longtail`` training prompts from prompt ``offset``."""

    rows = task.sample_prompts(offset, n)
    ids, am = encode_prompts(tok, [r["prompt"] for r in rows])
    return [ids[i][am[i].bool()] for i in range(n)]


# ---------------------------------------------------------------------------------------------- full-slot decode
def tail_hooks(engine, alpha: float, scale: float) -> None:
    """EOS logit = logsumexp(other logits) + logit(a / (t + c)) at the fed position ``t`` of each row (kept from
    the model's ``position_ids`` by a pre-hook): ``P(EOS) = a / (t + c)``."""

    model, eos, held = engine.model, engine.tokenizer.eos_token_id, {}

    def keep_positions(module, args, kwargs):
        held["t"] = kwargs["position_ids"][:, -1:].float() + 1.0

    def hazard(module, args, out):
        h = (alpha / (held["t"] + scale)).clamp(max=0.999)          # [b, 1]
        others = out.float().clone()
        others[..., eos] = float("-inf")
        out = out.clone()
        out[..., eos] = (others.logsumexp(-1) + torch.logit(h)).to(out.dtype)
        return out

    model.register_forward_pre_hook(keep_positions, with_kwargs=True)
    model.lm_head.register_forward_hook(hazard)


def timed_forwards(engine) -> list:
    """Hooks appending ``(seconds, fed rows, columns)`` of every decode forward of ``engine``'s model."""
    log, t0 = [], {}

    def start(module, args, kwargs):
        t0["t"] = time.perf_counter()

    def stop(module, args, kwargs, out):
        ids = kwargs["input_ids"]
        if ids.shape[1] == 1:
            log.append((time.perf_counter() - t0["t"], ids.shape[0], kwargs["attention_mask"].shape[1]))

    engine.model.register_forward_pre_hook(start, with_kwargs=True)
    engine.model.register_forward_hook(stop, with_kwargs=True)
    return log


def run_stream(engine, slots: int, free_rows, batches: list, forwards: list) -> dict:
    """Sample ``batches`` (lists of StreamSample; each submitted when the previous drained) through one sampler;
    ``{tokens, seconds, steps, forward_s, occupied, columns, out}``."""

    sampler = SlotSampler(engine, slots, free_rows=free_rows)
    out, occupied, steps, first = {}, [], 0, len(forwards)
    t0 = time.perf_counter()
    for batch in batches:
        sampler.submit(batch)
        while sampler.queued or sampler.active:
            before = len(forwards)
            for f in sampler.step():
                out[f.key] = f
            steps += 1
            if len(forwards) > before:          # a decode forward ran: over the rows still active
                occupied.append(sampler.active)
    dt = time.perf_counter() - t0
    decodes = forwards[first:]
    return {"tokens": sum(int(f.response_ids.numel()) for f in out.values()), "seconds": dt, "steps": steps,
            "forward_s": sum(d[0] for d in decodes), "decodes": len(decodes), "occupied": occupied,
            "columns": [d[2] for d in decodes], "fed": [d[1] for d in decodes], "out": out}


def differing(x: dict, y: dict) -> int:
    """Samples whose tokens, float32 log-probs or versions differ (not torch.equal); all when the keys differ."""

    if x.keys() != y.keys():
        return max(len(x), len(y))
    return sum(not (torch.equal(x[k].response_ids, y[k].response_ids) and torch.equal(x[k].behav_logp, y[k].behav_logp)
                    and torch.equal(x[k].versions, y[k].versions)) for k in x)


def quantiles(xs: list) -> str:
    """``mean / median / p90 / max`` of ``xs``."""
    q = sorted(xs)
    return (f"mean {statistics.mean(q):.1f}, median {statistics.median(q):g}, p90 {q[int(0.9 * (len(q) - 1))]}, "
            f"max {q[-1]}")


def compare_full_slot(a) -> None:
    """The occupied-rows decode against the full-slot decode (module docstring)."""

    task, model, tok = build(a)
    engine = engine_of(a, model, tok, a.slots)
    tail_hooks(engine, a.tail_alpha, a.tail_scale)
    forwards = timed_forwards(engine)
    ids = prompt_ids(task, tok, a.prompts * a.batches)

    def batches(seed: int) -> list:
        return [[StreamSample((b * a.prompts + g, j), ids[b * a.prompts + g], seed * 100003 + (b * a.prompts + g)
                              * a.group + j) for g in range(a.prompts) for j in range(a.group)]
                for b in range(a.batches)]

    arms = {"occupied": FREE_ROWS, "full-slot": None, "bare": 0}
    print(f"model: {a.layers} layers, hidden {a.hidden}, {a.experts} experts, {a.dtype} on {a.device}, "
          f"{a.threads} thread(s); {a.slots} slots; {a.batches} batches of {a.prompts} longtail prompts x {a.group}; "
          f"max_new_tokens {a.max_new_tokens}; P(EOS at t) = {a.tail_alpha:g} / (t + {a.tail_scale:g})")
    print(f"cpu: {cpu_model()}; before: {load()}")
    run_stream(engine, a.slots, FREE_ROWS, batches(0)[:1], [])         # warm-up
    rows: dict = {arm: [] for arm in arms}
    diff = {"occupied": 0, "bare": 0}
    for r in range(a.rounds):
        res = {arm: run_stream(engine, a.slots, fr, batches(r + 1), forwards) for arm, fr in arms.items()}
        for arm in diff:
            diff[arm] += differing(res[arm]["out"], res["full-slot"]["out"])
        for arm, x in res.items():
            rows[arm].append(x)
            print(f"round {r} {arm:9s}: {x['tokens']} tokens, {x['steps']} steps in {x['seconds']:.2f} s = "
                  f"{x['tokens'] / x['seconds']:.0f} tok/s, {1e3 * x['seconds'] / x['steps']:.3f} ms/step, "
                  f"decode forward {1e3 * x['forward_s'] / x['decodes']:.3f} ms")
    print(f"after: {load()}")
    report_full_slot(rows, diff)


def report_full_slot(rows: dict, diff: dict) -> None:
    """The table of medians and ratios, and the occupancy / column distribution (the same in both arms)."""
    med = {arm: {"tok/s": statistics.median(x["tokens"] / x["seconds"] for x in xs),
                 "ms/step": statistics.median(1e3 * x["seconds"] / x["steps"] for x in xs),
                 "fwd ms": statistics.median(1e3 * x["forward_s"] / x["decodes"] for x in xs)}
           for arm, xs in rows.items()}
    print("\n| arm | tok/s | wall ms/step | decode forward ms |\n|---|---:|---:|---:|")
    for arm, m in med.items():
        print(f"| {arm} | {m['tok/s']:.0f} | {m['ms/step']:.3f} | {m['fwd ms']:.3f} |")
    f = med["full-slot"]
    for arm in ("occupied", "bare"):
        o = med[arm]
        print(f"| {arm} / full-slot | {o['tok/s'] / f['tok/s']:.2f}x | {o['ms/step'] / f['ms/step']:.2f}x | "
              f"{o['fwd ms'] / f['fwd ms']:.2f}x |")
    x = rows["occupied"][-1]
    print(f"\nlast round, {x['decodes']} decode forwards: occupied rows {quantiles(x['occupied'])}; "
          f"{sum(n == 1 for n in x['occupied'])} with one occupied row; rows fed {quantiles(x['fed'])} "
          f"(full-slot: {rows['full-slot'][-1]['fed'][0]}); cache columns {quantiles(x['columns'])}")
    lengths = [int(s.response_ids.numel()) for s in x["out"].values()]
    n = sum(len(x["out"]) for x in rows["full-slot"])
    print(f"response lengths: {quantiles(lengths)}; samples not bit-identical to the full-slot decode's, all rounds: "
          f"occupied {diff['occupied']} of {n}, bare {diff['bare']} of {n}")


# ---------------------------------------------------------------------------------------------- static batches
def compare_static(a) -> None:
    """Continuous batching against ``generate``'s static batches (module docstring)."""


    task, model, tok = build(a)
    dev = torch.device(a.device)
    n_prompts = a.samples // a.group
    rows = task.sample_prompts(0, n_prompts)
    prompts, answers = [r["prompt"] for r in rows], [r["answer"] for r in rows]
    ids = prompt_ids(task, tok, n_prompts)
    log_odds = float(torch.tensor(1.0 / a.mean_len).logit())

    def eos_hazard(module, args, out):
        """EOS logit = logsumexp(other logits) + logit(h): P(EOS) = h at every step."""
        others = out.float().clone()
        others[..., tok.eos_token_id] = float("-inf")
        out = out.clone()
        out[..., tok.eos_token_id] = (others.logsumexp(-1) + log_odds).to(out.dtype)
        return out

    engines = {}
    for s in a.slots_static:
        eng = engine_of(a, model, tok, s)
        eng.model.lm_head.register_forward_hook(eos_hazard)
        engines[s] = eng

    def run_static(s: int, seed: int) -> int:
        return int(engines[s].generate(prompts, answers, group_size=a.group, seed=seed).response_mask.sum())

    def run_slots(s: int, seed: int, check: bool = False) -> int:
        sampler = SlotSampler(engines[s], s)
        sampler.submit(StreamSample((g, j), ids[g], seed * 100003 + g * a.group + j)
                       for g in range(n_prompts) for j in range(a.group))
        done = []
        while sampler.queued or sampler.active:
            done += sampler.step()
        if check:
            check_teacher_forced(engines[s].model, done[:8], dev, s)
        return sum(int(f.response_ids.numel()) for f in done)

    print(f"model: {a.layers} layers, hidden {a.hidden}, {a.experts} experts, engine {a.dtype} on {dev}, "
          f"{torch.get_num_threads()} thread(s); {a.samples} samples ({n_prompts} longtail prompts x {a.group}), "
          f"max_new_tokens {a.max_new_tokens}, P(EOS) 1/{a.mean_len:g} per step")
    print(f"cpu: {cpu_model()}; before: {load()}")
    for s in a.slots_static:        # warm-up (and the optional check)
        run_static(s, 0)
        run_slots(s, 0, check=a.check)
    rates = interleave(a, {"static": run_static, "slots": run_slots}, dev)
    print(f"after: {load()}")
    for s in a.slots_static:
        st, sl = statistics.median(rates[("static", s)]), statistics.median(rates[("slots", s)])
        print(f"rows={s}: static {st:.0f} tok/s, slots {sl:.0f} tok/s, ratio slots/static {sl / st:.2f}")


def check_teacher_forced(model, done: list, dev, s: int) -> None:
    """Print the largest ``|behav_logp - teacher-forced log-prob|`` over ``done``."""

    worst = 0.0
    for f in done:
        full = torch.cat([f.prompt_ids, f.response_ids]).unsqueeze(0).to(dev)
        with torch.no_grad():
            lg = model(input_ids=full).logits[0].float()
        pl = f.prompt_ids.numel()
        ref = lg[pl - 1:-1].log_softmax(-1).gather(1, f.response_ids.to(dev).unsqueeze(1)).squeeze(1)
        worst = max(worst, float((ref.cpu() - f.behav_logp).abs().max()))
    print(f"check slots={s}: max |behav_logp - teacher-forced| over {len(done)} samples = {worst:.2e}")


def interleave(a, arms: dict, dev) -> dict:
    """Tokens per second of every arm and slot count, rounds interleaved: ``{(arm, slots): [rate per round]}``."""

    rates: dict = {}
    for r in range(a.rounds):
        for s in a.slots_static:
            for arm, fn in arms.items():
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                tokens = fn(s, r + 1)
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                dt = time.perf_counter() - t0
                rates.setdefault((arm, s), []).append(tokens / dt)
                print(f"round {r} rows={s:3d} {arm:6s}: {tokens} tokens in {dt:.2f} s = {tokens / dt:.0f} tok/s")
    return rates


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--compare", choices=("full-slot", "static"), default="full-slot")
    p.add_argument("--slots", type=int, nargs="+", default=None,
                   help="slot count(s): full-slot takes one (default 128), static several (default 32 64)")
    p.add_argument("--prompts", type=int, default=16, help="full-slot: prompts per batch")
    p.add_argument("--batches", type=int, default=2, help="full-slot: batches, each submitted once the last drained")
    p.add_argument("--tail-alpha", type=float, default=2.5, help="full-slot: a in P(EOS at t) = a / (t + c)")
    p.add_argument("--tail-scale", type=float, default=20.0, help="full-slot: c in P(EOS at t) = a / (t + c)")
    p.add_argument("--samples", type=int, default=256, help="static: responses per arm and round")
    p.add_argument("--group", type=int, default=None, help="samples per prompt (default 8 full-slot, 4 static)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default 225 full-slot, 256 static")
    p.add_argument("--mean-len", type=float, default=24.0, help="static: 1 / EOS probability per step")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dtype", default="float32", help="engine dtype")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--check", action="store_true", help="static: teacher-forced check of a few slot samples")
    a = p.parse_args(argv)
    full = a.compare == "full-slot"
    a.group = a.group or (8 if full else 4)
    a.max_new_tokens = a.max_new_tokens or (225 if full else 256)
    a.slots_static = a.slots or [32, 64]
    a.slots = (a.slots or [128])[0]


    torch.set_num_threads(a.threads)
    (compare_full_slot if full else compare_static)(a)


if __name__ == "__main__":
    main()
