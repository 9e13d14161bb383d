#!/usr/bin/env bash
# Compile the CUDA cast kernels for sm_90 where nvcc exists, so a build break shows without a GPU;
# then check that the torch operator binding (csrc/binding.cpp) compiles against the installed
# torch's headers and CUDA's (g++ -fsyntax-only).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v nvcc >/dev/null 2>&1; then
  echo "check_cuda_build: nvcc not found, skipping the sm_90 compile check"
  exit 0
fi
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
shopt -s nullglob
sources=(mxmoe/*/csrc/*.cu) bindings=(mxmoe/*/csrc/binding.cpp)
if [ ${#sources[@]} -eq 0 ] || [ ${#bindings[@]} -eq 0 ]; then  # a check of nothing is no pass
  echo "check_cuda_build: no mxmoe/*/csrc/*.cu or binding.cpp under $PWD: nothing to compile" >&2
  exit 1
fi
for f in "${sources[@]}"; do
  start=$(date +%s)
  nvcc -std=c++17 -O3 -arch=sm_90 -c "$f" -o "$out/$(basename "$f").o"
  echo "check_cuda_build: $f compiled for sm_90 in $(( $(date +%s) - start )) s"
done
PY=${PYTHON:-python}
# The CPU wheel of torch ships c10/cuda's headers but not the CMake-generated cuda_cmake_macros.h they
# include; a stand-in (it only sets build macros) lets binding.cpp be checked against them here.
if inc=$("$PY" -c "
import torch.utils.cpp_extension as c
print(' '.join('-I' + p for p in c.include_paths()))" 2>/dev/null); then
  mkdir -p "$out/stub/c10/cuda/impl"
  printf '#pragma once\n' > "$out/stub/c10/cuda/impl/cuda_cmake_macros.h"
  cuda_inc=
  for d in "${CUDA_HOME:-}" "$(dirname "$(dirname "$(command -v nvcc)")")" /usr/local/cuda; do
    [ -n "$d" ] && [ -f "$d/include/cuda_runtime.h" ] && { cuda_inc=$d/include; break; }
  done
  for f in "${bindings[@]}"; do
    start=$(date +%s)
    # shellcheck disable=SC2086
    ${CXX:-g++} -std=c++20 -fsyntax-only $inc -idirafter "$out/stub" ${cuda_inc:+-I"$cuda_inc"} "$f"
    echo "check_cuda_build: $f compiles against torch's headers in $(( $(date +%s) - start )) s"
  done
else
  echo "check_cuda_build: $PY has no torch, skipping the binding.cpp check"
fi
