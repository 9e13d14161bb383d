#!/usr/bin/env bash
# One H200, ~3-4 minutes: build the CUDA cast extension, check every kernel variant bit for bit
# against torch_cast (tests/quant/test_cuda_cast.py -k variants), bench every variant.
# Usage (device tool): bash scripts/gpu/sweep_cuda_cast.sh     (results in $OUT)
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/mxmoe_out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/env.txt"
t0=$(date +%s)
python -c "from mxmoe.quant import cuda_cast; cuda_cast.load_extension(); print('cuda ext built')" > "$OUT/build.log" 2>&1
echo "build rc=$? in $(( $(date +%s) - t0 ))s"; tail -3 "$OUT/build.log"
t0=$(date +%s)
timeout 100 python -m pytest -q -m gpu -n 8 -p no:cacheprovider --tb=short tests/quant/test_cuda_cast.py \
  -k "variants" > "$OUT/variants_tests.log" 2>&1
echo "variant bit-exactness rc=$? in $(( $(date +%s) - t0 ))s"
grep -E "^(FAILED|ERROR)|AssertionError" "$OUT/variants_tests.log" | cut -c1-240 | head -30
tail -1 "$OUT/variants_tests.log"
t0=$(date +%s)
timeout 150 python scripts/gpu/sweep_cuda_cast.py --json "$OUT/sweep_cuda_cast.json" > "$OUT/sweep.txt" 2>&1
echo "sweep rc=$? in $(( $(date +%s) - t0 ))s"
tail -80 "$OUT/sweep.txt"
