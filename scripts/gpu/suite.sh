#!/usr/bin/env bash
# The GPU suite on one H200, in shards, each result line streamed to $OUT/<shard>.log (-v), so a run
# cut off by a time limit still says which tests failed. Usage (device tool):
#   bash scripts/gpu/suite.sh [SHARD...]    shards: casts cuda triton ops train (default: all)
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/mxmoe_out}; mkdir -p "$OUT"
N=${N:-14}
shard_args() {
  case $1 in
    casts) echo tests/quant/test_casts_gpu.py tests/quant/test_casts.py tests/quant/test_cast_compile.py -k "not soft and not triton" ;;
    cuda) echo tests/quant/test_cuda_cast.py ;;
    triton) echo tests/quant/test_triton_cast.py tests/quant/test_casts_gpu.py -k triton ;;
    ops) echo tests/ops tests/nn tests/bench ;;
    train) echo tests/comm tests/train -m gpu ;;
    *) echo "unknown shard $1" >&2; return 1 ;;
  esac
}
python -c "from mxmoe.quant import cuda_cast; cuda_cast.load_extension()" > "$OUT/build.log" 2>&1 || tail -5 "$OUT/build.log"
for name in ${@:-casts cuda triton ops train}; do
  args=$(shard_args "$name") || continue
  t0=$(date +%s)
  eval "timeout ${LIMIT:-240} python -m pytest -v -n $N -p no:cacheprovider --tb=short $args" > "$OUT/$name.log" 2>&1
  echo "== $name rc=$? $(( $(date +%s) - t0 ))s: $(grep -c ' PASSED' "$OUT/$name.log") passed, $(grep -c ' FAILED' "$OUT/$name.log") failed"
  grep -E " FAILED|^E  " "$OUT/$name.log" | cut -c1-200 | head -12
done
