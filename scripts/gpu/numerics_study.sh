#!/usr/bin/env bash
# Does MXFP8 cost a model loss? bf16 against MX recipes, several seeds, deterministic, on a corpus
# that does not repeat, compared by time-to-target across the loss drop (docs/numerics.md).
#
#   bash scripts/gpu/numerics_study.sh STATE_DIR PRESET STEPS [TIME_LIMIT_S=540] [SEEDS=0,1,2] [NAME=VALUE...]
#
#   variants=bf16,mx  parallel=auto  devices=  ckpt=STATE_DIR/ckpt  val_freq=250  grace_s=
#
# Variants: bf16 (--model.converters=) | mx (--model.converters=mx: the default recipe,
# mxfp8_rceil) | mx_wgrad_with_hp (--mx.recipe_name=mxfp8_rceil_wgrad_with_hp). Every run:
# --data.path=python-env (every Python file of the environment: ~378M train tokens, so a 16x1024-token
# step reads no token twice for ~23k steps; each run records its epochs), --debug.deterministic=true,
# validation over 40 batches every val_freq steps and at the end.
#
# One `mxmoe compare` runs the variants x seeds into STATE_DIR/runs/VARIANT/seedS (seed-major),
# `parallel` at a time on each GPU (devices=0,1,...: spread over those GPUs; default: the one the
# call sees). parallel=auto: as many as the GPU's free memory holds at the peak that this study's
# earlier runs recorded (x 1.15 + 2 GiB each), 1 before any is recorded. TIME_LIMIT_S is the whole
# call's budget, the saves included: a grace before it (grace_s, default 120 s, raised to 1.5 x the
# longest save recorded here + 10 s) the running runs get SIGTERM, save a checkpoint into
# ckpt/VARIANT/seedS (the latest one kept) and stop (a run whose remaining steps fit before the limit
# at its logged rate, x 1.1 + 15 s, finishes instead); at the limit whatever still runs is killed. The
# same command again, on the same machine, resumes them; a run that finishes saves no final
# checkpoint (--checkpoint.last_save=false), its checkpoint folder is deleted (12 bytes a parameter:
# moe_2b's 23 GB, moe_1b's ~8 GB; ckpt=/dev/shm/... keeps them off a small disk) and it is not run again, so
# STATE_DIR/runs carried to another machine (without the checkpoints) continues with the runs not
# finished there. Give STATE_DIR as a path relative to the repository (e.g. runs/study_moe_1b): each
# run's command, which that skip compares, holds it.
#
# After every call: STATE_DIR/compare.md, compare.json and compare.png (the runs finished so far:
# time to target, final losses at the horizon, paired differences), STATE_DIR/runs.tar.gz (every
# run's records: metrics, configs, logs, command.json) and the save times the trainers measured.
set -uo pipefail

USAGE="usage: numerics_study.sh STATE_DIR PRESET STEPS [TIME_LIMIT_S=540] [SEEDS=0,1,2] [variants=bf16,mx] [parallel=auto] [devices=0,1] [ckpt=DIR] [val_freq=250] [grace_s=S]"
# missing arguments: status 2, as every other refusal here (`${1:?}` exits 1)
[ $# -ge 3 ] && [ -n "$1" ] && [ -n "$2" ] && [ -n "$3" ] || { echo "$USAGE" >&2; exit 2; }
STATE=$1
PRESET=$2
STEPS=$3
LIMIT=${4:-540}
SEEDS=${5:-0,1,2}
shift $(( $# < 5 ? $# : 5 ))
variants=bf16,mx parallel=auto devices="" ckpt=$STATE/ckpt val_freq=250 grace_s=""
for kv in "$@"; do
    case ${kv%%=*} in
        variants|parallel|devices|ckpt|val_freq|grace_s) printf -v "${kv%%=*}" '%s' "${kv#*=}" ;;
        *) echo "'$kv': expected NAME=VALUE, NAME one of variants parallel devices ckpt val_freq grace_s" >&2; exit 2 ;;
    esac
done
IFS=, read -r -a VARIANTS <<< "$variants"
[ ${#VARIANTS[@]} -gt 0 ] || { echo "variants='$variants': expected a comma list of bf16, mx, mx_wgrad_with_hp" >&2; exit 2; }
PY=${PY:-python3}
source "$(dirname "$0")/deps.sh"  # .whl/ installed, mxmoe's dependencies checked
mkdir -p "$STATE"

declare -A ARGS=(
    [bf16]="--model.converters="
    [mx]="--model.converters=mx"
    [mx_wgrad_with_hp]="--model.converters=mx --mx.recipe_name=mxfp8_rceil_wgrad_with_hp"
)
variant_args=()
for v in "${VARIANTS[@]}"; do
    [ -n "$v" ] && [ -n "${ARGS[$v]+x}" ] || { echo "variant '$v': expected one of ${!ARGS[*]}" >&2; exit 2; }
    variant_args+=(--variant "$v=${ARGS[$v]}")
done

par_auto=0
if [ "$parallel" = auto ]; then
    par_auto=1
    # free GPU memory (the least of the devices') / (the largest peak this study's runs recorded x 1.15 + 2 GiB)
    parallel=$("$PY" - "$STATE/runs" "$devices" <<'EOF'
import glob, json, subprocess, sys
peak = 0.0
for f in glob.glob(f"{sys.argv[1]}/*/*/metrics.jsonl"):
    for line in open(f):
        try:
            peak = max(peak, float(json.loads(line).get("memory_gib") or 0))
        except ValueError:
            pass
try:
    rows = subprocess.run(
        ["nvidia-smi", "--query-gpu=index,memory.free", "--format=csv,noheader,nounits"],
        capture_output=True, text=True, check=True).stdout.splitlines()
    free = {i.strip(): float(m) / 1024 for i, m in (r.split(",") for r in rows)}
    want = sys.argv[2].split(",") if sys.argv[2] else list(free)[:1]
    free = min(free[d] for d in want)
except (OSError, ValueError, KeyError, subprocess.CalledProcessError):
    free = 0.0
print(max(1, int(free // (peak * 1.15 + 2))) if peak > 0 else 1)
EOF
)
    echo "== parallel=auto: $parallel run(s) at a time per GPU (free GPU memory / recorded peak)"
fi
# Checkpoint space: a run saves once a call, when the call stops it (no periodic saves), and a resumed
# run's previous checkpoint stays until the new one is written; so the runs that can run at once
# (parallel x GPUs, at most the runs not finished yet) must each find a checkpoint's bytes (12 a
# parameter: fp32 weights and AdamW's two moments) free on ckpt's disk at the call's start, or their
# saves fail at the stop (the older checkpoint kept) and the call's steps are lost. parallel=auto is
# lowered to what fits; a parallel given that does not fit is kept (runs that finish before the stop
# save nothing) with a warning naming the sizes and what fits.
parallel=$("$PY" - "$PRESET" "$ckpt" "$parallel" "$par_auto" "$devices" "$STATE/runs" "$variants" "$SEEDS" <<'EOF'
import json, os, shutil, sys
from mxmoe.train.build import build_model_args
from mxmoe.train.config import ConfigError, load_toml
preset, ckpt, parallel, auto, devices, runs, variants, seeds = sys.argv[1:]
try:
    one = 12 * build_model_args(load_toml(preset)).num_params()[0]
    int(parallel)
except (ConfigError, ValueError):  # compare names a bad config or parallel itself, with its own exit
    print(parallel)
    sys.exit(0)
def finished(run):
    try:
        r = json.load(open(f"{runs}/{run}/command.json"))
    except (OSError, ValueError):
        return False
    return r.get("returncode") == 0 and not r.get("stopped")
left = sum(not finished(f"{v}/seed{s}") for v in variants.split(",") for s in seeds.split(","))
gpus = len(devices.split(",")) if devices else 1
os.makedirs(ckpt, exist_ok=True)
free = shutil.disk_usage(ckpt).free
fits = free // one  # runs at once whose stop-saves fit
at_once = min(int(parallel) * gpus, left)
if at_once <= fits:
    print(parallel)
elif auto == "1" and fits >= gpus:
    print(fits // gpus)
    print(f"== parallel=auto lowered to {fits // gpus}: the checkpoint disk of {ckpt} has {free / 1e9:.1f} GB "
          f"free, {one / 1e9:.1f} GB a run's checkpoint", file=sys.stderr)
else:
    print(parallel)
    print(f"== WARNING parallel={parallel}: {at_once} run(s) at once would each save a {one / 1e9:.1f} GB "
          f"checkpoint (12 bytes x {one // 12:,} parameters) if the call stops them, {at_once * one / 1e9:.1f} GB, "
          f"and {ckpt}'s disk has {free / 1e9:.1f} GB free: at most {fits} fit. A run not finished by the stop "
          "then loses this call's steps (its older checkpoint is kept); lower parallel, or give ckpt= a folder "
          "on a larger disk", file=sys.stderr)
EOF
) || exit 2
extra=()
[ -n "$devices" ] && extra+=(--devices "$devices")
[ -n "$grace_s" ] && extra+=(--grace-s "$grace_s")

marker=$(mktemp) && trap 'rm -f "$marker"' EXIT  # the command.json files this call's runs write are newer
COMMON=(--data.path=python-env --validation.steps=40 --validation.freq="$val_freq"
        --checkpoint.folder="$ckpt" --checkpoint.interval=0 --checkpoint.last_save=false
        --checkpoint.keep_latest_k=1)
"$PY" -m mxmoe compare --config "$PRESET" --steps "$STEPS" --seeds "$SEEDS" --out "$STATE" \
    "${variant_args[@]}" --baseline "${VARIANTS[0]}" --parallel "$parallel" "${extra[@]}" \
    --time-limit-s "$LIMIT" --delete-finished-checkpoints -- "${COMMON[@]}"
rc=$?

echo "== save times measured by the trainers (the next call's grace is 1.5 x the longest + 10 s):"
grep -h "saved in" "$STATE"/runs/*/*/train.log 2>/dev/null | tail -n 12 || true
# compare's status is 1 when a run did not finish, 2 when none did: a stop at the time limit is the
# plan (the same command again goes on); only a run of this call's variants and seeds that failed
# makes this call fail (another study's runs in STATE/runs are not this call's)
"$PY" - "$STATE/runs" "$variants" "$SEEDS" <<'EOF'
import json, os, sys
failed = 0
runs = [f"{sys.argv[1]}/{v}/seed{s}" for v in sys.argv[2].split(",") for s in sys.argv[3].split(",")]
for run in runs:
    f = f"{run}/command.json"
    if not os.path.exists(f):
        continue
    r = json.load(open(f))
    what = "stopped at the time limit" if r.get("stopped") else (
        "finished" if r.get("returncode") == 0 else f"FAILED (exit {r.get('returncode')}; {run}/train.log)")
    failed += what.startswith("FAILED")
    print(f"== {run}: {what} after {r.get('seconds')} s")
sys.exit(1 if failed else 0)
EOF
status=$?
if [ $rc -ne 0 ] && [ $status -eq 0 ] && [ -z "$(find "$STATE/runs" -name command.json -newer "$marker" 2>/dev/null)" ]; then
    status=$rc  # compare ran no run (bad arguments, or its tables failed): earlier calls' runs do not pass for it
fi
[ -d "$STATE/runs" ] && tar -C "$STATE" -czf "$STATE/runs.tar.gz" runs
mkdir -p "$ckpt" && df -h "$ckpt" | tail -n 1 | awk '{print "== checkpoint disk: " $4 " free of " $2}'
echo "== finished runs' records: $STATE/runs (metrics.jsonl, config.json, command.json, train.log), for docs/data/"
exit $status
