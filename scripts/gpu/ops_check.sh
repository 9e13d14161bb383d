#!/usr/bin/env bash
# One H200, <= 2 min once the CUDA cast extension is built (casts_and_ops.sh builds it; a cold build
# adds its own time): tests/ops + tests/nn in full (the CPU compile tests too: they failed only on
# the GPU box's torch 2.11), then scripts/gpu/ops_diag.py (compile diagnostics, one line per check).
# Logs land in $OUT. Usage (device tool): bash scripts/gpu/ops_check.sh
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/mxmoe_out}; mkdir -p "$OUT"
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
t0=$(date +%s)
timeout 120 python -c "from mxmoe.quant import cuda_cast; cuda_cast.load_extension()" > "$OUT/ops_build.log" 2>&1
echo "cuda ext rc=$? in $(( $(date +%s) - t0 ))s"
t0=$(date +%s)
timeout 100 python -m pytest -q -n 8 -p no:cacheprovider --tb=short tests/ops tests/nn > "$OUT/ops_tests.log" 2>&1
echo "tests/ops tests/nn rc=$? in $(( $(date +%s) - t0 ))s"
grep -E "^(FAILED|ERROR)|^E  " "$OUT/ops_tests.log" | cut -c1-220 | head -30
tail -1 "$OUT/ops_tests.log"
t0=$(date +%s)
timeout 60 python scripts/gpu/ops_diag.py > "$OUT/ops_diag.log" 2>&1
echo "ops_diag rc=$? in $(( $(date +%s) - t0 ))s"
grep -E "^(torch|\[|ERROR|Traceback)" "$OUT/ops_diag.log" | cut -c1-200 | head -40
