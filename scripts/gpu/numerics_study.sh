#!/usr/bin/env bash
# Does MXFP8 cost a model loss? bf16 against MX recipes, several seeds, deterministic, on a corpus
# that does not repeat, compared by time-to-target across the loss drop (docs/numerics.md).
#
#   bash scripts/gpu/numerics_study.sh STATE_DIR PRESET STEPS [TIME_LIMIT_S=540] [SEEDS=0,1,2] \
#       [VARIANTS=bf16,mx] [PARALLEL=auto] [CKPT_DIR=STATE_DIR/ckpt] [VAL_FREQ=250] [GRACE_S]
#
# Variants: bf16 (--model.converters=) | mx (--model.converters=mx: the default recipe,
# mxfp8_rceil) | mx_wgrad_with_hp (--mx.recipe_name=mxfp8_rceil_wgrad_with_hp). Every run:
# --data.path=python-env (every Python file of the environment: ~378M train tokens, so a 16x1024-token
# step reads no token twice for ~23k steps; each run records its epochs), --debug.deterministic=true,
# validation over 40 batches every VAL_FREQ steps and at the end.
#
# One `mxmoe compare` runs the variants x seeds into STATE_DIR/runs/VARIANT/seedS (seed-major),
# PARALLEL at a time on the one GPU (auto: as many as the GPU's free memory holds at the peak that this
# study's earlier runs recorded, +15 % and 2 GiB each; 1 before any is recorded). It ends every run by
# TIME_LIMIT_S (the whole call's budget, the saves included): a grace before it (1.5 x the longest
# save recorded here + 10 s; 120 s before one is; GRACE_S if longer) the running runs get SIGTERM, save their checkpoint
# into CKPT_DIR/VARIANT/seedS (kept: the latest one) and stop; at the limit whatever still runs is
# killed. The same command again, on the same machine, resumes them from those checkpoints; a run
# that finishes saves no final checkpoint (--checkpoint.last_save=false) and its checkpoint folder is
# deleted (moe_2b's are ~23 GB each), and it is not run again: STATE_DIR/runs carried to another
# machine (without the checkpoints) continues with the runs not finished there. Give STATE_DIR as a
# path relative to the repository (e.g. runs/study_moe_1b): each run's command, which the skip
# compares, holds it.
#
# After every call: STATE_DIR/compare.md, compare.json and compare.png (the runs finished so far:
# time to target, final losses at the horizon, paired differences), STATE_DIR/runs.tar.gz (every
# run's records: metrics, configs, logs, command.json) and the save times the trainers measured.
set -uo pipefail

STATE=${1:?usage: numerics_study.sh STATE_DIR PRESET STEPS [TIME_LIMIT_S=540] [SEEDS=0,1,2] [VARIANTS=bf16,mx] [PARALLEL=auto] [CKPT_DIR] [VAL_FREQ=250] [GRACE_S]}
PRESET=${2:?preset, e.g. moe_1b}
STEPS=${3:?steps per run}
LIMIT=${4:-540}
SEEDS=${5:-0,1,2}
IFS=, read -r -a VARIANTS <<< "${6:-bf16,mx}"
PARALLEL=${7:-auto}
CKPT=${8:-$STATE/ckpt}
VAL_FREQ=${9:-250}
GRACE=()
[ -n "${10:-}" ] && GRACE=(--grace-s "${10}")
PY=${PY:-python3}
mkdir -p "$STATE"

declare -A ARGS=(
    [bf16]="--model.converters="
    [mx]="--model.converters=mx"
    [mx_wgrad_with_hp]="--model.converters=mx --mx.recipe_name=mxfp8_rceil_wgrad_with_hp"
)
variant_args=()
for v in "${VARIANTS[@]}"; do
    [ -n "${ARGS[$v]+x}" ] || { echo "variant '$v': expected one of ${!ARGS[*]}" >&2; exit 2; }
    variant_args+=(--variant "$v=${ARGS[$v]}")
done

if [ "$PARALLEL" = auto ]; then
    # free GPU memory / (the largest peak recorded by this study's runs x 1.15 + 2 GiB)
    PARALLEL=$("$PY" - "$STATE/runs" <<'EOF'
import glob, json, subprocess, sys
peak = 0.0
for f in glob.glob(f"{sys.argv[1]}/*/*/metrics.jsonl"):
    for line in open(f):
        try:
            peak = max(peak, float(json.loads(line).get("memory_gib") or 0))
        except ValueError:
            pass
try:
    free = min(float(x) for x in subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.free", "--format=csv,noheader,nounits"],
        capture_output=True, text=True, check=True).stdout.split()) / 1024
except (OSError, ValueError, subprocess.CalledProcessError):
    free = 0.0
print(max(1, int(free // (peak * 1.15 + 2))) if peak > 0 else 1)
EOF
)
    echo "== PARALLEL=auto: $PARALLEL run(s) at a time (free GPU memory / recorded peak)"
fi

COMMON=(--data.path=python-env --validation.steps=40 --validation.freq="$VAL_FREQ"
        --checkpoint.folder="$CKPT" --checkpoint.interval=0 --checkpoint.last_save=false
        --checkpoint.keep_latest_k=1)
"$PY" -m mxmoe compare --config "$PRESET" --steps "$STEPS" --seeds "$SEEDS" --out "$STATE" \
    "${variant_args[@]}" --baseline "${VARIANTS[0]}" --parallel "$PARALLEL" \
    --time-limit-s "$LIMIT" "${GRACE[@]}" --delete-finished-checkpoints -- "${COMMON[@]}"
rc=$?

echo "== save times measured by the trainers (the next call's grace is 1.5 x the longest + 10 s):"
grep -h "saved in" "$STATE"/runs/*/*/train.log 2>/dev/null | tail -n 12 || true
# compare's status is 1 when a run did not finish, 2 when none did: a stop at the time limit is the
# plan (the same command again goes on); only a run that failed makes this call fail
"$PY" - "$STATE/runs" <<'EOF'
import glob, json, os, sys
failed = 0
for f in sorted(glob.glob(f"{sys.argv[1]}/*/*/command.json")):
    r, run = json.load(open(f)), os.path.dirname(f)
    what = "stopped at the time limit" if r.get("stopped") else (
        "finished" if r.get("returncode") == 0 else f"FAILED (exit {r.get('returncode')}; {run}/train.log)")
    failed += what.startswith("FAILED")
    print(f"== {run}: {what} after {r.get('seconds')} s")
sys.exit(1 if failed else 0)
EOF
status=$?
if [ $rc -ne 0 ] && [ $status -eq 0 ] && ! compgen -G "$STATE/runs/*/*/command.json" > /dev/null; then
    status=$rc  # compare stopped before any run (bad arguments)
fi
[ -d "$STATE/runs" ] && tar -C "$STATE" -czf "$STATE/runs.tar.gz" runs
mkdir -p "$CKPT" && df -h "$CKPT" | tail -n 1 | awk '{print "== checkpoint disk: " $4 " free of " $2}'
echo "== finished runs' records: $STATE/runs (metrics.jsonl, config.json, command.json, train.log), for docs/data/"
exit $status
