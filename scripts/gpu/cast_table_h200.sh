#!/usr/bin/env bash
# One nvidia-h200 command (< 10 min): build the CUDA cast extension, the cast table of docs/benchmarks.md
# (`mxmoe bench cast`, CUDA and Triton, floor and rceil, the same-run copy ceiling) timed per call and
# as CUDA-graph replays (GPU time without the host's per-call cost), the graph-timing test, then the GPU
# training test with MX numerics under torch.compile (TRAIN= skips it). Results: $OUT/results.tar.gz.
# Usage (device tool, kind nvidia-h200): bash scripts/gpu/cast_table_h200.sh
source "$(dirname "$0")/lease_common.sh"
trap 'tar czf "$OUT/results.tar.gz" -C /tmp res' EXIT
step() { local name=$1 limit=$2; shift 2; local t0=$(date +%s)
  timeout "$(lim "$limit")" "$@" > "$R/$name.log" 2>&1; local rc=$?
  echo "== $name rc=$rc $(( $(date +%s) - t0 ))s (at $(el)s)"; }
step build 240 python -c "from mxmoe.quant import cuda_cast; cuda_cast.load_extension()"
for how in eager graph; do
  step "cast_table_$how" 200 python -m mxmoe bench cast --kernel cuda --kernel triton --scaling all --iters 50 \
    $([ $how = graph ] && echo --graph) --json "$R/cast_table_$how.json"
  grep -E "copy|^\|" "$R/cast_table_$how.log" | cut -c1-150 | head -80
done
step graph_test 60 python -m pytest -q -m gpu -p no:cacheprovider tests/bench/test_bench_cast.py
tail -1 "$R/graph_test.log"
[ -n "${TRAIN-1}" ] && step train_compile 200 python -m pytest -q -m gpu -p no:cacheprovider --tb=short \
  "tests/train/test_gpu.py::test_gpu_train_runs_and_learns[mx-compile]"
[ -n "${TRAIN-1}" ] && tail -1 "$R/train_compile.log"
echo "== all done at $(el)s"
