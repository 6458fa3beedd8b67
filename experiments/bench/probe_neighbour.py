"""How much a busy neighbour core slows the built-in engine's generation.

An asynchronous arm's worker generates on one core while the trainer computes on the other; the generation floor
(`bench_tta`'s bound G) is measured with the other core idle.  This probe generates the long-tailed job's batches
(16 prompts x 8 samples, up to 225 new tokens, float32, 1 thread) from a warm start, in interleaved rounds:

* ``alone``: nothing else running;
* ``matmul``: another process multiplies 512 x 512 matrices on one thread, without pause;
* ``update``: another process runs forward + backward passes of the same model on one thread (the trainer's work).

It prints the median seconds per generate call of each, and the load average after.

    python experiments/bench/probe_neighbour.py --model-path WARM_START --rounds 3
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import tempfile
import time

import torch

from offpolicy_moe.config.load import load_config
from offpolicy_moe.trainer.trainer import Trainer

JOB = ["task.name=longtail", "task.estimate_share=0.5", "seed=1", "rollout.prompts_per_step=16", "rollout.group_size=8",
       "rollout.max_new_tokens=225", "rollout.dtype=float32", "trainer.threads=1", "trainer.sft_warmup_steps=0",
       "preset=[grpo]", "algo.routing.replay=none", "algo.routing.metrics=false", "trainer.mismatch_metrics=false",
       "logging.progress=false"]


def _trainer(model_path: str) -> Trainer:
    cfg = load_config(None, JOB + [f"model.path={model_path}", f"run_dir={tempfile.mkdtemp(prefix='neighbour_')}"])
    tr = Trainer(cfg)
    tr.publish(0)
    return tr


def neighbour(stop, kind: str, model_path: str, started) -> None:
    """Busy work on one thread until ``stop`` is set: matmuls, or the model's forward + backward."""
    torch.set_num_threads(1)
    if kind == "matmul":
        a = torch.randn(512, 512)
        started.set()
        while not stop.is_set():
            a @ a
        return
    model = _trainer(model_path).unwrapped
    x = torch.randint(3, 15, (128, 60))
    started.set()
    while not stop.is_set():
        model(input_ids=x).logits.float().logsumexp(-1).mean().backward()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", required=True, help="a warm start of the long-tailed job (a transformers folder)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--calls", type=int, default=5, help="generate calls per round and setting")
    args = p.parse_args()
    torch.set_num_threads(1)
    tr = _trainer(args.model_path)
    for i in range(2):
        tr.source.generate(i)
    ctx = mp.get_context("spawn")
    seconds: dict[str, list[float]] = {"alone": [], "matmul": [], "update": []}
    iteration = 2
    for _ in range(args.rounds):
        for kind in seconds:
            stop, started, proc = ctx.Event(), ctx.Event(), None
            if kind != "alone":
                proc = ctx.Process(target=neighbour, args=(stop, kind, args.model_path, started))
                proc.start()
                if not started.wait(300):
                    raise RuntimeError(f"the {kind} neighbour did not start within 300 s")
            t0 = time.perf_counter()
            for _ in range(args.calls):
                tr.source.generate(iteration)
                iteration += 1
            seconds[kind].append((time.perf_counter() - t0) / args.calls)
            if proc is not None:
                stop.set()
                proc.join()
    med = {k: statistics.median(v) for k, v in seconds.items()}
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: s per generate call (median of {args.rounds} "
          f"rounds x {args.calls} calls): " + ", ".join(f"{k} {v:.4f}" for k, v in med.items())
          + f"; beside matmul {med['matmul'] / med['alone']:.2f}x, beside an update {med['update'] / med['alone']:.2f}x"
          f"; load {' '.join(open('/proc/loadavg').read().split()[:3])}")


if __name__ == "__main__":
    main()
