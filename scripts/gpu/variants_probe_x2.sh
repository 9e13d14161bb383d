#!/usr/bin/env bash
# One nvidia-h200-x2 command (< 10 min): every CUDA cast GPU test, every variant included
# (tests/quant/test_cuda_cast.py, GPU 0) while GPU 1 sweeps every CUDA variant; then the symmetric-memory
# probe with host profiles (both GPUs); then the all-to-all table with the own-rows qdq config the probe
# found fastest (MXMOE_QDQ_CONFIG). Results: $OUT/results.tar.gz.
# Usage (device tool, kind nvidia-h200-x2): bash scripts/gpu/variants_probe_x2.sh
source "$(dirname "$0")/lease_common.sh"
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
trap 'tar czf "$OUT/results.tar.gz" -C /tmp res' EXIT
TR="torchrun --standalone --nproc-per-node 2"
step() { local name=$1 limit=$2; shift 2; local t0=$(date +%s)
  timeout "$(lim "$limit")" "$@" > "$R/$name.log" 2>&1; local rc=$?
  echo "== $name rc=$rc $(( $(date +%s) - t0 ))s (at $(el)s)"; }
step build 240 python -c "from mxmoe.quant import cuda_cast; cuda_cast.load_extension()"
CUDA_VISIBLE_DEVICES=1 timeout "$(lim 220)" python scripts/gpu/sweep_cuda_cast.py --iters 20 \
  --json "$R/cuda_sweep.json" > "$R/sweep.txt" 2>&1 & SW=$!
step cuda_tests 240 env CUDA_VISIBLE_DEVICES=0 python -m pytest -q -m gpu -n 4 -p no:cacheprovider --tb=short \
  --durations=8 tests/quant/test_cuda_cast.py
grep -E "^(FAILED|ERROR)|AssertionError" "$R/cuda_tests.log" | cut -c1-220 | head -20
grep -A10 "slowest" "$R/cuda_tests.log" | cut -c1-160; tail -1 "$R/cuda_tests.log"
wait $SW; echo "== sweep rc=$? (at $(el)s)"
grep -E "copy bandwidth|dim1|dim0_dim1|dequant|Error" "$R/sweep.txt" | cut -c1-120 | head -90
step probe 150 $TR scripts/gpu/symm_probe.py --rows 131072 --cprofile --json "$R/probe.json"
grep -vE "^(W|I)[0-9]{4}" "$R/probe.log" | grep -v "^ *$" | tail -100 | cut -c1-170
BEST=$(python -c "
import json; rows = json.load(open('$R/probe.json'))['rows']
q = [r for r in rows if r['stage'].startswith('qdq_own_rows config=')]
b = min(q, key=lambda r: r['ms'])['stage'].split('=')[1]
print(','.join(v.strip() for v in b.strip('()').split(',')))" 2>/dev/null || echo 64,4)
echo "== fastest qdq config: $BEST"
step a2a 200 env MXMOE_QDQ_CONFIG="$BEST" $TR -m mxmoe bench a2a --dims 5120 --transport symm,nccl --chunks auto \
  --json "$R/a2a_2.json"
grep -E "^\| (forward|both)|MISMATCH|Error" "$R/a2a.log" | cut -c1-200
echo "== all done at $(el)s"
