#!/usr/bin/env bash
# The wheel as a pip user gets it (`make wheel-check`, run by .ci/run): build it, install it into a
# fresh venv, and from a folder outside the checkout train a few steps of a shipped config by name,
# reach a torchtitan config by name, and read the help. Exits non-zero if any of it fails.
#
# The fresh venv installs the wheel and its declared dependencies from pip's configured sources (as
# `make test` installs its own); only torch, already installed in .venv, is linked into it instead
# of being unpacked again. Usage: scripts/wheel_check.sh [VENV_PYTHON] (default .venv/bin/python).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
PY=${1:-$REPO/.venv/bin/python}
# the venv and the run live outside the checkout (removed when the check passes)
WORK=$(mktemp -d "${TMPDIR:-/tmp}/mxmoe-wheel-check.XXXXXX")
mkdir -p "$WORK/dist" "$WORK/run"
start=$SECONDS

# the wheel, built with the venv's setuptools (no isolated build env: no download); setuptools keeps
# build/lib between builds, where a file since deleted would still reach the wheel
rm -rf "$REPO/build/lib" "$REPO"/build/bdist.*
"$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$WORK/dist" "$REPO"
wheel=$(ls "$WORK"/dist/mxmoe-*.whl)

# a fresh venv (the base interpreter's, not .venv's packages) with .venv's pip driving it
base=$("$PY" -c 'import sys; print(sys._base_executable)')
"$base" -m venv --without-pip "$WORK/venv"
VPY=$WORK/venv/bin/python
site=$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
src=$("$PY" -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))')
for entry in "$src"/torch "$src"/torchgen "$src"/functorch "$src"/torch-*.dist-info; do
    [ -e "$entry" ] && ln -s "$entry" "$site/"
done
"$PY" -m pip --python "$VPY" install -q --no-compile "$wheel"
"$PY" -m pip --python "$VPY" check

# from outside the checkout: the package is the installed wheel, its configs are found by name
cd "$WORK/run"
"$VPY" - <<'EOF'
import sys
import mxmoe
from mxmoe import configs
assert mxmoe.__file__.startswith(sys.prefix), f"mxmoe imported from {mxmoe.__file__}, not the wheel"
assert "debug_moe" in configs.names("trainer"), f"the wheel ships no trainer configs: {configs.names()}"
assert "torchtitan/deepseek_v3_debug_0.2" in configs.names(), f"no torchtitan configs: {configs.names()}"
EOF
"$WORK/venv/bin/mxmoe" --help > /dev/null
"$WORK/venv/bin/mxmoe" train --help > /dev/null
"$WORK/venv/bin/mxmoe" config copy torchtitan/deepseek_v3_debug_0.2 . > /dev/null
test -s deepseek_v3_debug_0.2.toml
"$WORK/venv/bin/mxmoe" train --config debug_moe --training.steps=3 --training.seq_len=64 \
    --training.local_batch_size=2 --data.max_files=20 --validation.freq=3 --validation.steps=1 \
    --checkpoint.folder=ckpt --checkpoint.interval=3 --job.dump_folder=run --metrics.log_freq=1
test -s run/metrics.jsonl && test -d ckpt/step-00000003
echo "wheel check: $(basename "$wheel") installed in a fresh venv and trained from $PWD ($((SECONDS - start)) s)"
rm -rf "$WORK"
