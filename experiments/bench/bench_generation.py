"""Generation with and without compaction of finished sequences (``rollout.compact_finished``).

The policy is first warm-started with the default SFT recipe (so that most answers stop after a few tokens, as in
training), then the engine generates the same prompt batches alternately with compaction off and on; the figure is
the median over rounds of the mean process CPU time per ``Trainer.generate`` call (CPU time: insensitive to time
stolen by other tenants of a shared machine).

    python experiments/bench/bench_generation.py --max-new-tokens 16 --dtype bfloat16 --replay r3
    python experiments/bench/bench_generation.py --max-new-tokens 16 --dtype float32 --replay none
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16", help="engine dtype")
    p.add_argument("--replay", default="r3", choices=["none", "r3"], help="r3: the engine records routes")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--calls", type=int, default=5, help="generate calls per round and setting")
    p.add_argument("--sft-steps", type=int, default=60)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from offpolicy_moe.config.load import load_config
    from offpolicy_moe.trainer.sft import sft_warm_start
    from offpolicy_moe.trainer.trainer import Trainer

    preset = "preset=[grpo,r3]" if args.replay == "r3" else "preset=[grpo]"
    cfg = load_config(None, [preset, f"run_dir={tempfile.mkdtemp(prefix='bench_gen_')}",
                             f"rollout.dtype={args.dtype}", f"rollout.max_new_tokens={args.max_new_tokens}",
                             "logging.progress=false", "algo.routing.metrics=false", f"trainer.threads={args.threads}"])
    tr = Trainer(cfg)
    sft_warm_start(tr.unwrapped, tr.tok, tr.task, steps=args.sft_steps, lr=cfg.trainer.sft_lr,
                   batch_size=cfg.trainer.sft_batch_size, seed=cfg.seed, progress=False)
    tr.publish(0)
    times: dict[bool, list[float]] = {False: [], True: []}
    lengths = []
    for _ in range(args.rounds):
        for compact in (False, True):
            tr.engine.compact_finished = compact
            t0 = time.process_time()
            for i in range(args.calls):
                batch = tr.source.generate(i)
                lengths.append(float(batch.response_mask.sum(1).float().mean()))
            times[compact].append((time.process_time() - t0) / args.calls)
    off, on = statistics.median(times[False]), statistics.median(times[True])
    print(f"max_new_tokens={args.max_new_tokens} engine {args.dtype} replay {args.replay}: "
          f"s per generate call (CPU) without compaction {off:.4f}, with {on:.4f}: {off / on:.2f}x; "
          f"mean response length {statistics.mean(lengths):.2f} tokens; {time.strftime('%Y-%m-%d')}, "
          f"torch {torch.__version__}, {args.threads} thread(s)")


if __name__ == "__main__":
    main()
