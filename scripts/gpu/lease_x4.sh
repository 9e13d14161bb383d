#!/usr/bin/env bash
# One nvidia-h200-x4 lease, under 10 minutes, everything at once on separate GPUs:
#   GPU 1: bf16 training run, then the 2-GPU test shard (GPUs 0,1), then the CUDA cast variant sweep
#   GPU 2: mxfp8 training run           GPU 3: mxfp8_rceil training run
#   GPU 0: the GPU suite (shards cuda triton casts ops, concurrently), then the Triton config sweep and
#          the compiled torch backend's cast speed
# One training run per GPU, so each run's tokens/s is its own. Results: $OUT/results.tar.gz (logs,
# metrics, profiler tables, sweeps) and $OUT/moe_1b_loss_h200.png.
# Usage (device tool, kind nvidia-h200-x4): bash scripts/gpu/lease_x4.sh
source "$(dirname "$0")/lease_common.sh"
mkdir -p "$R/runs"
finish() { cp "$R/moe_1b_loss_h200.png" "$OUT/" 2>/dev/null; tar czf "$OUT/results.tar.gz" -C /tmp res; }
trap finish EXIT

train() {  # GPU NAME [extra args]
  local gpu=$1 name=$2; shift 2
  CUDA_VISIBLE_DEVICES=$gpu timeout "$(lim 480)" python -m mxmoe train --config configs/moe_1b.toml \
    --training.compile=false --training.steps=500 --training.batch_size=8 --training.seq_len=256 \
    --training.val_interval=250 --metrics.log_freq=25 --metrics.progress_bar=false \
    --metrics.folder="$R/runs/$name" --profiling.enable_profiling --profiling.profile_freq=20 \
    --profiling.profile_active=2 --profiling.save_traces_folder="/tmp/traces/$name" "$@" > "$R/train_$name.log" 2>&1
  echo "== train $name rc=$? done at $(el)s"
  cp /tmp/traces/"$name"/*.txt "$R/runs/$name/" 2>/dev/null
}
train 1 bf16 & P_BF16=$!
python -c "from mxmoe.quant import cuda_cast; cuda_cast.load_extension()" > "$R/build.log" 2>&1
echo "== cuda extension build rc=$? at $(el)s"; tail -3 "$R/build.log"
MX="--model.converters=mx --mx.mxfp8_dim1_cast_kernel_choice=cuda"
train 2 mxfp8 $MX --mx.recipe_name=mxfp8 & P_MX=$!
train 3 mxfp8_rceil $MX --mx.recipe_name=mxfp8_rceil & P_RC=$!

(  # GPU 0: suite shards at once, then the Triton and torch-compiled cast benches
  for s in cuda triton casts ops; do
    CUDA_VISIBLE_DEVICES=0 OUT=$R N=5 LIMIT=$(lim 330) bash scripts/gpu/suite.sh "$s" > "$R/suite_$s.txt" 2>&1 &
  done
  wait; echo "== suite shards done at $(el)s"; cat "$R"/suite_{cuda,triton,casts,ops}.txt
  CFG=$(python -c "from mxmoe.quant import triton_cast as t; print(' '.join('--triton-config ' + c for c in t.CONFIGS))")
  CUDA_VISIBLE_DEVICES=0 timeout "$(lim 110)" python -m mxmoe bench cast --kernel triton $CFG --scaling rceil \
    --iters 20 --warmup 5 --shape 131072x7168 --shape 16384x16384 --json "$R/triton_sweep.json" > "$R/triton_sweep.txt" 2>&1
  echo "== triton config sweep rc=$? at $(el)s"
  CUDA_VISIBLE_DEVICES=0 timeout "$(lim 100)" python -m mxmoe bench cast --kernel torch --scaling rceil --iters 20 \
    --warmup 5 --shape 131072x7168 --json "$R/torch_compiled.json" > "$R/torch_compiled.txt" 2>&1
  echo "== torch compiled cast bench rc=$? at $(el)s"
) & P_G0=$!

wait $P_BF16
CUDA_VISIBLE_DEVICES=0,1 OUT=$R N=4 LIMIT=$(lim 120) bash scripts/gpu/suite.sh multi > "$R/suite_train.txt" 2>&1
echo "== train shard done at $(el)s"; cat "$R/suite_train.txt"
CUDA_VISIBLE_DEVICES=1 timeout "$(lim 160)" python scripts/gpu/sweep_cuda_cast.py --iters 20 \
  --json "$R/cuda_sweep.json" > "$R/cuda_sweep.txt" 2>&1
echo "== cuda variant sweep rc=$? at $(el)s"
wait $P_G0 $P_MX $P_RC
timeout 60 python -m mxmoe plot "$R/runs/bf16" "$R/runs/mxfp8" "$R/runs/mxfp8_rceil" --labels bf16,mxfp8,mxfp8_rceil \
  --out "$R/moe_1b_loss_h200.png" > "$R/plot.log" 2>&1; echo "== plot rc=$?"
for n in bf16 mxfp8 mxfp8_rceil; do
  echo "-- $n"; grep -E "Error|error" "$R/train_$n.log" | head -3; tail -n 3 "$R/runs/$n/metrics.jsonl" | cut -c1-260
done
tail -n 40 "$R/cuda_sweep.txt"; tail -n 30 "$R/triton_sweep.txt"; tail -n 12 "$R/torch_compiled.txt"
echo "== all done at $(el)s"
