#!/usr/bin/env bash
# One nvidia-h200-x2 command (< 10 min): the symmetric-memory probe with host profiles (both GPUs), then
# the GPU cast suite part "casts" on GPU 0 while GPU 1 runs the CUDA variant check + sweep
# (scripts/gpu/sweep_cuda_cast.sh). Results: $OUT/results.tar.gz.
source "$(dirname "$0")/lease_common.sh"
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
trap 'tar czf "$OUT/results.tar.gz" -C /tmp res' EXIT
step() { local name=$1 limit=$2; shift 2; local t0=$(date +%s)
  timeout "$(lim "$limit")" "$@" > "$R/$name.log" 2>&1; local rc=$?
  echo "== $name rc=$rc $(( $(date +%s) - t0 ))s (at $(el)s)"; }
step build 240 python -c "from mxmoe.quant import cuda_cast; cuda_cast.load_extension()"
step probe 120 torchrun --standalone --nproc-per-node 2 scripts/gpu/symm_probe.py --rows 8192,131072 --cprofile \
  --json "$R/probe.json"
grep -vE "^(W|I)[0-9]{4}" "$R/probe.log" | grep -v "^ *$" | tail -110 | cut -c1-170
CUDA_VISIBLE_DEVICES=1 OUT="$R/sweep" bash scripts/gpu/sweep_cuda_cast.sh > "$R/sweep.log" 2>&1 & SW=$!
step casts 420 env CUDA_VISIBLE_DEVICES=0 python -m pytest -v -n 12 -p no:cacheprovider --tb=short --durations=10 \
  tests/quant/test_casts.py tests/quant/test_cast_compile.py tests/quant/test_casts_gpu.py tests/quant/test_dim0_out.py
echo "casts: $(grep -c ' PASSED' "$R/casts.log") passed, $(grep -c ' FAILED' "$R/casts.log") failed; $(tail -n 1 "$R/casts.log")"
grep -E " FAILED|^E  " "$R/casts.log" | cut -c1-200 | head -12
grep -E "test_gpu_kernels_available|test_dim0_gpu\[floor" "$R/casts.log" | grep -c PASSED
wait $SW; echo "== sweep (GPU 1) at $(el)s"; grep -E "rc=|FAILED|AssertionError|passed|failed" "$R/sweep.log" | head -12
grep -E "dequant" "$R/sweep.log" | head -40 | cut -c1-150
echo "== all done at $(el)s"
