#!/usr/bin/env bash
# A/B of the training step on one GPU: `mxmoe bench train` rows of bf16 (this tree), MX on another
# tree (BEFORE: a folder holding that tree's `mxmoe` package, e.g. `git archive REV mxmoe | tar -x -C
# DIR`) and MX on this tree, interleaved and repeated (bf16, MX before, MX after; every other round in
# reverse: MX after, MX before, bf16; ...), each row alone in its own process; then per row
# kind the median tokens/s and its ratio to bf16's.
#
#   bash scripts/gpu/ab_train.sh OUT BEFORE CONFIG MODES [REPEATS=1] [trainer flags...]
#   e.g. bash scripts/gpu/ab_train.sh runs/ab .before moe_1b compile,compile_full+graph 3
#
# Writes OUT/<mode>_<kind>_<i>.json (the bench's rows) and OUT/summary.md, of this call's rows only (a
# row's file of an earlier call is removed before the row runs; other files in OUT are not read). BEFORE="" skips the
# before rows; KINDS (default bf16,before,after) picks the row kinds. Each row is bounded by LIMIT
# seconds (default 240); STEPS / WARMUP (default 10 / 3) are the bench's timed and warm-up steps.
set -uo pipefail
# a bad argument stops the call here, exit 2 naming it, before any row (a row would fail on it, or
# a missing BEFORE or OUT folder would drop the before rows or write under /)
die() { echo "ab_train.sh: $*" >&2; exit 2; }
[ $# -ge 4 ] || die "usage: ab_train.sh OUT BEFORE CONFIG MODES [REPEATS] [flags...] (BEFORE may be '')"
OUT=$1 BEFORE=$2 CONFIG=$3 MODES=$4 REPEATS=${5:-1}
shift $(( $# < 5 ? $# : 5 ))
[ -n "$OUT" ] || die "OUT is empty: expected the output folder"
[ -n "$CONFIG" ] || die "CONFIG is empty: expected a config name (mxmoe config list) or a TOML file"
[[ $MODES =~ [^,] ]] || die "MODES='$MODES': expected a comma list of bench train modes, e.g. eager,compile"
[[ $REPEATS =~ ^[1-9][0-9]*$ ]] || die "REPEATS=$REPEATS: expected a number of rounds >= 1"
[[ ${LIMIT:-240} =~ ^[1-9][0-9]*$ ]] || die "LIMIT=$LIMIT: expected seconds per row >= 1"
[[ ${STEPS:-10} =~ ^[1-9][0-9]*$ ]] || die "STEPS=$STEPS: expected a number of timed steps >= 1"
[[ ${WARMUP:-3} =~ ^[1-9][0-9]*$ ]] || die "WARMUP=$WARMUP: expected a number of warm-up steps >= 1"
IFS=, read -r -a KINDS <<< "${KINDS:-bf16,before,after}"
for k in "${KINDS[@]}"; do
    case $k in
        bf16|before|after) ;;
        *) die "KINDS: '$k' is not a row kind; expected a comma list of bf16, before, after" ;;
    esac
done
[ -z "$BEFORE" ] || [ -d "$BEFORE" ] \
    || die "BEFORE=$BEFORE: no such folder; expected one holding an mxmoe package, or '' (no before rows)"
REPO=$(cd "$(dirname "$0")/../.." && pwd)
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd) && [ -w "$OUT" ] || die "OUT=$OUT: cannot create or write in the folder"
[ -z "$BEFORE" ] || BEFORE=$(cd "$BEFORE" && pwd)
cd "$REPO"
export PYTHONUNBUFFERED=1
source scripts/gpu/deps.sh  # .whl/ installed, mxmoe's dependencies checked
BASE=${PYTHONPATH:-}
# Each tree builds its CUDA extension in a folder of its own: the build's command names the
# sources' absolute paths, so trees sharing one folder would rebuild it at every other row.
EXT_BASE=${TORCH_EXTENSIONS_DIR:-$HOME/.cache/torch_extensions}
ext_dir() { echo "$EXT_BASE/tree_$(echo "$1" | cksum | cut -d' ' -f1)"; }
row() {  # row MODE KIND I [flags...]: KIND bf16 | before | after
    local mode=$1 kind=$2 i=$3 tree=$REPO variant=mx rc=0 bf16=()
    shift 3
    # the bf16 rows take the MX rows' flags too: mx.* ones they ignore, as asked (bench train refuses
    # mx.* options without an mx row otherwise)
    [ "$kind" = bf16 ] && variant=bf16 && bf16=(--mx.allow_unconverted=true)
    [ "$kind" = before ] && tree=$BEFORE
    # an earlier call's file of this row would stand for it if the row wrote none
    rm -f "$OUT/${mode}_${kind}_$i.json" "$OUT/${mode}_${kind}_$i.json.wrong_tree"
    # PYTHONSAFEPATH: `python -m` puts the working folder (this checkout) first on sys.path, ahead
    # of PYTHONPATH, and every row would run this checkout's mxmoe
    TORCH_EXTENSIONS_DIR=$(ext_dir "$tree") PYTHONSAFEPATH=1 PYTHONPATH=$tree${BASE:+:$BASE} timeout -k 10 "${LIMIT:-240}" python3 -m mxmoe bench train \
        --config "$CONFIG" --variants "$variant" --modes "$mode" --steps "${STEPS:-10}" --warmup-steps "${WARMUP:-3}" \
        "$@" "${bf16[@]}" --json "$OUT/${mode}_${kind}_$i.json" > "$OUT/${mode}_${kind}_$i.log" 2>&1 || rc=$?
    # the row ran the tree it names (rows of trees that record it), or it is set aside (the summary
    # reads this call's *.json only)
    if [ -f "$OUT/${mode}_${kind}_$i.json" ] && ! python3 - "$OUT/${mode}_${kind}_$i.json" "$tree/mxmoe" <<'PY'
import json, os, sys
rows = json.load(open(sys.argv[1]))["rows"]
sys.exit(any(os.path.realpath(r["mxmoe"]) != os.path.realpath(sys.argv[2]) for r in rows if "mxmoe" in r))
PY
    then
        echo "row $mode $kind $i did not run $tree/mxmoe: set aside as ${mode}_${kind}_$i.json.wrong_tree" >&2
        mv "$OUT/${mode}_${kind}_$i.json" "$OUT/${mode}_${kind}_$i.json.wrong_tree"
        rc=3
    fi
    return $rc
}
for tree in "$REPO" ${BEFORE:+"$BEFORE"}; do  # each tree's rows import that tree's mxmoe, or no row runs
    got=$(PYTHONSAFEPATH=1 PYTHONPATH=$tree${BASE:+:$BASE} python3 -c \
        "import mxmoe, os; print(os.path.realpath(os.path.dirname(mxmoe.__file__)))")
    [ "$got" = "$(realpath "$tree/mxmoe")" ] || { echo "PYTHONPATH=$tree imports mxmoe from $got, not $tree/mxmoe" >&2; exit 2; }
    # on a GPU, the tree's CUDA extension is built now, not inside its first row's warm-up
    TORCH_EXTENSIONS_DIR=$(ext_dir "$tree") PYTHONSAFEPATH=1 PYTHONPATH=$tree${BASE:+:$BASE} python3 -c \
        "import torch; from mxmoe.quant import cuda_cast
torch.cuda.is_available() and cuda_cast.load_extension()" \
        || echo "$tree: the CUDA extension did not build; its rows use the other kernels" >&2
done
IFS=, read -r -a MODE_LIST <<< "$MODES"
ROWS=()  # this call's row files: the summary reads these, not every *.json in OUT
FAILED=()  # rows that failed: the call exits 1 after the summary of the others
[ -n "$BEFORE" ] || KINDS=("${KINDS[@]/before}")
for i in $(seq 1 "$REPEATS"); do
    for m in "${MODE_LIST[@]}"; do
        # every other round in reverse (bf16, before, after; after, before, bf16; ...): no kind always
        # runs first, last or right after the same one (an order effect would pass for a speed one)
        n=${#KINDS[@]}
        for j in $(seq 0 $((n - 1))); do
            k=${KINDS[$(( i % 2 ? j : n - 1 - j ))]}
            [ -n "$k" ] || continue
            row "$m" "$k" "$i" "$@"
            rc=$?
            [ "$rc" = 0 ] || FAILED+=("$m $k $i (rc=$rc, $OUT/${m}_${k}_$i.log)")
            ROWS+=("$OUT/${m}_${k}_$i.json")
            echo "$m $k $i: rc=$rc $(grep -ao '"tokens_per_s": [0-9.]*' "$OUT/${m}_${k}_$i.json" 2>/dev/null)"
        done
    done
done
python3 - "$OUT" "${ROWS[@]}" <<'PY'
import json, os, statistics, sys
out = sys.argv[1]
rows = {}
for f in (f for f in sys.argv[2:] if os.path.exists(f)):  # this call's rows that wrote a file
    mode, kind, _ = os.path.basename(f)[:-5].rsplit("_", 2)
    for r in json.load(open(f))["rows"]:
        if "tokens_per_s" in r:
            rows.setdefault((mode, kind), []).append(r)
lines = ["| mode | kind | runs | median tokens/s | vs bf16 | step ms | host ms | peak GiB | last loss |", "|---|---|---|---|---|---|---|---|---|"]
for mode in sorted({m for m, _ in rows}):
    base = statistics.median(r["tokens_per_s"] for r in rows.get((mode, "bf16"), [])) if (mode, "bf16") in rows else None
    for kind in ("bf16", "before", "after"):
        rs = rows.get((mode, kind))
        if not rs:
            continue
        med = statistics.median(r["tokens_per_s"] for r in rs)
        ratio = f"{med / base:.3f}" if base else ""
        m = lambda k: statistics.median(r[k] for r in rs)
        lines.append(f"| {mode} | {kind} | {len(rs)} | {med:,.0f} | {ratio} | {m('step_ms'):.2f} | {m('host_ms'):.2f} | {m('peak_mem_gib'):.2f} | {' / '.join(repr(r['loss']) for r in rs)} |")
open(os.path.join(out, "summary.md"), "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
# a failed row is missing from the summary's medians: the call says so and fails (exit 0 would read as
# a complete A/B)
if [ ${#FAILED[@]} -gt 0 ]; then
    printf 'ab_train.sh: %d row(s) failed, left out of the summary:\n' "${#FAILED[@]}" >&2
    printf '  %s\n' "${FAILED[@]}" >&2
    exit 1
fi
