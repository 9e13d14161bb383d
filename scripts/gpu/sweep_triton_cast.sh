#!/usr/bin/env bash
# One H200, about 4 minutes: (a) the Triton cast GPU tests (hardware rounding of every tile config,
# both roundings of the default), (b) every Triton tile config on every cast at rceil, then floor
# for the best config of each cast. Logs, JSON and tables land in $OUT; a compact table
# (% of copy bandwidth, config x cast x shape) is printed at the end.
# Usage (device tool): bash scripts/gpu/sweep_triton_cast.sh
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/mxmoe_out}; mkdir -p "$OUT"
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" \
  | tee "$OUT/env.txt"
CONFIGS=$(python -c "from mxmoe.quant import triton_cast as t; print(' '.join(t.CONFIGS))")
echo "configs: $CONFIGS"

t0=$(date +%s)
timeout 120 python -m pytest -q -n 8 -p no:cacheprovider --tb=short -m gpu tests/quant/test_triton_cast.py \
  tests/quant/test_casts_gpu.py -k "test_triton_cast or (triton and not soft)" > "$OUT/tests.log" 2>&1
echo "triton gpu tests rc=$? in $(( $(date +%s) - t0 ))s"
grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | cut -c1-200 | head -20
grep -E "^E  .*(differ|got 0x)" "$OUT/tests.log" | cut -c1-200 | head -10
tail -1 "$OUT/tests.log"

t0=$(date +%s)
CFG_ARGS=""; for c in $CONFIGS; do CFG_ARGS="$CFG_ARGS --triton-config $c"; done
timeout 150 python -m mxmoe bench cast --kernel triton $CFG_ARGS --scaling rceil --iters 20 --warmup 5 \
  --shape 131072x7168 --shape 16384x16384 --shape 8x2048x7168 --json "$OUT/sweep_rceil.json" \
  > "$OUT/sweep_rceil.txt" 2>&1
echo "bench rceil rc=$? in $(( $(date +%s) - t0 ))s"

# floor for the best config (highest mean % of copy over the shapes) of each cast
t0=$(date +%s)
python - "$OUT" <<'PY' > "$OUT/best.txt"
import json, sys, collections
rows = json.load(open(f"{sys.argv[1]}/sweep_rceil.json"))["rows"]
acc = collections.defaultdict(list)
for r in rows:
    if r["% of copy"] is not None:
        acc[(r["mode"].split(" ")[0] if r["mode"].startswith("3d") else r["mode"], r["kernel"])].append(r["% of copy"])
best = {}
for (mode, k), v in acc.items():
    m = sum(v) / len(v)
    if mode not in best or m > best[mode][1]:
        best[mode] = (k[len("triton["):-1], m)
for mode, (cfg, m) in best.items():
    print(mode, cfg, f"{m:.1f}")
PY
cat "$OUT/best.txt"
while read -r mode cfg _; do
  [ "$mode" = dequant ] && continue
  timeout 40 python -m mxmoe bench cast --kernel triton --triton-config "$cfg" --mode "$mode" --scaling floor \
    --iters 20 --warmup 5 --shape 131072x7168 --shape 16384x16384 --shape 8x2048x7168 \
    --json "$OUT/sweep_floor_$mode.json" > "$OUT/sweep_floor_$mode.txt" 2>&1
  echo "bench floor $mode [$cfg] rc=$?"
done < "$OUT/best.txt"
echo "floor runs in $(( $(date +%s) - t0 ))s"

python - "$OUT" <<'PY' | tee "$OUT/summary.txt"
import glob, json, sys
rows, copy = [], None
for f in sorted(glob.glob(f"{sys.argv[1]}/sweep_*.json")):
    d = json.load(open(f)); copy = d["copy_tbs"]; rows += d["rows"]
cols = sorted({(r["mode"], r["shape"], r["scaling"]) for r in rows})
cfgs = sorted({r["kernel"] for r in rows})
cell = {(r["kernel"], r["mode"], r["shape"], r["scaling"]): r for r in rows}
print(f"% of copy bandwidth ({copy:.3f} TB/s); columns: cast shape scaling")
for i, (m, s, sc) in enumerate(cols):
    print(f"  c{i}: {m} {s} {sc}")
print("config".ljust(14) + "".join(f"{'c%d' % i:>7}" for i in range(len(cols))))
for k in cfgs:
    vals = []
    for c in cols:
        r = cell.get((k, *c))
        vals.append("   -  " if r is None else ("  err " if r["% of copy"] is None else f"{r['% of copy']:6.1f}"))
    print(k.ljust(14) + " ".join(vals))
errs = {r["kernel"]: r["note"] for r in rows if r["note"]}
for k, n in errs.items():
    print(f"{k}: {n}")
PY
