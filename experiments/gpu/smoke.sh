#!/usr/bin/env bash
# GPU checks on a lent single-GPU machine (no network there): throughput benchmark, routing overheads, and short
# training runs of the trainer on CUDA, plain and under the FSDP accelerate config with one process.
#   bash experiments/gpu/smoke.sh OUT_DIR       (needs .whl/ with omegaconf + antlr4 when they are not installed)
set -uo pipefail
out="${1:-/tmp/gpu_out}"; mkdir -p "$out"
if ! python3 -c "import omegaconf" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --no-cache-dir --target /tmp/site .whl/* \
    && export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1 WANDB_MODE=disabled HF_HUB_OFFLINE=1
nvidia-smi -L; uptime
python3 -c "import torch, transformers, accelerate; print('torch', torch.__version__, 'transformers', transformers.__version__, 'accelerate', accelerate.__version__, torch.cuda.get_device_name(0))"
run() { local name="$1"; shift; echo "=== $name: $*"; local t0=$(date +%s); timeout "${T:-240}" "$@" > "$out/$name.log" 2>&1; local rc=$?; echo "rc=$rc in $(( $(date +%s) - t0 )) s"; tail -n "${TAILN:-15}" "$out/$name.log"; }
[ -n "${SKIP_BENCH:-}" ] || run bench_gpu python3 experiments/bench/bench_gpu.py --size 0.9b --device cuda --json "$out/bench_gpu.json"
for fam in qwen3_moe glm4_moe; do
  [ -n "${SKIP_BENCH:-}" ] || run "bench_routing_$fam" python3 experiments/bench/bench_routing.py --family "$fam" --device cuda --dtype bfloat16 --layers 16 --hidden 1024 --experts 32 --top-k 4 --json "$out/bench_routing_$fam.json"
done
T=180 run train_cuda python3 -m offpolicy_moe train preset=[grpo,tis,r3] trainer.steps=20 run_dir=/tmp/gpu_runs/plain
T=180 run train_fsdp1 accelerate launch --config_file experiments/accelerate/fsdp_8gpu.yaml --num_processes 1 -m offpolicy_moe train preset=[grpo,tis,r3] trainer.steps=10 run_dir=/tmp/gpu_runs/fsdp
T=180 run train_ddp1 accelerate launch --config_file experiments/accelerate/ddp_8gpu.yaml --num_processes 1 -m offpolicy_moe train preset=[grpo,tis,r3] trainer.steps=10 run_dir=/tmp/gpu_runs/ddp
for d in /tmp/gpu_runs/*; do echo "$d: $(cat $d/summary.json 2>/dev/null | head -c 400)"; done
