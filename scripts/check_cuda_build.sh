#!/usr/bin/env bash
# Compile the CUDA cast kernels for sm_90 where nvcc exists, so a build break shows without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v nvcc >/dev/null 2>&1; then
  echo "check_cuda_build: nvcc not found, skipping the sm_90 compile check"
  exit 0
fi
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
shopt -s nullglob
for f in mxmoe/*/csrc/*.cu; do
  nvcc -std=c++17 -O3 -arch=sm_90 -c "$f" -o "$out/$(basename "$f").o"
  echo "check_cuda_build: $f compiled for sm_90"
done
