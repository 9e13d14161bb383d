# Sourced by the lease_*.sh scripts: environment, result folder $R (tarred into $OUT at exit by the
# caller's trap), elapsed time `el`, and `lim N`: N seconds, or what is left before DEADLINE.
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/mxmoe_out}; R=/tmp/res; mkdir -p "$OUT" "$R"
T0=$(date +%s); DEADLINE=${DEADLINE:-570}
el() { echo $(( $(date +%s) - T0 )); }
lim() { local l=$1 left=$(( DEADLINE - $(date +%s) + T0 )); echo $(( l < left ? l : (left > 5 ? left : 5) )); }
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1
  python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } | tee "$R/env.txt"
