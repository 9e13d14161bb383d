#!/usr/bin/env bash
# One nvidia-h200 command (< 10 min): build the CUDA cast extension, sweep every CUDA variant (bandwidth vs
# the same-run copy), then every variant's bit-exactness tests in ONE process (`-k variants`: under
# pytest-xdist they ran for minutes; alone they take seconds), then the rest of tests/quant/test_cuda_cast.py
# (default kernels, every input class) with 8 workers. Results: $OUT/results.tar.gz.
# Usage (device tool, kind nvidia-h200): bash scripts/gpu/cuda_casts_h200.sh
source "$(dirname "$0")/lease_common.sh"
trap 'tar czf "$OUT/results.tar.gz" -C /tmp res' EXIT
step() { local name=$1 limit=$2; shift 2; local t0=$(date +%s)
  timeout "$(lim "$limit")" "$@" > "$R/$name.log" 2>&1; local rc=$?
  echo "== $name rc=$rc $(( $(date +%s) - t0 ))s (at $(el)s)"; }
step build 240 python -c "from mxmoe.quant import cuda_cast; cuda_cast.load_extension()"
tail -3 "$R/build.log"
step sweep 170 python scripts/gpu/sweep_cuda_cast.py --iters 20 --json "$R/cuda_sweep.json"
grep -E "copy bandwidth|dim1|dim0_dim1|best|DEFAULT" "$R/sweep.log" | cut -c1-120 | head -70
step variants 200 python -m pytest -q -m gpu -p no:cacheprovider --tb=short --durations=12 \
  tests/quant/test_cuda_cast.py -k variants
grep -E "^(FAILED|ERROR)|AssertionError" "$R/variants.log" | cut -c1-220 | head -20
grep -A14 "slowest" "$R/variants.log" | cut -c1-160; tail -1 "$R/variants.log"
step cuda_tests 240 python -m pytest -q -m gpu -n 8 -p no:cacheprovider --tb=short tests/quant/test_cuda_cast.py \
  -k "not variants"
grep -E "^(FAILED|ERROR)|AssertionError" "$R/cuda_tests.log" | cut -c1-220 | head -20; tail -1 "$R/cuda_tests.log"
echo "== all done at $(el)s"
