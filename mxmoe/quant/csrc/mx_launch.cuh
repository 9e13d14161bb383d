// Host side of the MX cast launchers (mx_cast.h), shared by their translation units: mx_cast.cu
// (quantize, dequantize), mx_qdq.cu (quantize-dequantize, zero_rows_after) and mx_swiglu_qdq.cu (the
// SwiGLU's forward and backward qdq). Three units, so the extension's build compiles them at once
// (each kernel is compiled in the one unit that launches it). Definitions in an anonymous namespace
// (each unit's own copy; a template is compiled where it is used).
#pragma once

#include "mx_cast.h"

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <type_traits>

#include "mx_cast_kernels.cuh"
#include "mx_dequant_kernels.cuh"
#include "mx_numerics.cuh"
#include "mx_qdq_kernels.cuh"

namespace {

bool aligned(const void* p, uintptr_t a) { return (reinterpret_cast<uintptr_t>(p) % a) == 0; }

int log2_pow2(int v) {
  int lg = 0;
  while ((1 << lg) < v) ++lg;
  return lg;
}

bool valid_common(int dtype, int block_size, int elem) {
  return (dtype == MX_BF16 || dtype == MX_F32) && (elem == MX_E4M3 || elem == MX_E5M2) && block_size >= 2 &&
         (block_size & (block_size - 1)) == 0;
}

// The arguments of the (batch, rows, cols) qdq launchers (mx_qdq_dim1, mx_qdq_dim0_dim1 and the
// SwiGLU ones; cols_in_blocks: cols % block_size == 0 too): groups (offs) only with batch 1.
bool valid_qdq(int in_dtype, int out_dtype, int block_size, int mode, int elem, int64_t batch, int64_t rows,
               int64_t cols, const int32_t* offs, int64_t num_groups, bool cols_in_blocks) {
  return valid_common(in_dtype, block_size, elem) && (out_dtype == MX_BF16 || out_dtype == MX_F32) && mode >= 0 &&
         mode <= 3 && batch >= 0 && rows >= 0 && cols >= 0 && (!cols_in_blocks || cols % block_size == 0) &&
         (offs == nullptr || (batch == 1 && num_groups >= 1 && num_groups <= INT_MAX));
}

int sm_count() {
  static int cache[64] = {};  // per device; benign race: every writer stores the same value
  int dev = 0, sms = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return 132;
  if (dev >= 0 && dev < 64 && cache[dev] > 0) return cache[dev];
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || sms < 1) sms = 132;
  if (dev >= 0 && dev < 64) cache[dev] = sms;
  return sms;
}

// Resident CTAs per SM of one kernel at kThreads threads (computed once per kernel).
template <auto Kernel>
int ctas_per_sm() {
  static const int value = [] {
    int per_sm = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, Kernel, kThreads, 0) != cudaSuccess || per_sm < 1) {
      per_sm = 1;
    }
    return per_sm;
  }();
  return value;
}

// CTAs for a grid-stride kernel: enough to fill the device, at most `want`.
template <auto Kernel>
unsigned grid_for(int64_t want) {
  const int64_t cap = static_cast<int64_t>(sm_count()) * ctas_per_sm<Kernel>();
  return static_cast<unsigned>(want < 1 ? 1 : (want < cap ? want : cap));
}

template <int A, int B>
struct Pair {
  static constexpr int first = A;
  static constexpr int second = B;
};

// Calls f(Pair<dtype, elem>{}) with compile-time codes.
template <typename F>
cudaError_t dispatch(int dtype, int elem, F&& f) {
  if (dtype == MX_BF16) {
    return elem == MX_E4M3 ? f(Pair<MX_BF16, MX_E4M3>{}) : f(Pair<MX_BF16, MX_E5M2>{});
  }
  return elem == MX_E4M3 ? f(Pair<MX_F32, MX_E4M3>{}) : f(Pair<MX_F32, MX_E5M2>{});
}

// Any earlier error (a failed launch, a sticky fault) surfaces here.
cudaError_t launch_status() { return cudaGetLastError(); }

// f(Pair<in, elem>{}, integral_constant<out>{}) with compile-time codes.
template <typename F>
cudaError_t dispatch_out(int in_dtype, int elem, int out_dtype, F&& f) {
  return dispatch(in_dtype, elem, [&](auto codes) -> cudaError_t {
    return out_dtype == MX_BF16 ? f(codes, std::integral_constant<int, MX_BF16>{})
                                : f(codes, std::integral_constant<int, MX_F32>{});
  });
}

// qdq_dim1_kernel's preconditions: block 32, x and the outputs (y0: FUSED only, else nullptr)
// 16-byte aligned, 16-byte vectors of x never straddle a row.
bool qdq_dim1_fast(int in_dtype, const void* x, const void* y0, const void* y1, int64_t C, int block_size) {
  const int vec = in_dtype == MX_BF16 ? 8 : 4;
  return block_size == 32 && C % vec == 0 && aligned(x, 16) && aligned(y1, 16) && (!y0 || aligned(y0, 16));
}

// The dim1 (FUSED: dim0 + dim1) qdq of x (B, R, C) into y1 (and y0) with qdq_dim1_kernel
// (qdq_dim1_fast holds).
// SWIGLU: x is g, u the SwiGLU's second input (h = silu(g) * u is cast; FUSED only).
// qdq_dim1_kernel's (and swiglu_bwd_qdq_kernel's) units of x (B, R, C) at RL lanes per column.
template <int IN, int RL>
struct DimUnits {
  int64_t ncvt, nbm, ncc, units, ctas;
  DimUnits(int64_t B, int64_t R, int64_t C, const Groups& g) {
    constexpr int VEC = 16 / static_cast<int>(sizeof(Raw<IN>));
    constexpr int NCV = 32 / RL;
    ncvt = C / VEC;
    nbm = (R + 31) / 32;
    ncc = (ncvt + NCV - 1) / NCV;
    // with groups (B == 1): an upper bound on the padded row space's blocks, as the rows kernel's grid
    units = (g.offs != nullptr ? (R + 31 * static_cast<int64_t>(g.E) + 31) / 32 : B * nbm) * ncc;
    constexpr int64_t kWarps = kThreads / 32;
    ctas = (units + kWarps - 1) / kWarps;
  }
};

template <int IN, int OUT, int EL, bool FUSED, bool SWIGLU = false>
cudaError_t launch_qdq_dim1(const void* x, void* y0, void* y1, int64_t B, int64_t R, int64_t C, const Groups& g,
                            const ScaleArgs& p, cudaStream_t st, const void* u = nullptr) {
  // lanes per column: registers and CTAs per SM (see the kernel)
  constexpr int RL = FUSED ? (IN == MX_BF16 ? 8 : 4) : 2;
  const DimUnits<IN, RL> d(B, R, C, g);
  if (d.ctas > INT_MAX) return cudaErrorInvalidValue;
  qdq_dim1_kernel<IN, OUT, EL, FUSED, RL, SWIGLU><<<static_cast<unsigned>(d.ctas), kThreads, 0, st>>>(
      static_cast<const uint4*>(x), static_cast<uint32_t*>(y1), static_cast<uint32_t*>(y0), R, d.ncvt, d.nbm, d.ncc,
      d.units, g, p, static_cast<const uint4*>(u));
  return launch_status();
}

}  // namespace
