#!/usr/bin/env bash
# The test suite on a CUDA machine (an H100/H200), part by part, each part under a time limit.
#
#   bash scripts/gpu/suite.sh                   # every tests/ package in turn: quant, comm, ops, ...
#   bash scripts/gpu/suite.sh tests/quant       # one package (any pytest path works)
#   MARK=gpu bash scripts/gpu/suite.sh          # only the GPU-only tests (`@pytest.mark.gpu`)
#
# On a GPU every test runs its CUDA cases too (parametrized by backend and device); GPU-only tests
# are marked `gpu` and skipped on CPU machines. The multi-GPU tests need 2 GPUs and skip with fewer.
# Each part's full log goes to $OUT/<part>.log (OUT defaults to ./gpu-suite); one summary line per part
# is printed. LIMIT (s, default 540) bounds each part; N (default 8) pytest-xdist workers if installed.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-gpu-suite}; mkdir -p "$OUT"
# without a GPU every CUDA case skips and each part passes: a green run that tested no kernel
python -c "import torch, sys; sys.exit(not torch.cuda.is_available())" || {
  echo "suite.sh runs the tests on a CUDA machine, and torch sees no GPU here" \
    "(CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES-unset}); on CPU run pytest itself" >&2; exit 2; }
parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(tests/quant tests/comm tests/ops tests/nn tests/models tests/train tests/bench)
xdist=()
python -c "import xdist" 2>/dev/null && xdist=(-n "${N:-8}")
mark=()
[ -n "${MARK:-}" ] && mark=(-m "$MARK")
# Build the CUDA extension once, before the workers race for it.
python -c "from mxmoe.quant import cuda_cast; cuda_cast.load_extension()" > "$OUT/build.log" 2>&1 \
  || { echo "CUDA extension build failed:"; tail -5 "$OUT/build.log"; }
status=0
for part in "${parts[@]}"; do
  name=$(echo "$part" | tr '/:' '__')
  t0=$(date +%s)
  timeout "${LIMIT:-540}" python -m pytest -q -p no:cacheprovider --tb=short "${xdist[@]}" "${mark[@]}" \
    "$part" > "$OUT/$name.log" 2>&1
  rc=$?
  [ $rc -eq 0 ] || [ $rc -eq 5 ] || status=1
  echo "== $part rc=$rc $(( $(date +%s) - t0 ))s: $(tail -n 1 "$OUT/$name.log" | cut -c1-160)"
  grep -E "^FAILED|^ERROR" "$OUT/$name.log" | cut -c1-200 | head -12
done
exit $status
