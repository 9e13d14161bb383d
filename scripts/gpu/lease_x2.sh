#!/usr/bin/env bash
# One nvidia-h200-x2 lease, under 10 minutes: the GPU suite split over both GPUs (GPU 0: the CUDA
# cast tests; GPU 1: every other cast, op, module and bench test), then the cast table with the default
# kernels (GPU 1) and an all-to-all profile (both GPUs). Results: $OUT/results.tar.gz.
# Usage (device tool, kind nvidia-h200-x2): bash scripts/gpu/lease_x2.sh
source "$(dirname "$0")/lease_common.sh"
trap 'tar czf "$OUT/results.tar.gz" -C /tmp res' EXIT
python -c "from mxmoe.quant import cuda_cast; cuda_cast.load_extension()" > "$R/build.log" 2>&1
echo "== cuda extension build rc=$? at $(el)s"
suite() {  # NAME GPUS WORKERS pytest-args...
  local name=$1 gpus=$2 n=$3; shift 3
  CUDA_VISIBLE_DEVICES=$gpus timeout "$(lim 330)" python -m pytest -v -n "$n" -p no:cacheprovider --tb=short "$@" \
    > "$R/$name.log" 2>&1
  echo "== $name rc=$? at $(el)s: $(grep -c ' PASSED' "$R/$name.log") passed, $(grep -c ' FAILED' "$R/$name.log") failed,"\
    "$(grep -c ' ERROR' "$R/$name.log") errors; $(tail -n 1 "$R/$name.log" | cut -c1-120)"
  grep -E " FAILED|^E  " "$R/$name.log" | cut -c1-200 | head -12
}
suite cuda 0 14 tests/quant/test_cuda_cast.py & P0=$!
suite rest 1 14 tests/quant/test_casts.py tests/quant/test_cast_compile.py tests/quant/test_casts_gpu.py \
  tests/quant/test_triton_cast.py tests/ops tests/nn tests/bench
CUDA_VISIBLE_DEVICES=1 timeout "$(lim 150)" python -m mxmoe bench cast --kernel cuda --kernel triton --scaling all \
  --iters 50 --json "$R/cast_table.json" > "$R/cast_table.txt" 2>&1
echo "== cast table rc=$? at $(el)s"; grep -E "^\||copy bandwidth" "$R/cast_table.txt"
wait $P0
timeout "$(lim 60)" torchrun --standalone --nproc-per-node 2 -m mxmoe bench a2a --batches 16 --dims 5120 \
  --chunks auto,2 --no-check --json "$R/a2a_16.json" > "$R/a2a_16.log" 2>&1
echo "== a2a 16x rc=$? at $(el)s"; grep -E "^\| (forward|both)" "$R/a2a_16.log"
timeout "$(lim 60)" torchrun --standalone --nproc-per-node 2 -m mxmoe bench a2a --batches 1 --dims 5120 \
  --no-check --profile "$R/a2a_prof" --json "$R/a2a_prof.json" > "$R/a2a_prof.log" 2>&1
echo "== a2a profile rc=$? at $(el)s"; grep -E "^\| (forward|both)" "$R/a2a_prof.log"
rm -f "$R"/a2a_prof/*.json
head -n 40 "$R"/a2a_prof/a2a_mxfp8_*rank0.txt 2>/dev/null | cut -c1-200
echo "== all done at $(el)s"
