#!/usr/bin/env bash
# torchtitan 0.2.2's trainer with expert parallelism over NGPU (2 or 4) GPUs of one host: bf16,
# mxmoe (full MX), mxmoe's exchange only, torchao's emulated MXFP8, then mxmoe's all-to-all alone at
# 16 x 8192 x 5120 per rank. scripts/torchtitan_ep.py says what each run is and what it writes.
#
#   scripts/torchtitan_ep.sh OUT_DIR NGPU [torchtitan_ep.py options: --steps 30 --timeout 600
#                                          --runs bf16,mxmoe,exchange,torchao,a2a --compile ...]
#
# Needs no network: torchtitan 0.2.2, torchao 0.18 and the run-time dependencies the GPU image
# lacks are installed from wheels in .whl/ at the repository root into /tmp/site (--target; the
# image's Python is not touched), as scripts/torchtitan_h200.sh does; the text data (the Python
# standard library's sources) and a byte-level tokenizer are written by
# mxmoe.integrations.torchtitan.data into a /tmp folder. PY names the Python (default python3).
set -euo pipefail

OUT=${1:?usage: scripts/torchtitan_ep.sh OUT_DIR NGPU [options of scripts/torchtitan_ep.py]}
NGPU=${2:?usage: scripts/torchtitan_ep.sh OUT_DIR NGPU [options of scripts/torchtitan_ep.py]}
shift 2
REPO=$(cd "$(dirname "$0")/.." && pwd)
export PY=${PY:-python3}  # the runs' Python too (scripts/torchtitan_ep.py)
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$REPO"

if compgen -G ".whl/*.whl" > /dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$REPO:$REPO/scripts
else
    echo "no .whl/ folder: using the installed torchtitan 0.2.x and torchao" >&2
    export PYTHONPATH=$REPO:$REPO/scripts${PYTHONPATH:+:$PYTHONPATH}
fi
"$PY" - "$NGPU" <<'EOF' | tee "$OUT/versions.txt"
import importlib.metadata as md
import sys
import torch
n = torch.cuda.device_count()
gpu = torch.cuda.get_device_name() if n else "no GPU"
print("torch", torch.__version__, "|", n, "x", gpu, "|", *(f"{p} {md.version(p)}" for p in ("torchtitan", "torchao")))
if n < int(sys.argv[1]):
    print(f"warning: {sys.argv[1]} GPUs asked for, {n} visible", file=sys.stderr)
EOF

WORK=$(mktemp -d /tmp/torchtitan_ep.XXXXXX)  # data (~33 MB) and tokenizer: not results, kept out of OUT_DIR
"$PY" -m mxmoe.integrations.torchtitan.data "$WORK/data" --tokenizer "$WORK/tokenizer"
# mxmoe's CUDA cast kernels are built on first use (~30 s, cached under ~/.cache/torch_extensions):
# build them now, outside the timed runs; "auto" falls back to Triton where they cannot build.
"$PY" - <<'EOF'
import torch
if torch.cuda.is_available():
    from mxmoe.quant import cuda_cast
    try:
        cuda_cast.load_extension()
        print("mxmoe's CUDA cast kernels: built")
    except RuntimeError as e:
        print(f"mxmoe's CUDA cast kernels did not build, 'auto' takes the Triton ones: {str(e)[:300]}")
EOF

"$PY" scripts/torchtitan_ep.py "$OUT" "$NGPU" --data "$WORK/data" --tokenizer "$WORK/tokenizer" "$@"
