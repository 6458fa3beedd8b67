#!/usr/bin/env bash
# Issue 44 on a lent GPU machine (16 CPU cores): the CPU measurements of streaming run side by side on its cores
# while the GPU runs its own checks.
#   bash experiments/gpu/stream_check.sh OUT_DIR WARM_DIR     (WARM_DIR: a longtail warm-start export)
# CPU (no GPU visible), one thread per process: the length bias of the deadline rule against the naive one (3 seeds in parallel),
# the cost curve of a long tail (one process per task.max_terms). GPU, in turn: bench_gpu (tokens/s, MFU), a
# 20-step stream run with the trainer on CUDA (its worker decodes on the CPU), bench_routing (R3 overhead).
set -uo pipefail
out="${1:-/tmp/gpu_out}"; warm="${2:?a warm-start export folder}"; mkdir -p "$out"
. "$(dirname "$0")/setup.sh"
nvidia-smi -L; uptime; nproc
job() { local name="$1" t="$2"; shift 2; ( t0=$(date +%s); CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=1 timeout -k 10 "$t" "$@" > "$out/$name.log" 2>&1; echo "rc=$? in $(( $(date +%s) - t0 )) s" >> "$out/$name.log" ) & }
for s in 0 1 2; do
  job "bias_seed$s" 420 python3 experiments/bench/stream_length_bias.py --warm "$warm" --seeds "$s" --steps 30 --out "$out/bias_seed$s.md"
done
for m in 6 8 11 15; do
  job "cost_terms$m" 420 python3 experiments/bench/stream_cost_curve.py --warm "$warm" --max-terms "$m" --iterations 4 --rounds 3
done
gpu() { local name="$1" t="$2"; shift 2; echo "=== $name"; t0=$(date +%s); timeout -k 10 "$t" "$@" > "$out/$name.log" 2>&1; echo "rc=$? in $(( $(date +%s) - t0 )) s"; tail -n 12 "$out/$name.log"; }
gpu bench_gpu 120 python3 experiments/bench/bench_gpu.py --size 0.9b --device cuda --json "$out/bench_gpu.json"
gpu stream_cuda 150 python3 -m offpolicy_moe train preset=[grpo,tis,r3] buffer.mode=stream buffer.staleness=1 \
  rollout.stream_slots=64 trainer.steps=20 run_dir=/tmp/gpu_runs/stream 'logging.loggers=[jsonl]'
cp /tmp/gpu_runs/stream/summary.json "$out/summary_stream.json" 2>/dev/null
tail -n 2 /tmp/gpu_runs/stream/metrics.jsonl > "$out/stream_last_rows.jsonl" 2>/dev/null
gpu bench_routing 170 python3 experiments/bench/bench_routing.py --family qwen3_moe --device cuda --dtype bfloat16 \
  --layers 16 --hidden 1024 --experts 32 --top-k 4 --rounds 2 --json "$out/bench_routing.json"
wait
uptime
for f in "$out"/bias_seed*.md; do echo "== $f"; cat "$f"; done
for f in "$out"/cost_terms*.log; do echo "== $f"; tail -n 4 "$f"; done
