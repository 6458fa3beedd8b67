"""Two exact savings in the samplers, each against the way it replaced, interleaved in one run, 1 thread by default:

* **filled-column copies** (``rollout/kv_cache.py``, ``PreallocatedLayer``): repeating a prefill to its group's
  rows and dropping finished rows copy only the cache's filled columns while they are at most half the buffer;
  ``whole`` copies every allocated column, as the layer did before.  Timed on ``HFRolloutEngine.generate`` (the
  static batch of the sync, fixed and asynchronous arms): ``--prompts`` x ``--group`` samples a call;
* **races drawn ahead** (``rollout/slots.py``, ``RACE_TOKENS``): the slot sampler draws a row's Exp(1) race for
  its next tokens in one call; ``per token`` draws one call a token, as it did before.  Timed on a
  :class:`SlotSampler` of ``--slots`` rows fed ``--steps`` batches of ``--prompts`` x ``--group`` samples, each after
  ``--forwards`` decode steps of the previous, then drained (a stream's pattern).

Both ways must give the same tokens and log-probs (asserted each round).  Figures: the median seconds a call and the
median of the per-round ratios (before / now: above 1 is faster now); round 0 warms up.  The model is the embedded
preset (random weights) unless ``--model-path`` names a Hugging Face folder (a warm start kept by ``bench_tta.py
--warm-cache``); ``--set`` takes config overrides.

    python experiments/bench/bench_sampler_copies.py --model-path WARM --set task.name=longtail \\
        task.estimate_share=0.5 --max-new-tokens 225
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from contextlib import contextmanager
from typing import Iterator

import torch

from _bench_model import bench_policy
from _machine import cpu_model
from offpolicy_moe.rollout import slots as slots_module
from offpolicy_moe.rollout.engine import HFRolloutEngine
from offpolicy_moe.rollout.kv_cache import PreallocatedLayer
from offpolicy_moe.rollout.stream_worker import sample_seed
from offpolicy_moe.tasks import encode_prompts


def _whole_repeat(layer: PreallocatedLayer, repeats: int) -> None:
    if layer._len:
        layer._kbuf = layer._kbuf.repeat_interleave(repeats, dim=0)
        layer._vbuf = layer._vbuf.repeat_interleave(repeats, dim=0)
        layer._expose()


def _whole_select(layer: PreallocatedLayer, indices: torch.Tensor) -> None:
    if layer._len:
        layer._kbuf = layer._kbuf.index_select(0, indices)
        layer._vbuf = layer._vbuf.index_select(0, indices)
        layer._expose()


@contextmanager
def whole_buffer_copies() -> Iterator[None]:
    """The layer's row repetition and selection copying every allocated column (the way before)."""
    saved = PreallocatedLayer.batch_repeat_interleave, PreallocatedLayer.batch_select_indices
    PreallocatedLayer.batch_repeat_interleave, PreallocatedLayer.batch_select_indices = _whole_repeat, _whole_select
    try:
        yield
    finally:
        PreallocatedLayer.batch_repeat_interleave, PreallocatedLayer.batch_select_indices = saved


@contextmanager
def race_per_token() -> Iterator[None]:
    """The slot sampler drawing one race call a token (the way before)."""
    saved = slots_module.RACE_TOKENS
    slots_module.RACE_TOKENS = 1
    try:
        yield
    finally:
        slots_module.RACE_TOKENS = saved


@contextmanager
def _nothing() -> Iterator[None]:
    """The way as the package does it now."""
    yield


def _timed_rounds(rounds: int, ways: dict, work) -> dict[str, list[float]]:
    """``work(round)`` under each way's context, interleaved, for ``rounds + 1`` rounds (round 0 untimed); the
    outputs of the ways must be equal each round."""
    secs: dict[str, list[float]] = {w: [] for w in ways}
    for r in range(rounds + 1):
        out = {}
        for w, ctx in ways.items():
            with ctx():
                t0 = time.perf_counter()
                out[w] = work(r)
                if r:
                    secs[w].append(time.perf_counter() - t0)
        first = next(iter(out.values()))
        assert all(o == first for o in out.values()), f"round {r}: the ways sampled different tokens or log-probs"
    return secs


def _report(title: str, secs: dict[str, list[float]], before: str, now: str) -> None:
    ratio = statistics.median(b / n for b, n in zip(secs[before], secs[now]))
    print(f"\n{title}\n\n| way | s a call |\n| --- | --- |")
    for w, s in secs.items():
        print(f"| {w} | {statistics.median(s):.4f} |")
    print(f"\n{before} / {now} (median of per-round ratios): {ratio:.3f}x")


def static_generation(eng: HFRolloutEngine, task, args) -> None:
    """The engine's static batch, filled-column copies against whole-buffer ones."""
    def work(r: int):
        rows = task.sample_prompts(r, args.prompts)
        out = eng.generate([x["prompt"] for x in rows], [x["answer"] for x in rows], group_size=args.group, seed=r)
        return out.input_ids.tolist(), out.behav_logp.tolist()

    secs = _timed_rounds(args.rounds, {"filled columns": _nothing, "whole buffer": whole_buffer_copies}, work)
    _report(f"static generation ({args.prompts} x {args.group} samples a call, up to {args.max_new_tokens} tokens)",
            secs, "whole buffer", "filled columns")


def slot_sampling(eng: HFRolloutEngine, tok, task, args) -> None:
    """The slot sampler, races drawn ahead against one call a token."""
    def work(r: int):
        sampler = slots_module.SlotSampler(eng, args.slots)
        out = {}
        for step in range(args.steps):
            rows = task.sample_prompts(1000 * r + step, args.prompts)
            ids, am = encode_prompts(tok, [x["prompt"] for x in rows])
            for g in range(args.prompts):
                prompt = ids[g][am[g].bool()]
                sampler.submit(slots_module.StreamSample((step, g, j), prompt, sample_seed(r + step, j))
                               for j in range(args.group))
            for _ in range(args.forwards):
                out.update({f.key: (f.response_ids.tolist(), f.behav_logp.tolist()) for f in sampler.step()})
        while sampler.queued or sampler.active:
            out.update({f.key: (f.response_ids.tolist(), f.behav_logp.tolist()) for f in sampler.step()})
        return out

    secs = _timed_rounds(args.rounds, {"ahead": _nothing, "per token": race_per_token}, work)
    _report(f"slot sampling ({args.slots} slots, {args.steps} batches of {args.prompts} x {args.group}, each after "
            f"{args.forwards} decode steps)", secs, "per token", "ahead")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=None, help="a Hugging Face folder (default: the embedded preset)")
    p.add_argument("--set", nargs="*", default=[], help="config overrides, e.g. task.name=longtail")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--slots", type=int, default=128)
    p.add_argument("--steps", type=int, default=4, help="batches fed to the slot sampler a call")
    p.add_argument("--forwards", type=int, default=100, help="decode steps between two batches")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    if min(args.prompts, args.group, args.max_new_tokens, args.slots, args.steps, args.forwards, args.rounds,
           args.threads) < 1:
        p.error("--prompts, --group, --max-new-tokens, --slots, --steps, --forwards, --rounds and --threads must "
                "be >= 1")
    torch.set_num_threads(args.threads)
    cfg, task, model, tok = bench_policy(args)
    eng = HFRolloutEngine(model, tok, cfg.rollout)
    print(f"{cpu_model()}; torch {torch.__version__}, {args.threads} thread(s); model {args.model_path or 'embedded'}; "
          f"load average {os.getloadavg()}")
    static_generation(eng, task, args)
    slot_sampling(eng, tok, task, args)
    print(f"\nload average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
