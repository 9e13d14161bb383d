#!/usr/bin/env bash
# One nvidia-h200 command (< 10 min): build the CUDA cast extension, the cast table of docs/benchmarks.md
# (`mxmoe bench cast`, CUDA and Triton, floor and rceil, the same-run copy ceiling), then the GPU
# training test with MX numerics under torch.compile. Results: $OUT/results.tar.gz.
# Usage (device tool, kind nvidia-h200): bash scripts/gpu/cast_table_h200.sh
source "$(dirname "$0")/lease_common.sh"
trap 'tar czf "$OUT/results.tar.gz" -C /tmp res' EXIT
step() { local name=$1 limit=$2; shift 2; local t0=$(date +%s)
  timeout "$(lim "$limit")" "$@" > "$R/$name.log" 2>&1; local rc=$?
  echo "== $name rc=$rc $(( $(date +%s) - t0 ))s (at $(el)s)"; }
step build 240 python -c "from mxmoe.quant import cuda_cast; cuda_cast.load_extension()"
step cast_table 240 python -m mxmoe bench cast --kernel cuda --kernel triton --scaling all --iters 50 \
  --json "$R/cast_table.json"
grep -E "copy|^\|" "$R/cast_table.log" | cut -c1-150 | head -80
step train_compile 200 python -m pytest -q -m gpu -p no:cacheprovider --tb=short --durations=3 \
  "tests/train/test_gpu.py::test_gpu_train_runs_and_learns[mx-compile]"
grep -E "^(FAILED|ERROR)|^E  |passed|failed" "$R/train_compile.log" | cut -c1-200 | tail -12
echo "== all done at $(el)s"
