#!/usr/bin/env bash
# GPU checks on a lent single-GPU machine (no network there): throughput benchmark, routing overheads, and short
# training runs of the trainer on CUDA, plain and under the FSDP accelerate config with one process.
#   bash experiments/gpu/smoke.sh OUT_DIR       (needs .whl/ with omegaconf + antlr4 when they are not installed)
# Per-step time limits (s): T_BENCH, T_ROUTING (each default T, else 240) and T_TRAIN (default 180); their sum is the
# worst case. On an H100 (2026-11-27) bench_gpu took 78 s and each bench_routing more than 85 s (both were cut at 85 s),
# so the whole script needs more than one 560 s device call allows unless SKIP_BENCH=1 or limits are cut.
set -uo pipefail
out="${1:-/tmp/gpu_out}"; mkdir -p "$out"
. "$(dirname "$0")/setup.sh"
python3 -c "import offpolicy_moe.algorithms, offpolicy_moe; print('offpolicy_moe from', offpolicy_moe.__file__)"
nvidia-smi -L; uptime
python3 -c "import torch, transformers, accelerate; print('torch', torch.__version__, 'transformers', transformers.__version__, 'accelerate', accelerate.__version__, torch.cuda.get_device_name(0))"
run() { local name="$1"; shift; echo "=== $name: $*"; local t0=$(date +%s); timeout -k 10 "${T:-240}" "$@" > "$out/$name.log" 2>&1; local rc=$?; echo "rc=$rc in $(( $(date +%s) - t0 )) s"; tail -n "${TAILN:-15}" "$out/$name.log"; }
[ -n "${SKIP_BENCH:-}" ] || T="${T_BENCH:-${T:-240}}" run bench_gpu python3 experiments/bench/bench_gpu.py --size 0.9b --device cuda --json "$out/bench_gpu.json"
for fam in qwen3_moe glm4_moe; do
  [ -n "${SKIP_BENCH:-}" ] || T="${T_ROUTING:-${T:-240}}" run "bench_routing_$fam" python3 experiments/bench/bench_routing.py --family "$fam" --device cuda --dtype bfloat16 --layers 16 --hidden 1024 --experts 32 --top-k 4 --json "$out/bench_routing_$fam.json"
done
T="${T_TRAIN:-180}" run train_cuda python3 -m offpolicy_moe train preset=[grpo,tis,r3] trainer.steps=20 run_dir=/tmp/gpu_runs/plain
T="${T_TRAIN:-180}" run train_fsdp1 accelerate launch --config_file experiments/accelerate/fsdp_8gpu.yaml --num_processes 1 -m offpolicy_moe train preset=[grpo,tis,r3] trainer.steps=10 run_dir=/tmp/gpu_runs/fsdp
T="${T_TRAIN:-180}" run train_ddp1 accelerate launch --config_file experiments/accelerate/ddp_8gpu.yaml --num_processes 1 -m offpolicy_moe train preset=[grpo,tis,r3] trainer.steps=10 run_dir=/tmp/gpu_runs/ddp
for d in /tmp/gpu_runs/*; do echo "$d: $(cat $d/summary.json 2>/dev/null | head -c 400)"; cp "$d/summary.json" "$out/summary_$(basename "$d").json" 2>/dev/null; done
