#!/usr/bin/env bash
# One H200 run of the fp8 MX GEMM backend (mxmoe/ops/fp8_gemm.py), about 5 minutes:
#   GPU tests (tests/ops/test_fp8_gemm.py -m gpu) while the tile sweep's kernels compile in parallel,
#   forward GEMM rows (fp8 backend vs bf16 vs torch fp8 row-wise) at the shapes, the tile sweep,
#   and one fwd+bwd row of the MX experts on the fp8 backend. Everything lands under $OUT (default out/).
# Usage, from the repository root on the GPU machine: OUT=out bash scripts/run_fp8_gemm_h200.sh
set -u
OUT=${OUT:-out}
PY=${PY:-python}
mkdir -p "$OUT"
exec > >(tee "$OUT/log.txt") 2>&1  # one text file (the device returns few files): log.txt, pytest.txt, *.json
T0=$(date +%s)
step() { echo "=== [$(( $(date +%s) - T0 )) s] $*"; }
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
step "GPU tests, kernels compiling in parallel"
(timeout 120 $PY -m pytest -m gpu -v -p no:cacheprovider --maxfail=10 -rA tests/ops/test_fp8_gemm.py \
    > "$OUT/pytest.txt" 2>&1; echo "pytest rc=$?" >> "$OUT/pytest.txt") &
TESTS=$!
timeout 110 $PY scripts/sweep_fp8_gemm.py --warm 12 2>&1 | cut -c1-400
echo "warm rc=${PIPESTATUS[0]}"
wait "$TESTS"  # (a bare wait would also wait for the tee of the log)
step "tests done"
grep -E "passed|failed|PASSED|FAILED|Error|error|assert" "$OUT/pytest.txt" | cut -c1-300 | head -40
step "forward, grouped"
timeout 45 $PY -m mxmoe bench grouped_mm --forward --kernel triton --shape 65536x7168x2048x8 \
    --shape 32768x4096x14336x8 --json "$OUT/grouped_fwd.json"
step "forward, dense"
timeout 25 $PY -m mxmoe bench linear --forward --kernel triton --shape 8192x8192x8192 \
    --json "$OUT/linear_fwd.json"
step "tile sweep"
timeout 70 $PY scripts/sweep_fp8_gemm.py --json "$OUT/sweep.json"
step "fwd+bwd grouped, fp8 backend"
timeout 35 $PY -m mxmoe bench grouped_mm --gemm-backend fp8 --recipes mxfp8_rceil --kernel triton \
    --shape 65536x7168x2048x8 --iters 10 --json "$OUT/grouped_fwdbwd_fp8.json"
step "end"
