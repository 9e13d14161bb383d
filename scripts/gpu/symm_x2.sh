#!/usr/bin/env bash
# One nvidia-h200-x2 command (< 10 min): the symmetric-memory probe (stage times), the all-to-all GPU
# tests (symmetric memory in both modes, and NCCL), the all-to-all table (symm copy / store, NCCL), a short
# expert-parallel MXFP8 training run (EP=2, transport auto), then CUDA cast tests on GPU 0: every dequantize
# variant (quick), and one class of every variant (`test_variants_bitwise[zeros]`, which never finished
# before) in one process with a faulthandler dump after 60 s (where it is stuck).
# Results: $OUT/results.tar.gz. PROBE= EP= VARIANTS= (empty) skip those steps; DIMS=5120,7168 for the
# table; TRANSPORTS=symm-copy,nccl; PROBE_ROWS=131072.  Usage (device tool, kind nvidia-h200-x2): bash scripts/gpu/symm_x2.sh
source "$(dirname "$0")/lease_common.sh"
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
trap 'tar czf "$OUT/results.tar.gz" -C /tmp res' EXIT
TR="torchrun --standalone --nproc-per-node 2"
step() { local name=$1 limit=$2; shift 2; local t0=$(date +%s)
  timeout "$(lim "$limit")" "$@" > "$R/$name.log" 2>&1; local rc=$?
  echo "== $name rc=$rc $(( $(date +%s) - t0 ))s (at $(el)s)"; }
nvidia-smi topo -m | head -4 > "$R/topo.txt"
step build 240 python -c "from mxmoe.quant import cuda_cast; cuda_cast.load_extension()"
step comm_tests 200 python -m pytest -v -m gpu -p no:cacheprovider --tb=short tests/comm
grep -E "(PASSED|FAILED|ERROR)|^E  |passed|failed" "$R/comm_tests.log" | cut -c1-220 | tail -25
step a2a 240 $TR -m mxmoe bench a2a --dims ${DIMS:-5120} --transport ${TRANSPORTS:-symm-copy,symm-store,nccl} --chunks auto --json "$R/a2a_2.json"
grep -E "^\| (forward|both)|exact|MISMATCH" "$R/a2a.log" | cut -c1-200
[ -n "${PROBE-1}" ] && step probe 150 $TR scripts/gpu/symm_probe.py --rows ${PROBE_ROWS:-8192,131072} --json "$R/probe.json"
grep -E "^\|" "$R/probe.log" | cut -c1-120
[ -n "${VARIANTS-1}" ] && step dequant_variants 120 env CUDA_VISIBLE_DEVICES=0 python -m pytest -q -m gpu -p no:cacheprovider \
  --tb=short --durations=5 tests/quant/test_cuda_cast.py -k dequant_variants
tail -8 "$R/dequant_variants.log" | cut -c1-200
[ -n "${VARIANTS-1}" ] && step variants_zeros 100 env CUDA_VISIBLE_DEVICES=0 python -m pytest -q -m gpu -p no:cacheprovider \
  --tb=short -o faulthandler_timeout=60 "tests/quant/test_cuda_cast.py::test_variants_bitwise[zeros]"
grep -E "File|passed|failed|Error" "$R/variants_zeros.log" | grep -v site-packages | cut -c1-200 | head -30
[ -n "${EP-1}" ] && step ep2_mxfp8 120 $TR -m mxmoe train --config configs/moe_1b_ep2.toml --model.converters=mx \
  --mx.recipe_name=mxfp8_rceil --parallelism.expert_parallel_degree=2 --training.steps=30 --metrics.log_freq=5 \
  --metrics.progress_bar=false --training.val_interval=1000 --metrics.folder="$R/ep2_mxfp8"
tail -2 "$R/ep2_mxfp8/"*.jsonl 2>/dev/null | cut -c1-300; grep -iE "error|Traceback" "$R/ep2_mxfp8.log" | head -5
echo "== all done at $(el)s"
