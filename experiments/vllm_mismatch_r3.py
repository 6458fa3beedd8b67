"""R3's effect on the same batches in the runs of experiments/vllm_mismatch.yaml: per run, the mean over its last
30 steps of the trainer's k3 KL against the engine without replay (``mismatch/k3_kl_no_r3``) and with the engine's
routes replayed (``mismatch/k3_kl_r3``), both measured on the same batches; per engine, the geometric mean of the
per-run ratios with a 95% Student-t interval on log10 (runs of every algorithm count: the measurement does not
depend on how the run trains), and the largest ``routing/replay_fallback`` seen.

    python experiments/vllm_mismatch_r3.py runs/vllm_mismatch
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

from scipy import stats


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sweep", type=Path)
    p.add_argument("--last", type=int, default=30)
    args = p.parse_args()
    for engine in ("hf", "vllm"):
        logs, fallback = [], 0.0
        for run in sorted(args.sweep.glob(f"engine={engine}__*")):
            rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
            rows = [r for r in rows if "mismatch/k3_kl_r3" in r][-args.last:]
            plain = statistics.mean(r["mismatch/k3_kl_no_r3"] for r in rows)
            replayed = statistics.mean(r["mismatch/k3_kl_r3"] for r in rows)
            fallback = max([fallback] + [r.get("routing/replay_fallback", 0.0) for r in rows])
            logs.append(math.log10(replayed / plain))
        n = len(logs)
        mean, half = statistics.mean(logs), stats.t.ppf(0.975, n - 1) * statistics.stdev(logs) / math.sqrt(n)
        print(f"engine={engine}: k3 KL with R3 / without, same batches: x{10 ** mean:.3f} "
              f"[x{10 ** (mean - half):.3f}, x{10 ** (mean + half):.3f}] over {n} runs; "
              f"largest routing/replay_fallback {fallback}")


if __name__ == "__main__":
    main()
