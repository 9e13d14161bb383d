#!/usr/bin/env bash
# One short nvidia-h200-x2 command: the store mode's barrier, flags (default) against the symmetric-memory
# handle's (MXMOE_SYMM_BARRIER=torch): build, the two-GPU exactness tests of the symm paths, then the
# all-to-all table once per barrier. Usage (device tool, kind nvidia-h200-x2): bash scripts/gpu/barrier_x2.sh
source "$(dirname "$0")/lease_common.sh"
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1
TR="torchrun --standalone --nproc-per-node 2"
python -c "from mxmoe.quant import cuda_cast; cuda_cast.load_extension()" > "$R/build.log" 2>&1; echo "build rc=$? at $(el)s"
timeout "$(lim 90)" python -m pytest -q -m gpu -p no:cacheprovider --tb=short tests/comm/test_comm_a2a_gpu.py \
  -k "two_gpus and (store or copy-pieces)" 2>&1 | tail -3; echo "tests at $(el)s"
for b in flags torch; do
  MXMOE_SYMM_BARRIER=$b timeout "$(lim 60)" $TR -m mxmoe bench a2a --dims 5120 --transport symm --chunks auto \
    --json "$OUT/a2a_barrier_$b.json" 2>&1 | grep -E "^\| (forward|backward|both)|MISMATCH|Error" | cut -c1-140
  echo "== barrier=$b at $(el)s"
done
