#!/usr/bin/env bash
# One H200, <= ~590 s, most important first: build; bf16 vs mxfp8 vs mxfp8_rceil training (500 steps);
# the GPU suite (casts, ops, nn, trainer); linear / grouped GEMM benches; CUDA variant sweep; Triton
# config bench. Everything lands in $OUT. Usage (device tool): bash scripts/gpu/final.sh
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/mxmoe_out}; mkdir -p "$OUT"
T0=$(date +%s)
step() { local name=$1 limit=$2; shift 2; local t0=$(date +%s)
  timeout -s TERM "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo "== $name rc=$rc $(( $(date +%s) - t0 ))s (total $(( $(date +%s) - T0 ))s)"; }
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" | tee "$OUT/env.txt"
step build 90 python -c "from mxmoe.quant import cuda_cast; cuda_cast.load_extension()"
for r in bf16 mxfp8 mxfp8_rceil; do
  mx=""; lim=50; [ "$r" != bf16 ] && { mx="--model.converters=mx --mx.recipe_name=$r --mx.mxfp8_dim1_cast_kernel_choice=cuda"; lim=75; }
  step "train_$r" $lim python -m mxmoe train --config configs/moe_1b.toml $mx --training.compile=false \
    --training.steps=500 --training.batch_size=8 --training.seq_len=256 --training.val_interval=250 \
    --metrics.log_freq=25 --metrics.progress_bar=false --metrics.folder="$OUT/run_$r"
  tail -1 "$OUT/run_$r/metrics.jsonl" 2>/dev/null | cut -c1-250; grep -E "Error|Traceback" "$OUT/train_$r.log" | head -3
done
python -m mxmoe plot "$OUT/run_bf16" "$OUT/run_mxfp8" "$OUT/run_mxfp8_rceil" --labels bf16,mxfp8,mxfp8_rceil \
  --out "$OUT/moe_1b_loss.png" > "$OUT/plot.log" 2>&1; echo "plot rc=$?"
step gpu_tests 170 python -m pytest -q -n 14 -p no:cacheprovider --tb=short tests/quant tests/ops tests/nn \
  tests/bench -k "not soft"
grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | sed 's/ - .*//' | cut -c1-150 | sort | head -30
grep -E "^E  .*(differ|got 0x|Error)" "$OUT/gpu_tests.log" | cut -c1-200 | head -8; tail -1 "$OUT/gpu_tests.log"
step train_tests 40 python -m pytest -q -m gpu -p no:cacheprovider --tb=short tests/train
tail -1 "$OUT/train_tests.log"
step bench_linear 45 python -m mxmoe bench linear --iters 10 --json "$OUT/linear.json"
grep -E "^\||ceiling|GEMM" "$OUT/bench_linear.log" | tail -14
step bench_grouped 45 python -m mxmoe bench grouped_mm --iters 10 --json "$OUT/grouped.json"
grep -E "^\||ceiling|GEMM" "$OUT/bench_grouped.log" | tail -10
step sweep_cuda 60 python scripts/gpu/sweep_cuda_cast.py --json "$OUT/sweep_cuda.json"
tail -40 "$OUT/sweep_cuda.log"
CFGS="--triton-config v0 --triton-config p4 --triton-config p4w --triton-config p4t"
step sweep_triton 50 python -m mxmoe bench cast --kernel triton $CFGS --scaling rceil --iters 20 --warmup 5 \
  --shape 131072x7168 --shape 8x2048x7168 --mode all --json "$OUT/sweep_triton.json"
grep -E "^\|" "$OUT/sweep_triton.log" | tail -32
