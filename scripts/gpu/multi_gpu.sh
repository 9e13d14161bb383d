#!/usr/bin/env bash
# Several H200s: comm + trainer GPU tests, the all-to-all tables, expert-parallel training steps.
#   bash scripts/gpu/multi_gpu.sh a   # tests + a2a tables (2 ranks, and 4 if there are 4 GPUs)
#   bash scripts/gpu/multi_gpu.sh b   # chunk sweep, network-bound regime, traces, EP training steps
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/mxmoe_out}; mkdir -p "$OUT"
N=$(nvidia-smi -L | wc -l)
TR="torchrun --standalone --nproc-per-node"
step() { local name=$1 limit=$2; shift 2; local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo "== $name rc=$rc $(( $(date +%s) - t0 ))s"; }
if [ "${1:-a}" = a ]; then
  nvidia-smi topo -m | head -8 | tee "$OUT/topo.txt"
  if [ -z "${SKIP_TESTS:-}" ]; then  # SKIP_TESTS=1: the tests ran already (scripts/gpu/lease_x4.sh)
    step gpu_tests 200 python -m pytest -q -m gpu -p no:cacheprovider --tb=short tests/comm tests/train
    grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_tests.log" | cut -c1-200 | tail -15
  fi
  step a2a_2 150 $TR 2 -m mxmoe bench a2a --dims 5120,7168 --json "$OUT/a2a_2.json"
  grep -vE "^(W|I)[0-9]{4}|it/s" "$OUT/a2a_2.log" | tail -45
  if [ "$N" -ge 4 ]; then
    step a2a_4 150 $TR 4 -m mxmoe bench a2a --dims 5120 --json "$OUT/a2a_4.json"
    grep -vE "^(W|I)[0-9]{4}|it/s" "$OUT/a2a_4.log" | tail -30
  fi
else
  step a2a_chunks 90 $TR 2 -m mxmoe bench a2a --batches 16 --chunks auto,0,2,4,8 --no-check --json "$OUT/a2a_chunks.json"
  grep -vE "^(W|I)[0-9]{4}|it/s" "$OUT/a2a_chunks.log" | tail -14
  NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 step a2a_net 150 $TR 2 -m mxmoe bench a2a --batches 1,4,16 --warmup 2 --iters 20 --no-check --json "$OUT/a2a_net.json"
  grep -vE "^(W|I)[0-9]{4}|it/s" "$OUT/a2a_net.log" | tail -16
  step a2a_prof 60 $TR 2 -m mxmoe bench a2a --batches 4 --dims 5120 --no-check --profile "$OUT/traces"
  for ep in 2 4; do
    [ "$N" -ge "$ep" ] || continue
    for r in bf16 mxfp8; do
      mx=""; [ "$r" != bf16 ] && mx="--model.converters=mx --mx.recipe_name=$r"
      step "ep${ep}_$r" 150 $TR "$ep" -m mxmoe train --config configs/moe_1b_ep2.toml $mx \
        --parallelism.expert_parallel_degree=$ep --training.steps=30 --metrics.log_freq=5 \
        --metrics.progress_bar=false --training.val_interval=1000 --metrics.folder="$OUT/ep${ep}_$r"
      tail -2 "$OUT/ep${ep}_$r/"*.jsonl 2>/dev/null | cut -c1-300; grep -iE "error|Traceback" "$OUT/ep${ep}_$r.log" | head -5
    done
  done
fi
