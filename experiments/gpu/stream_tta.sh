#!/usr/bin/env bash
# Issue 44's time-to-accuracy arms on the longtail job, on a lent machine's CPU cores (no GPU visible to the runs):
# one bench_tta invocation per seed, side by side (each arm is one or two processes of one thread, or two threads).
#   bash experiments/gpu/stream_tta.sh OUT_DIR WARM_CACHE SEEDS...      (WARM_CACHE: bench_tta's --warm-cache folder)
# Every invocation writes OUT_DIR/seed<s>/partial.json after each run; merge them and --reanalyse.
set -uo pipefail
out="${1:?}"; cache="${2:?}"; shift 2; mkdir -p "$out"
. "$(dirname "$0")/setup.sh"
export PYTHONPATH="$PYTHONPATH:$PWD/experiments/bench"
lscpu | grep -i "model name"; nproc; uptime
IFS=, read -r -a arms <<< "${ARMS:-sync,fixed-k1-grpo,async-k1-grpo,stream-k1-grpo}"
i=0
for s in "$@"; do
  # each invocation runs one seed: rotate its arms by the seed's index so that no arm always runs first or last
  r=$(( i % ${#arms[@]} )); order=$(IFS=,; echo "${arms[*]:r},${arms[*]:0:r}" | sed 's/,$//'); i=$(( i + 1 ))
  ( CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=1 timeout -k 10 "${T:-500}" python3 experiments/bench/bench_tta.py \
      --job longtail --arms "$order" --headline stream-k1-grpo \
      --seeds 1 --first-seed "$s" --steps "${STEPS:-40}" --eval-every "${EVAL_EVERY:-10}" --target-gain 0.04 \
      --warm-seed 0 --warm-cache "$cache" --out "$out/seed$s" --set rollout.stream_slots=128 --threads 2 \
      > "$out/seed$s.log" 2>&1; echo "rc=$?" >> "$out/seed$s.log" ) &
done
wait
uptime
for s in "$@"; do echo "== seed $s"; grep -E "seed [0-9]+:|rc=" "$out/seed$s.log"; done
