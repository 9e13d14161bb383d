// MX dequantize kernels: dequant_pairs (a vector's dequantize, which the qdq kernels reuse),
// dequant_flat_kernel and the generic kernel.
//
// Included by mx_cast.cu, the extension's one translation unit (every kernel compiled together);
// its definitions are in that unit's anonymous namespace.
#pragma once

#include "mx_numerics.cuh"

namespace {


// Each thread-vector: EPT fp8 bytes in (8 for bf16 out, 4 for fp32 out) -> 16 bytes out.
// NP fp8 pairs of the words w (element 0 in the low byte), all of one block with scale sc ->
// output words o: bf16 pairs (NP words) or fp32 values (2 * NP words).
template <int OUT, int ELEM, int NP>
__device__ __forceinline__ void dequant_pairs(const uint32_t* w, float sc, uint32_t* o) {
#pragma unroll
  for (int k = 0; k < NP; ++k) {
    const float2 f = fp8x2_to_f32<ELEM>(w[k >> 1] >> (16 * (k & 1)));
    const uint32_t a = dequant_bits<OUT>(f.x, sc);
    const uint32_t c = dequant_bits<OUT>(f.y, sc);
    if constexpr (OUT == MX_BF16) {
      o[k] = a | (c << 16);
    } else {
      o[2 * k] = a;
      o[2 * k + 1] = c;
    }
  }
}

// Dequantize: one-shot grid (no grid-stride loop), THREADS threads per CTA, each
// thread V independent thread-vectors of EPT fp8 bytes (one 4- / 8-byte load) in one block (needs
// block_size >= EPT) -> EPT bf16 / fp32 values (one 8- / 16-byte store, or two 16-byte stores).
// Vector u of thread t of CTA b is vec_begin + (b * V + u) * THREADS + t: each load / store
// instruction of a warp covers contiguous memory. The scale byte is loaded per vector (__ldg; the
// repeats within a block are served by L1).
template <int OUT, int ELEM, int EPT, int V, int THREADS>
__global__ void __launch_bounds__(THREADS) dequant_flat_kernel(const uint8_t* __restrict__ q,
                                                                const uint8_t* __restrict__ s,
                                                                uint32_t* __restrict__ out, int64_t vec_begin,
                                                                int64_t nvec, int lg_bs) {
  static_assert(EPT == 4 || EPT == 8, "EPT: 4 or 8 fp8 bytes per thread-vector");
  constexpr int NWI = EPT / 4;                        // 32-bit input words per vector
  constexpr int NWO = OUT == MX_BF16 ? EPT / 2 : EPT;  // 32-bit output words per vector
  const int64_t first = vec_begin + static_cast<int64_t>(blockIdx.x) * (THREADS * V) + threadIdx.x;
  uint32_t w[V][NWI];
  uint32_t sb[V];
#pragma unroll
  for (int u = 0; u < V; ++u) {
    const int64_t i = first + u * THREADS;
#pragma unroll
    for (int k = 0; k < NWI; ++k) w[u][k] = 0u;
    sb[u] = 0u;
    if (i < nvec) {
      if constexpr (NWI == 2) {
        const uint2 v = reinterpret_cast<const uint2*>(q)[i];
        w[u][0] = v.x;
        w[u][1] = v.y;
      } else {
        w[u][0] = reinterpret_cast<const uint32_t*>(q)[i];
      }
      sb[u] = __ldg(s + ((i * EPT) >> lg_bs));
    }
  }
#pragma unroll
  for (int u = 0; u < V; ++u) {
    const int64_t i = first + u * THREADS;
    if (i >= nvec) continue;
    const float sc = e8m0_to_f32(sb[u]);
    uint32_t o[NWO];
    dequant_pairs<OUT, ELEM, EPT / 2>(w[u], sc, o);
    uint32_t* dst = out + i * NWO;
    if constexpr (NWO == 2) {
      *reinterpret_cast<uint2*>(dst) = make_uint2(o[0], o[1]);
    } else {
#pragma unroll
      for (int k = 0; k < NWO / 4; ++k) {
        reinterpret_cast<uint4*>(dst)[k] = make_uint4(o[4 * k], o[4 * k + 1], o[4 * k + 2], o[4 * k + 3]);
      }
    }
  }
}

// Elements [start, n), one per thread.
template <int OUT, int ELEM>
__global__ void __launch_bounds__(kThreads) dequant_generic_kernel(const uint8_t* __restrict__ q,
                                                                   const uint8_t* __restrict__ s, void* __restrict__ out,
                                                                   int64_t start, int64_t n, int lg_bs) {
  for (int64_t i = start + static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    const float qv = fp8x2_to_f32<ELEM>(q[i]).x;
    const uint32_t bits = dequant_bits<OUT>(qv, e8m0_to_f32(s[i >> lg_bs]));
    if constexpr (OUT == MX_BF16) {
      static_cast<uint16_t*>(out)[i] = static_cast<uint16_t>(bits);
    } else {
      static_cast<uint32_t*>(out)[i] = bits;
    }
  }
}

}  // namespace
