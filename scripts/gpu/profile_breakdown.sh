#!/usr/bin/env bash
# Where a training step's GPU time goes, bf16 beside MX, on one GPU: `mxmoe bench train --profile`
# for each config and mode (GPU ms per step by kernel category, and of the MX casts by what they
# cast: weights / activations / gradients / fused SwiGLU; host ms), then torchtitan 0.2.2's trainer on
# its DeepSeek-V3 debug model, bf16 and `--model.converters mxmoe`, profiled (`mxmoe bench trace`).
#
#   bash scripts/gpu/profile_breakdown.sh OUT [CONFIGS=moe_1b,moe_2b] [MODES=compile,compile_full+graph] [TT=1]
#
# Writes OUT/<config>.json and OUT/<config>/ (the bench's rows and profiler tables), OUT/tt/ and
# OUT/tt_trace.json (torchtitan: TT=0 skips it), and OUT/results.tar.gz of all of it after each step;
# each step first removes what an earlier call's same step wrote there (it would pass for this call's).
# The cast split by role needs an ungraphed mode (graph replays record no operators): `compile` gives it.
# Each step is bounded by `timeout` (LIMIT seconds, default 300). Wheels in .whl/ are installed first
# and the dependencies checked (scripts/gpu/deps.sh).
set -uo pipefail
# a bad argument stops the call here, exit 2 naming it (TT=yes skipped torchtitan, a bad LIMIT failed
# every step, an OUT it cannot create put the files under /)
die() { echo "profile_breakdown.sh: $*" >&2; exit 2; }
[ -n "${1:-}" ] || die "usage: profile_breakdown.sh OUT [CONFIGS] [MODES] [TT]"
OUT=$1
IFS=, read -r -a CONFIGS <<< "${2:-moe_1b,moe_2b}"
MODES=${3:-compile,compile_full+graph}
TT=${4:-1}
[[ $TT =~ ^[01]$ ]] || die "TT=$TT: expected 1 (profile torchtitan too) or 0"
[[ ${LIMIT:-300} =~ ^[1-9][0-9]*$ ]] || die "LIMIT=$LIMIT: expected seconds per step >= 1"
REPO=$(cd "$(dirname "$0")/../.." && pwd)
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd) && [ -w "$OUT" ] || die "OUT=$OUT: cannot create or write in the folder"
cd "$REPO"
export PYTHONUNBUFFERED=1 PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
source scripts/gpu/deps.sh  # .whl/ installed, mxmoe's dependencies checked
pack() {  # GNU tar exits 1 when a file changed while read (a log still flushed): the archive stands
    tar -czf "$OUT/results.tar.gz.part" -C "$OUT" --exclude results.tar.gz --exclude results.tar.gz.part . \
        --warning=no-file-changed
    local rc=$?
    if [ $rc -le 1 ]; then mv "$OUT/results.tar.gz.part" "$OUT/results.tar.gz"; else echo "   pack: tar exited $rc" >&2; fi
}
timeout -k 10 300 python3 -c "from mxmoe.quant import cuda_cast; cuda_cast.load_extension()" > "$OUT/build.log" 2>&1 \
    || echo "CUDA extension did not build (auto takes Triton): $(tail -2 "$OUT/build.log")"
for c in "${CONFIGS[@]}"; do
    echo "== bench train $c ($MODES)"
    [ -n "$c" ] || continue
    rm -f "$OUT/$c.json" "$OUT/$c"/*.txt
    timeout -k 10 "${LIMIT:-300}" python3 -m mxmoe bench train --config "$c" --modes "$MODES" --steps 10 \
        --warmup-steps 3 --profile "$OUT/$c" --json "$OUT/$c.json" > "$OUT/$c.log" 2>&1
    echo "   rc=$?"; grep -E "^\| (bf16|mx) " "$OUT/$c.log" | cut -c1-150
    for f in "$OUT/$c"/*.txt; do [ -f "$f" ] && { echo "-- $(basename "$f")"; sed -n '2,3p' "$f" | cut -c1-400; }; done
    pack
done
if [ "$TT" = 1 ]; then
    echo "== torchtitan 0.2.2 DeepSeek-V3 debug, bf16 and mxmoe, profiled"
    rm -rf "$OUT/tt" "$OUT/tt_trace.json" "$OUT/tt_trace.txt"
    DETERMINISTIC=0 timeout -k 10 "${LIMIT:-300}" bash scripts/torchtitan_h200.sh "$OUT/tt" 30 120 0 bf16,mxmoe \
        --profiling.enable_profiling --profiling.profile_freq 10 > "$OUT/tt.log" 2>&1
    echo "   rc=$?"; tail -8 "$OUT/tt/summary.md" 2>/dev/null
    traces=$(ls "$OUT"/tt/*/profile_traces/iteration_30/rank0_trace.json 2>/dev/null)
    [ -n "$traces" ] && python3 -m mxmoe bench trace $traces --json "$OUT/tt_trace.json" > "$OUT/tt_trace.txt" 2>&1
    grep -E "^\| (gemm|mx cast|attention|optimizer|copy|inductor|other|total)" "$OUT/tt_trace.txt" | cut -c1-100
    rm -rf "$OUT"/tt/*/profile_traces  # raw traces: the breakdown above is what is kept
    pack
fi
