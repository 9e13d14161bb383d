#!/usr/bin/env bash
# Does MXFP8 cost a model loss? bf16, the default MX recipe and torchao's wgrad-in-high-precision
# recipe, 3 seeds each, deterministic, on a corpus that does not repeat (docs/numerics.md).
#
#   bash scripts/gpu/numerics_study.sh STATE_DIR PRESET STEPS [TIME_LIMIT_S=540] [SEEDS=0,1,2]
#
# Variants: bf16 (--model.converters=, whatever the config says) | mx (--model.converters=mx,
# recipe mxfp8_rceil) | mx_wgrad_with_hp (recipe mxfp8_rceil_wgrad_with_hp). Every run: --data.path=python-env (every
# Python file of the environment: ~200M tokens, so a 16x1024-token step reads no token twice for
# ~12k steps; each run logs its epochs), --debug.deterministic=true, validation over 40 batches at
# the end (and every 250 steps, for the curves).
#
# In parts: `mxmoe train` runs one after another (seed-major) into STATE_DIR/runs/VARIANT/seedS, and
# the call starts none after TIME_LIMIT_S; the running one is stopped (SIGTERM: the trainer saves a
# checkpoint) and resumes from it when the same command runs again on the same machine
# (STATE_DIR/ckpt). A finished run gets a `finished` file and its checkpoint is deleted at once
# (moe_2b's is ~23 GB); the same command again skips it, so STATE_DIR carried from an earlier machine
# (its runs/ folder, without ckpt/) continues with the runs not finished there. After every call
# `mxmoe compare --runs` writes STATE_DIR/compare.md and compare.png (the runs finished so far,
# paired by seed with bf16), and STATE_DIR/runs.tar.gz holds the records (metrics, configs, logs).
set -uo pipefail

STATE=${1:?usage: numerics_study.sh STATE_DIR PRESET STEPS [TIME_LIMIT_S=540] [SEEDS=0,1,2]}
PRESET=${2:?preset, e.g. moe_1b}
STEPS=${3:?steps per run}
LIMIT=${4:-540}
IFS=, read -r -a SEEDS <<< "${5:-0,1,2}"
PY=${PY:-python3}
mkdir -p "$STATE"
T0=$SECONDS
status=0

declare -A VARIANTS=(
    [bf16]="--model.converters="
    [mx]="--model.converters=mx"
    [mx_wgrad_with_hp]="--model.converters=mx --mx.recipe_name=mxfp8_rceil_wgrad_with_hp"
)
ORDER=(bf16 mx mx_wgrad_with_hp)
COMMON=(--data.path=python-env --validation.steps=40 --validation.freq=250)

for seed in "${SEEDS[@]}"; do
    for v in "${ORDER[@]}"; do
        run="$STATE/runs/$v/seed$seed"
        [ -f "$run/finished" ] && { echo "== $v seed $seed: finished before"; continue; }
        left=$((LIMIT - (SECONDS - T0)))
        [ "$left" -gt 30 ] || { echo "== time limit: stopping before $v seed $seed"; break 2; }
        echo "== $v seed $seed (at most ${left}s)"
        mkdir -p "$run"
        # SIGTERM at the limit: the trainer saves a checkpoint and exits; KILL 60 s later
        # shellcheck disable=SC2086
        timeout -k 60 "$left" "$PY" -m mxmoe train --config "$PRESET" --training.steps "$STEPS" \
            --debug.seed "$seed" --debug.deterministic=true --metrics.progress_bar=false \
            ${VARIANTS[$v]} "${COMMON[@]}" --checkpoint.folder="$STATE/ckpt/$v/seed$seed" \
            --job.dump_folder "$run" > "$run/train.log" 2>&1
        rc=$?
        tail -n 2 "$run/train.log"
        if [ $rc -eq 0 ]; then
            touch "$run/finished"
            rm -rf "$STATE/ckpt/$v/seed$seed"
        elif [ $rc -ne 124 ]; then
            echo "   exit $rc: see $run/train.log"; status=1
        fi
    done
done

# the tables and plot of every finished run, and their records in one file
args=()
for v in "${ORDER[@]}"; do [ -d "$STATE/runs/$v" ] && args+=(--variant "$v"); done
if [ ${#args[@]} -gt 0 ]; then
    "$PY" -m mxmoe compare --runs "$STATE/runs" --out "$STATE" "${args[@]}" || status=1
    tar -C "$STATE" -czf "$STATE/runs.tar.gz" runs
    echo "== $(find "$STATE/runs" -name finished | wc -l) finished runs recorded in $STATE/runs.tar.gz"
fi
exit $status
