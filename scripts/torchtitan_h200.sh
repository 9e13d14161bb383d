#!/usr/bin/env bash
# torchtitan 0.2.2's own trainer on one GPU (an H200), three ways with the same seeds, data and model:
#   bf16    torchtitan's bf16 model
#   mxmoe   --model.converters mxmoe: mxmoe's MX Linear layers and MX grouped experts
#   torchao --model.converters torchao_mxfp8: torchao 0.18's MXFP8 training in its emulated mode
#           (the only one below sm_100; scripts/torchtitan_torchao_peer.py says why torchtitan
#           0.2.2's own "quantize.*.mx" converters cannot run there)
# Model: torchtitan's DeepSeek-V3 debug MoE (`mxmoe config show torchtitan/deepseek_v3_debug_0.2`), batch
# 8 x 2048 tokens, AdamW, eager (no torch.compile). Both MX runs convert the same modules: the
# routed experts, the dense and shared-expert feed-forward layers (--mx.filter_fqns default).
#
#   scripts/torchtitan_h200.sh OUT_DIR [STEPS=300] [RUN_TIMEOUT_S=140] [SEEDS=0,1,2] [VARIANTS=bf16,mxmoe,torchao] [FLAGS...]
#
# Speed comparisons (issue 54): REPEATS=N runs every seed x variant N times, interleaved in time
# (bf16, mxmoe, ...; every other round in reverse: ..., mxmoe, bf16), as VARIANT_sSEED_rR; BEFORE=DIR adds the variant
# mxmoe_before, mxmoe from another tree (DIR holds its `mxmoe` package: `git archive REV mxmoe | tar
# -x -C DIR`); FLAVOR=mxmoe_ep trains the wider DeepSeek-V3 of scripts/torchtitan_ep_flavor.py
# (dim 5120, 16 experts of 2048, top-8: 2.1 B parameters), whose step is the GPU's, not the host's.
#   DETERMINISTIC=0 REPEATS=3 BEFORE=.before bash scripts/torchtitan_h200.sh OUT 100 120 0 bf16,mxmoe,mxmoe_before
#
# FLAGS (after the five positional arguments) go to every run, e.g. `--profiling.enable_profiling
# --profiling.profile_freq 10` (then `mxmoe bench trace OUT_DIR/RUN/profile_trace/*/rank0_trace.json`
# gives GPU ms per step by kernel category).
# Each variant runs once per seed (--debug.seed), with torchtitan's deterministic mode
# (--debug.deterministic; DETERMINISTIC=0 turns it off); PARALLEL=N runs N of them at once on the
# GPU (default 1; the debug model takes a few GiB of the H200's 139), each in its own process and
# folder, under its own RUN_TIMEOUT_S. Writes OUT_DIR/VARIANT_sSEED.log
# (torchtitan's logs), .csv (step, loss, grad_norm, tps) and OUT_DIR/summary.md (per run, and per
# variant the mean and standard deviation over the seeds; with seeds and `--metrics.log_freq 1`,
# time to target and the loss at the horizon: scripts/torchtitan_summary.py). A run
# longer than RUN_TIMEOUT_S is stopped and summarized with the steps it logged.
#
# Needs no network: torchtitan 0.2.2, torchao 0.18 and the run-time dependencies the GPU image
# lacks are installed from wheels in .whl/ at the repository root into /tmp/site (--target; the
# image's Python is not touched); the text data (the Python standard library's sources) and a
# byte-level tokenizer are written by mxmoe.integrations.torchtitan.data into a /tmp folder.
set -euo pipefail

# a bad argument stops the call here, exit 2 naming it, before anything is installed or run (every
# run would fail on it, and the call exit 0)
die() { echo "torchtitan_h200.sh: $*" >&2; exit 2; }
[ -n "${1:-}" ] || die "usage: scripts/torchtitan_h200.sh OUT_DIR [STEPS=300] [RUN_TIMEOUT_S=140] [SEEDS=0,1,2] [VARIANTS=bf16,mxmoe,torchao]"
OUT=$1
STEPS=${2:-300}
RUN_TIMEOUT=${3:-140}
IFS=, read -r -a SEEDS <<< "${4:-0,1,2}"
IFS=, read -r -a VARIANTS <<< "${5:-bf16,mxmoe,torchao}"
shift $(( $# < 5 ? $# : 5 ))
EXTRA=("$@")
[[ $STEPS =~ ^[1-9][0-9]*$ ]] || die "STEPS=$STEPS: expected a number of training steps >= 1"
[[ $RUN_TIMEOUT =~ ^[1-9][0-9]*$ ]] || die "RUN_TIMEOUT_S=$RUN_TIMEOUT: expected seconds per run >= 1"
for s in "${SEEDS[@]}"; do
    [[ $s =~ ^[0-9]+$ ]] || die "SEEDS: '$s' is not a seed; expected a comma list of integers >= 0, e.g. 0,1,2"
done
for v in "${VARIANTS[@]}"; do
    case $v in
        bf16|mxmoe|torchao) ;;
        mxmoe_before) [ -d "${BEFORE:-}/mxmoe" ] || { echo "variant mxmoe_before: BEFORE=${BEFORE:-} must be a folder holding an mxmoe package" >&2; exit 2; } ;;
        *) echo "variant '$v': expected bf16, mxmoe, mxmoe_before or torchao" >&2; exit 2 ;;
    esac
done
REPEATS=${REPEATS:-1}
[[ $REPEATS =~ ^[1-9][0-9]*$ ]] || { echo "REPEATS=$REPEATS: expected a number of runs >= 1" >&2; exit 2; }
[ -z "${BEFORE:-}" ] || [ -d "$BEFORE" ] || die "BEFORE=$BEFORE: no such folder; expected one holding an mxmoe package"
[ -z "${BEFORE:-}" ] || BEFORE=$(cd "$BEFORE" && pwd)
MODEL=()  # the model's flags; torchao's peer is registered by the flavor's module too
PEER=torchtitan_torchao_peer
case ${FLAVOR:-} in
    "") ;;
    mxmoe_ep) MODEL=(--model.flavor mxmoe_ep --experimental.custom_import torchtitan_ep_flavor); PEER="" ;;
    *) echo "FLAVOR=$FLAVOR: expected mxmoe_ep (or unset: the debug model)" >&2; exit 2 ;;
esac
DET=()
[ "${DETERMINISTIC:-1}" = 0 ] || DET=(--debug.deterministic)
PARALLEL=${PARALLEL:-1}
[[ $PARALLEL =~ ^[1-9][0-9]*$ ]] || { echo "PARALLEL=$PARALLEL: expected a number of runs >= 1" >&2; exit 2; }
# Runs at once must fit the GPU's memory (a run that does not gets "CUDA out of memory" at its start
# or later): the debug model's processes at 8 x 2048 (GiB, CUDA context included), measured on one
# H200 and one H100 on 2026-12-07: in deterministic mode mxmoe 26.3 (torchtitan's "memory" 25.1 GiB
# reserved), torchao's emulated MXFP8 26.3, bf16 at least 13.2 (11.2 held when a 2 GiB allocation
# failed); without it bf16 and mxmoe 5.6 / 5.2 reserved. With PARALLEL > 1 the PARALLEL largest of
# those (+ a margin) must fit in the GPU's memory (nvidia-smi), or the call stops here. Runs of
# another call on the same GPU are not counted: run those apart.
if [ "$PARALLEL" -gt 1 ] && [ -z "${FLAVOR:-}" ] && command -v nvidia-smi > /dev/null; then
    total=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1 | tr -d ' ')
    if [[ $total =~ ^[0-9]+$ ]]; then
        needs=()
        for v in "${VARIANTS[@]}"; do
            for _ in $(seq 1 $(( ${#SEEDS[@]} * ${REPEATS:-1} ))); do
                case $v,${DETERMINISTIC:-1} in
                    torchao,*|mxmoe*,1) needs+=(28) ;;
                    bf16,1) needs+=(15) ;;
                    *) needs+=(7) ;;
                esac
            done
        done
        # largest first: the most memory PARALLEL runs at once can hold
        mapfile -t needs < <(printf '%s\n' "${needs[@]}" | sort -rn)
        sum=0 fit=0 n=0
        for g in "${needs[@]}"; do
            n=$((n + 1)); sum=$((sum + g))
            [ $((sum * 1024)) -le "$total" ] && fit=$n
            [ "$n" -lt "$PARALLEL" ] || break
        done
        [ $((sum * 1024)) -le "$total" ] || die "PARALLEL=$PARALLEL: that many of these runs at once need up to ~$sum GiB (deterministic: 15 a bf16 run, 28 an mxmoe or torchao one; else 7, torchao 28) and the GPU has $((total / 1024)) GiB; at most $fit at once fit (or run torchao apart)"
    fi
fi
REPO=$(cd "$(dirname "$0")/.." && pwd)
PY=python3
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd) && [ -w "$OUT" ] || die "OUT_DIR=$OUT: cannot create or write in the folder"
cd "$REPO"

if compgen -G ".whl/*.whl" > /dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$REPO:$REPO/scripts
else
    echo "no .whl/ folder: using the installed torchtitan 0.2.x and torchao" >&2
    export PYTHONPATH=$REPO:$REPO/scripts${PYTHONPATH:+:$PYTHONPATH}
fi
"$PY" - <<'EOF' | tee "$OUT/versions.txt"
import importlib.metadata as md
import torch
gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
print("torch", torch.__version__, "|", gpu, "|", *(f"{p} {md.version(p)}" for p in ("torchtitan", "torchao", "datasets")))
EOF

# each run imports its tree's mxmoe (PYTHONSAFEPATH: `python -m` would put this checkout first)
for tree in "$REPO" ${BEFORE:+"$BEFORE"}; do
    [ "$tree" = "$REPO" ] || [[ " ${VARIANTS[*]} " == *" mxmoe_before "* ]] || continue
    got=$(PYTHONSAFEPATH=1 PYTHONPATH=$tree:$PYTHONPATH "$PY" -c \
        "import mxmoe, os; print(os.path.realpath(os.path.dirname(mxmoe.__file__)))")
    [ "$got" = "$(realpath "$tree/mxmoe")" ] || { echo "PYTHONPATH=$tree imports mxmoe from $got, not $tree/mxmoe" >&2; exit 2; }
done

WORK=$(mktemp -d /tmp/torchtitan_h200.XXXXXX)  # data (~33 MB) and tokenizer: not results, kept out of OUT_DIR
"$PY" -m mxmoe.integrations.torchtitan.data "$WORK/data" --tokenizer "$WORK/tokenizer"
# mxmoe's CUDA cast kernels are built on first use (~30 s, cached under TORCH_EXTENSIONS_DIR):
# build them now, outside the timed runs, each tree in a folder of its own (the build names the
# sources' absolute paths: two trees sharing one folder would rebuild it at every other run);
# "auto" falls back to Triton where they cannot build.
EXT_BASE=${TORCH_EXTENSIONS_DIR:-$HOME/.cache/torch_extensions}
ext_dir() { echo "$EXT_BASE/tree_$(echo "$1" | cksum | cut -d' ' -f1)"; }
for tree in "$REPO" ${BEFORE:+"$BEFORE"}; do
    [ "$tree" = "$REPO" ] || [[ " ${VARIANTS[*]} " == *" mxmoe_before "* ]] || continue
    TORCH_EXTENSIONS_DIR=$(ext_dir "$tree") PYTHONSAFEPATH=1 PYTHONPATH=$tree:$PYTHONPATH "$PY" - <<'EOF'
from mxmoe.quant import cuda_cast
try:
    cuda_cast.load_extension()
    print(f"mxmoe's CUDA cast kernels ({cuda_cast.__file__}): built")
except RuntimeError as e:
    print(f"mxmoe's CUDA cast kernels did not build, 'auto' takes the Triton ones: {str(e)[:300]}")
EOF
done

run() {  # run NAME SEED [trainer flags...]; TREE=DIR: mxmoe from that folder
    local name=$1 seed=$2; shift 2
    echo "== $name: $STEPS steps (at most ${RUN_TIMEOUT}s)"
    local t0=$SECONDS rc=0
    TORCH_EXTENSIONS_DIR=$(ext_dir "${TREE:-$REPO}") PYTHONSAFEPATH=1 PYTHONPATH=${TREE:+$TREE:}$PYTHONPATH timeout -k 15 "$RUN_TIMEOUT" "$PY" -m torch.distributed.run --standalone --nproc_per_node 1 \
        -m torchtitan.train \
        --job.config_file "$("$PY" -m mxmoe config path torchtitan/deepseek_v3_debug_0.2)" \
        --job.dump_folder "$OUT/$name" \
        --model.hf_assets_path "$WORK/tokenizer" \
        --training.dataset_path "$WORK/data" \
        --training.steps "$STEPS" \
        --debug.seed "$seed" "${DET[@]}" "${MODEL[@]}" \
        "$@" "${EXTRA[@]}" > "$OUT/$name.log" 2>&1 || rc=$?
    echo "   exit $rc after $((SECONDS - t0))s; last step line:"
    grep -a "step:" "$OUT/$name.log" | tail -1 | sed 's/\x1b\[[0-9;]*m//g' || echo "   (none: see $OUT/$name.log)"
}

RUNS=() PIDS=()
for r in $(seq 1 "$REPEATS"); do  # repeat-major, then seed-major: an interrupted call leaves whole rounds
    for seed in "${SEEDS[@]}"; do
        # every other round in reverse (bf16, mxmoe, before; before, mxmoe, bf16; ...): no variant
        # always runs first, last or right after the same one (an order effect would pass for speed)
        nv=${#VARIANTS[@]}
        for j in $(seq 0 $((nv - 1))); do
            v=${VARIANTS[$(( r % 2 ? j : nv - 1 - j ))]}
            while [ "$(jobs -rp | wc -l)" -ge "$PARALLEL" ]; do wait -n || true; done
            name=${v}_s$seed
            [ "$REPEATS" = 1 ] || name+=_r$r
            case $v in
                bf16) run "$name" "$seed" & ;;
                mxmoe) run "$name" "$seed" --model.converters mxmoe & ;;
                mxmoe_before) TREE=$BEFORE run "$name" "$seed" --model.converters mxmoe & ;;
                torchao) run "$name" "$seed" --model.converters torchao_mxfp8 \
                    ${PEER:+--experimental.custom_import $PEER} & ;;
            esac
            PIDS+=($!) RUNS+=("$name")
        done
    done
done
for pid in "${PIDS[@]}"; do wait "$pid" || true; done

"$PY" scripts/torchtitan_summary.py "$OUT" "${RUNS[@]}"
