#!/usr/bin/env bash
# One H200: build the CUDA extension, run the GPU suite of casts/ops/nn, bench casts.
# Logs and JSON land in $OUT. Usage (device tool): bash scripts/gpu/casts_and_ops.sh
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/mxmoe_out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/env.txt"
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/env.txt"
t0=$(date +%s)
python -c "from mxmoe.quant import cuda_cast; cuda_cast.load_extension(); print('cuda ext built')" > "$OUT/build.log" 2>&1
echo "cuda build rc=$? in $(( $(date +%s) - t0 ))s"; tail -3 "$OUT/build.log"
t0=$(date +%s)
timeout 330 python -m pytest -q -n 12 -p no:cacheprovider --tb=short tests/quant tests/ops tests/nn tests/bench \
  > "$OUT/gpu_tests.log" 2>&1
echo "gpu suite rc=$? in $(( $(date +%s) - t0 ))s"
grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | cut -c1-220 | head -40
tail -2 "$OUT/gpu_tests.log"
timeout 200 python -m mxmoe bench cast --kernel triton --kernel cuda --scaling all --iters 50 \
  --json "$OUT/cast.json" > "$OUT/cast.txt" 2>&1; echo "bench cast rc=$?"
grep -vE "it/s|s/it" "$OUT/cast.txt" | tail -70
