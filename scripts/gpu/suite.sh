#!/usr/bin/env bash
# The GPU suite on H200s, in parts that each fit one device-tool command (10 minutes), every result
# line streamed to $OUT/<part>.log (-v), so a part cut off by its time limit still says what ran.
#   bash scripts/gpu/suite.sh [PART...]      (default: every part, one after another)
# Parts (seen on 2026-11-29, one H200, other jobs sharing the host; give a part its own command):
#   cuda      CUDA cast kernels, default variants, every input class, dequantize variants (1014 tests; ~5 min)
#   variants  every CUDA kernel variant: the slow tests                  (14 tests; > 5 min)
#   casts     public API casts on every GPU backend, inductor, configs   (~890 tests; > 5 min)
#   triton    Triton kernels, hardware and software rounding             (141 tests; ~2-3 min)
#   ops       MX GEMM ops, modules, converter, benches                   (65 tests; 2.6 min, 8 workers)
#   multi     all-to-all over NCCL (needs 2 GPUs), trainer on the GPU    (13 tests; 2 min)
# Selection is by file and marker only (no -k).
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/mxmoe_out}; mkdir -p "$OUT"
N=${N:-14}
part_args() {  # sets the array ARGS
  case $1 in
    cuda) ARGS=(-m "not slow" tests/quant/test_cuda_cast.py) ;;
    variants) ARGS=(-m slow tests/quant/test_cuda_cast.py) ;;
    casts) ARGS=(tests/quant/test_casts.py tests/quant/test_cast_compile.py tests/quant/test_casts_gpu.py) ;;
    triton) ARGS=(tests/quant/test_triton_cast.py) ;;
    ops) ARGS=(tests/ops tests/nn tests/bench) ;;
    multi) ARGS=(-m gpu tests/comm tests/train) ;;
    *) echo "unknown part $1 (cuda variants casts triton ops multi)" >&2; return 1 ;;
  esac
}
python -c "from mxmoe.quant import cuda_cast; cuda_cast.load_extension()" > "$OUT/build.log" 2>&1 || tail -5 "$OUT/build.log"
for name in ${@:-cuda variants casts triton ops multi}; do
  part_args "$name" || continue
  t0=$(date +%s)
  timeout "${LIMIT:-540}" python -m pytest -v -n "$N" -p no:cacheprovider --tb=short --durations=15 "${ARGS[@]}" > "$OUT/$name.log" 2>&1
  echo "== $name rc=$? $(( $(date +%s) - t0 ))s: $(grep -c ' PASSED' "$OUT/$name.log") passed," \
    "$(grep -c ' FAILED' "$OUT/$name.log") failed; $(tail -n 1 "$OUT/$name.log" | cut -c1-120)"
  grep -E " FAILED|^E  " "$OUT/$name.log" | cut -c1-200 | head -12
done
