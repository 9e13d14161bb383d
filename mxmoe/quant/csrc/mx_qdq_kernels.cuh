// MX quantize-dequantize kernels (qdq): the casts' quantizers and the dequantize's device
// functions in registers (no fp8 in memory), along dim0, dim1 and both, with expert groups and the
// SwiGLU forward and backward prologues; and zero_rows_after_kernel (the rows after the last group).
//
// Included by mx_cast.cu, the extension's one translation unit (every kernel compiled together);
// its definitions are in that unit's anonymous namespace.
#pragma once

#include "mx_cast_kernels.cuh"
#include "mx_dequant_kernels.cuh"
#include "mx_numerics.cuh"

namespace {

// One dequantized vector's NWO output words to dst with streaming stores (8 bytes, or 16-byte
// pieces): the qdq kernels' output, read by the GEMM after, not by this kernel.
template <int NWO>
__device__ __forceinline__ void store_words_cs(uint32_t* dst, const uint32_t (&o)[NWO]) {
  if constexpr (NWO == 2) {
    __stcs(reinterpret_cast<uint2*>(dst), make_uint2(o[0], o[1]));
  } else {
#pragma unroll
    for (int k = 0; k < NWO / 4; ++k) {
      __stcs(reinterpret_cast<uint4*>(dst) + k, make_uint4(o[4 * k], o[4 * k + 1], o[4 * k + 2], o[4 * k + 3]));
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Quantize-dequantize along dim0 (qdq): y = dequantize(quantize_dim0(x)) without writing q and s,
// in x's layout. The cast's device functions quantize (quantize_vec32 / quantize_block_generic)
// and the dequantize kernels' dequantize (dequant_pairs / dequant_bits) in registers, so the
// values are those of the two kernels one after the other, bit for bit.
//
// Block 32: one-shot grid, V 16-byte input vectors per thread (all loads issued first), vector u
// of thread t of CTA b is (b * V + u) * kThreads + t, so each load / store instruction of a warp
// covers contiguous memory and a block's LPB vectors sit in LPB consecutive lanes (the amax
// shuffles of quantize_vec32). Stores: 16 bytes (bf16 -> bf16, fp32 -> fp32), 2 x 16 bytes
// (bf16 -> fp32) or 8 bytes (fp32 -> bf16) per vector.
template <int IN, int OUT, int ELEM, int V>
__global__ void __launch_bounds__(kThreads) qdq_dim0_kernel(const uint4* __restrict__ x, uint32_t* __restrict__ y,
                                                            int64_t nvec, ScaleArgs p) {
  constexpr int VEC = 16 / static_cast<int>(sizeof(Raw<IN>));  // elements per vector: 8 / 4
  constexpr int NWO = OUT == MX_BF16 ? VEC / 2 : VEC;           // 32-bit output words per vector
  const int64_t first = static_cast<int64_t>(blockIdx.x) * (kThreads * V) + threadIdx.x;
  uint4 v[V];
#pragma unroll
  for (int u = 0; u < V; ++u) {
    const int64_t i = first + u * kThreads;
    v[u] = i < nvec ? __ldcs(x + i) : make_uint4(0u, 0u, 0u, 0u);
  }
  // Every lane runs quantize_vec32 (shuffles); out-of-range vectors are zeros, never stored.
#pragma unroll
  for (int u = 0; u < V; ++u) {
    const int64_t i = first + u * kThreads;
    uint32_t qw[4];
    const uint32_t sb = quantize_vec32<IN, ELEM, false>(v[u], p, qw);
    uint32_t o[NWO];
    dequant_pairs<OUT, ELEM, VEC / 2>(qw, e8m0_to_f32(sb), o);
    if (i >= nvec) continue;
    uint32_t* dst = y + i * NWO;
    store_words_cs<NWO>(dst, o);
  }
}

// Any block size, any alignment: one thread per block.
template <int IN, int OUT, int ELEM>
__global__ void __launch_bounds__(kThreads) qdq_dim0_generic_kernel(const Raw<IN>* __restrict__ x,
                                                                    void* __restrict__ y, int64_t nblk, int bs,
                                                                    ScaleArgs p) {
  for (int64_t blk = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; blk < nblk;
       blk += static_cast<int64_t>(gridDim.x) * kThreads) {
    const int64_t base = blk * bs;
    quantize_block_generic<IN, ELEM>(x + base, 1, bs, p, [&](int i, uint8_t b, uint32_t sb) {
      const uint32_t bits = dequant_bits<OUT>(fp8x2_to_f32<ELEM>(b).x, e8m0_to_f32(sb));
      if constexpr (OUT == MX_BF16) {
        static_cast<uint16_t*>(y)[base + i] = static_cast<uint16_t>(bits);
      } else {
        static_cast<uint32_t*>(y)[base + i] = bits;
      }
    });
  }
}

// ---------------------------------------------------------------------------------------------
// Expert groups of a 2D x (T rows): offs (E,) int32 cumulative group ends (as torch._grouped_mm);
// offs == nullptr: none. Group e (rows offs[e-1]:offs[e], offs[-1] = 0) has ceil(max(n_e, 0) / bs)
// blocks of the padded row space (the rows kernel's, mxmoe.quant.groups) from its first row, the
// last one short; the blocks after the last group cover rows offs[E-1].. T, which belong to no
// group. Each kernel finds a block's group from offs itself (no scratch, no pre-kernel).
struct Groups {
  const int32_t* offs;
  int E;
};

// Blocks of a group with rows [start, end) (none if end <= start).
__device__ __forceinline__ int64_t group_blocks(int64_t start, int64_t end, int bs) {
  return end > start ? (end - start + bs - 1) / bs : 0;
}

// The rows [t0, t_end) of block pb of the padded row space for one thread: the groups in order until
// pb's; false for the blocks after the last group (rows offs[E-1].. T). t0 >= t_end: no rows.
__device__ __forceinline__ bool group_block_thread(const Groups& g, int64_t T, int bs, int64_t pb, int64_t& t0,
                                                   int64_t& t_end) {
  int64_t first = 0, prev = 0;
  for (int i = 0; i < g.E; ++i) {
    const int64_t o = __ldg(g.offs + i);
    const int64_t next = first + group_blocks(prev, o, bs);
    if (next > pb) {
      t0 = prev + (pb - first) * bs;
      t_end = o < T ? o : T;
      return true;
    }
    first = next;
    prev = o;
  }
  t0 = prev + (pb - first) * bs;
  t_end = T;
  return false;
}

// The rows [t0, t_end) of block pb of the padded row space, pb the same in every lane of the warp
// and every lane calling; false for the blocks after the last group (rows offs[E-1].. T). Each lane
// sums the blocks of a run of ceil(E / 32) consecutive groups (one group for E <= 32; its loads
// issued together), a shuffle scan gives the runs' ends, a ballot the lane whose run holds pb (the
// ends never decrease), and that lane's run gives pb's group (a walk when it has several). The scan
// is in 32 bits, saturated at INT32_MAX: exact up to pb (pb >= INT32_MAX: group_block_thread).
// t0 >= t_end: no rows (the grid's upper bound on blocks).
__device__ __forceinline__ bool group_block_warp(const Groups& g, int64_t T, int bs, int64_t pb, int64_t& t0,
                                                 int64_t& t_end) {
  constexpr unsigned kAll = 0xffffffffu;
  constexpr uint32_t kMax = INT32_MAX;
  if (pb >= kMax) return group_block_thread(g, T, bs, pb, t0, t_end);
  const int lane = threadIdx.x & 31;
  const int per = (g.E + 31) >> 5;
  const int b = min(lane * per, g.E), e = min(b + per, g.E);
  int32_t start = b > 0 ? __ldg(g.offs + b - 1) : 0;  // offs[b - 1], then offs[e - 1]
  int32_t end = start;
  int64_t sum = 0;  // the run's blocks
  for (int i = b; i < e; ++i) {
    const int32_t o = __ldg(g.offs + i);
    sum += group_blocks(end, o, bs);
    end = o;
  }
  uint32_t incl = static_cast<uint32_t>(sum < kMax ? sum : kMax);  // the blocks of groups [0, e)
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const uint32_t t = __shfl_up_sync(kAll, incl, o);
    if (lane >= o) incl = min(incl + t, kMax);  // both <= kMax: no wrap
  }
  const int k = __popc(__ballot_sync(kAll, incl <= pb));  // runs 0 .. k-1 end at or before pb
  if (k == 32) {  // after the last group (lane 31's incl: every group's blocks, <= pb)
    const uint32_t total = __shfl_sync(kAll, incl, 31);
    t0 = static_cast<int64_t>(__ldg(g.offs + g.E - 1)) + (pb - total) * bs;
    t_end = T;
    return false;
  }
  const uint32_t before = __shfl_sync(kAll, incl, k > 0 ? k - 1 : 0);
  int64_t first = k > 0 ? before : 0;  // the blocks before lane k's run (<= pb: exact)
  if (per > 1) {  // lane k walks its run to pb's group: rows [start, end)
    if (lane == k) {
      int32_t prev = start;
      for (int i = b; i < e; ++i) {
        const int32_t o = __ldg(g.offs + i);
        const int64_t next = first + group_blocks(prev, o, bs);
        if (next > pb) {
          start = prev;
          end = o;
          break;
        }
        first = next;
        prev = o;
      }
    }
    first = static_cast<int64_t>(__shfl_sync(kAll, static_cast<uint32_t>(first), k));
  }
  start = __shfl_sync(kAll, start, k);
  end = __shfl_sync(kAll, end, k);
  t0 = static_cast<int64_t>(start) + (pb - first) * bs;
  t_end = end < T ? end : T;
  return true;
}

// Rows at or after *end of y set to zero: y has `rows` rows of `row_units` units U (16-byte
// vectors, or single bf16 / fp32 elements), `row_stride` units apart; *end (a group offset, only
// known on the device) is clamped to [0, rows]. Block (32, kZeroRows): a warp per row, its lanes
// along the row (coalesced stores); grid-stride over the rows. When the groups cover every row (a
// MoE step) each CTA reads *end and exits.
constexpr int kZeroRows = kThreads / 32;  // rows per CTA per pass

template <typename U>
__global__ void __launch_bounds__(kThreads) zero_rows_after_kernel(U* __restrict__ y, const int32_t* __restrict__ end,
                                                                 int64_t rows, int64_t row_units, int64_t row_stride) {
  const int64_t e = __ldg(end);
  const int64_t first = e < 0 ? 0 : (e < rows ? e : rows);
  for (int64_t r = first + static_cast<int64_t>(blockIdx.x) * kZeroRows + threadIdx.y; r < rows;
       r += static_cast<int64_t>(gridDim.x) * kZeroRows) {
    U* row = y + r * row_stride;
    for (int64_t c = threadIdx.x; c < row_units; c += 32) row[c] = U{};
  }
}
// ---------------------------------------------------------------------------------------------
// Quantize-dequantize along dim1 (blocks of 32 rows of each matrix, the last one short, equal to
// the zero-padded cast's), optionally with dim0 from the same read (FUSED), every output in x's
// own row-major layout. x is B matrices of R rows of NCVT 16-byte vectors (C = NCVT * VEC columns).
// The dim1 cast's column quantization (quantize_col) and the dequantize's device functions
// (fp8x2_to_f32, dequant_bits) in registers, so the values are those of the cast kernels followed
// by the dequantize kernel, bit for bit; FUSED adds the dim0 qdq's quantize_vec32 + dequant_pairs.
//
// A warp owns one unit: a 32-row block x NCV = 32 / RL consecutive column vectors. Lane l holds
// column vector l % NCV of rows (l / NCV) * NR .. + NR - 1 of the block (NR = 32 / RL rows, RL lanes
// per column): NR 16-byte loads, all issued before the first use (each load instruction of a warp
// reads RL rows x NCV * 16 contiguous bytes), no shared memory, a one-shot grid of 8 units per CTA.
// Column amax: a packed max over the thread's rows (bf16: 16x2 integer max of the absolute bit
// patterns, as dim1_tile_kernel), then shuffles across the RL lanes of the column. Each column's
// NR fp8 bytes stay in registers; per row the fp8 bytes of two columns are paired (byte_perm),
// converted once (fp8x2_to_f32) and scaled by each column's scale (dequant_bits); the row's VEC
// outputs go out as one 16-byte store (bf16 -> bf16, fp32 -> fp32), two (bf16 -> fp32) or one
// 8-byte store (fp32 -> bf16). FUSED: the LPB lanes of a 32-column block are consecutive
// (NCV % LPB == 0, C % 32 == 0), as quantize_vec32's shuffles need.
// Groups (g.offs != nullptr, B == 1): unit rows are blocks of the padded row space, found by
// unit_rows (group_block_warp, warp-uniform); units past the last block return at once; rows in
// no group load as zeros and store +0 in both outputs (the Triton rows kernel's).
// RL = 2 (16 rows per thread) for one direction: 128 / 96 registers (bf16 / fp32 in, ptxas sm_90),
// two CTAs (16 warps) per SM. FUSED: RL = 8 for bf16 (4 rows per thread; 72 registers, SWIGLU too,
// three CTAs per SM, faster than RL = 4 at 123-128 registers and two CTAs; RL = 2 needs 230) and
// RL = 4 for fp32 (74 registers, SWIGLU 84; faster than RL = 2). No variant spills.
// SWIGLU (with FUSED: swiglu_qdq_dim0_dim1): x is g and xu is u (same layout); the thread loads its
// NR vectors of both and forms h = silu(g) * u (swiglu_vec) before the casts, so h is never in memory.
// The rows of the 32-row block of warp unit `unit` (see qdq_dim1_kernel; ncc units per row block):
// [t0, t_end) flat over the matrices, in_group false for the rows after the last group. False: no
// rows (the warp returns). Groups: where the CTA's warps share one row block (ncc a multiple of the
// warps per CTA: the grid is whole CTAs, so every warp of every CTA is here) warp 0 finds it for all
// (group_block_warp, once per CTA instead of once per warp); else each warp finds its own.
__device__ __forceinline__ bool unit_rows(int64_t unit, int64_t ncc, int64_t R, int64_t nbm, const Groups& g,
                                          int64_t& t0, int64_t& t_end, bool& in_group) {
  const int64_t rbg = unit / ncc;
  in_group = true;
  if (g.offs != nullptr) {  // x is (R, C): block rbg of the padded row space
    if (ncc % (kThreads / 32) == 0) {
      __shared__ int64_t s_t0, s_end;
      __shared__ bool s_in;
      if (threadIdx.x < 32) {
        int64_t a, b;
        const bool in = group_block_warp(g, R, 32, rbg, a, b);
        if (threadIdx.x == 0) {
          s_t0 = a;
          s_end = b;
          s_in = in;
        }
      }
      __syncthreads();
      t0 = s_t0;
      t_end = s_end;
      in_group = s_in;
    } else {
      in_group = group_block_warp(g, R, 32, rbg, t0, t_end);
    }
    return t0 < t_end;
  }
  const int64_t m = rbg / nbm;  // matrix m: rows m * R .. m * R + R - 1
  t0 = m * R + (rbg - m * nbm) * 32;
  t_end = m * R + R;
  return true;
}

// The casts of qdq_dim1_kernel on a thread's NR row vectors v (rows row0 .. row0 + nrows - 1 of
// column vector cv; zeros past nrows): FUSED, the dim0 qdq into y0; then the dim1 qdq into y1.
// Every lane of the warp calls it (shuffles).
template <int IN, int OUT, int ELEM, bool FUSED, int RL>
__device__ __forceinline__ void qdq_dim1_cast(const uint4 (&v)[32 / RL], uint32_t* __restrict__ y1,
                                              uint32_t* __restrict__ y0, int64_t row0, int64_t ncvt, int64_t cv,
                                              int nrows, bool col_ok, const ScaleArgs& p) {
  constexpr int VEC = 16 / static_cast<int>(sizeof(Raw<IN>));  // elements (columns) per vector: 8 / 4
  constexpr int NCV = 32 / RL;                                  // column vectors per unit
  constexpr int NR = 32 / RL;                                   // rows per thread (RL lanes per column)
  constexpr int NWO = OUT == MX_BF16 ? VEC / 2 : VEC;           // 32-bit output words per row vector
  if constexpr (FUSED) {  // dim0: every lane runs quantize_vec32 (shuffles); zero rows are not stored
#pragma unroll
    for (int j = 0; j < NR; ++j) {
      uint32_t qw[4];
      const uint32_t sb = quantize_vec32<IN, ELEM, false>(v[j], p, qw);
      uint32_t o[NWO];
      dequant_pairs<OUT, ELEM, VEC / 2>(qw, e8m0_to_f32(sb), o);
      if (!col_ok || j >= nrows) continue;
      uint32_t* dst = y0 + ((row0 + j) * ncvt + cv) * NWO;
      store_words_cs<NWO>(dst, o);
    }
  }
  // Column amax: word k of a vector holds columns 2k, 2k + 1 (bf16) or column k (fp32).
  uint32_t M[4] = {0u, 0u, 0u, 0u};
#pragma unroll
  for (int j = 0; j < NR; ++j) {
    const uint32_t w[4] = {v[j].x, v[j].y, v[j].z, v[j].w};
#pragma unroll
    for (int k = 0; k < 4; ++k) M[k] = IN == MX_BF16 ? __vmaxu2(M[k], w[k] & 0x7FFF7FFFu) : max(M[k], w[k] & kAbsMask);
  }
#pragma unroll
  for (int k = 0; k < 4; ++k) {
#pragma unroll
    for (int o = NCV; o < 32; o <<= 1) {
      const uint32_t t = __shfl_xor_sync(0xFFFFFFFFu, M[k], o);
      M[k] = IN == MX_BF16 ? __vmaxu2(M[k], t) : max(M[k], t);
    }
  }
  if (!col_ok || nrows == 0) return;
  uint32_t q[VEC][NR / 4];
  float sc[VEC];
#pragma unroll
  for (int h = 0; h < VEC; ++h) {
    const int k = IN == MX_BF16 ? h / 2 : h;
    const bool hi = IN == MX_BF16 && (h & 1);
    auto bits = [&](int j) -> uint32_t {
      const uint32_t w = k == 0 ? v[j].x : (k == 1 ? v[j].y : (k == 2 ? v[j].z : v[j].w));
      if constexpr (IN == MX_BF16) {
        return hi ? (w & 0xFFFF0000u) : (w << 16);
      } else {
        return w;
      }
    };
    const uint32_t A = IN == MX_BF16 ? (hi ? (M[k] & 0xFFFF0000u) : (M[k] << 16)) : M[k];
    sc[h] = e8m0_to_f32(quantize_col<ELEM, -1, NR>(A, p, bits, q[h]));
  }
#pragma unroll
  for (int j = 0; j < NR; ++j) {
    if (j >= nrows) break;
    // byte j % 4 of each column's word j / 4: columns 2t (low byte) and 2t + 1
    const unsigned sel = static_cast<unsigned>(j & 3) | (static_cast<unsigned>(4 + (j & 3)) << 4);
    uint32_t o[NWO];
#pragma unroll
    for (int t = 0; t < VEC / 2; ++t) {
      const float2 f = fp8x2_to_f32<ELEM>(__byte_perm(q[2 * t][j >> 2], q[2 * t + 1][j >> 2], sel));
      const uint32_t a = dequant_bits<OUT>(f.x, sc[2 * t]);
      const uint32_t c = dequant_bits<OUT>(f.y, sc[2 * t + 1]);
      if constexpr (OUT == MX_BF16) {
        o[t] = a | (c << 16);
      } else {
        o[2 * t] = a;
        o[2 * t + 1] = c;
      }
    }
    uint32_t* dst = y1 + ((row0 + j) * ncvt + cv) * NWO;
    store_words_cs<NWO>(dst, o);
  }
}

// NR 16-byte vectors of rows row0 .. row0 + nrows - 1 of column vector cv (streaming loads); zeros
// past nrows and for rows in no group (whose qdq is +0 both ways, the rows kernel's convention).
template <int NR>
__device__ __forceinline__ void load_rows(uint4 (&v)[NR], const uint4* __restrict__ x, int64_t row0, int64_t ncvt,
                                          int64_t cv, int nrows, bool ok) {
#pragma unroll
  for (int j = 0; j < NR; ++j) v[j] = ok && j < nrows ? __ldcs(x + (row0 + j) * ncvt + cv) : make_uint4(0u, 0u, 0u, 0u);
}

template <int IN, int OUT, int ELEM, bool FUSED, int RL, bool SWIGLU = false>
__global__ void __launch_bounds__(kThreads, RL == 8 ? 3 : 2)
    qdq_dim1_kernel(const uint4* __restrict__ x, uint32_t* __restrict__ y1, uint32_t* __restrict__ y0, int64_t R,
                    int64_t ncvt, int64_t nbm, int64_t ncc, int64_t units, Groups g, ScaleArgs p,
                    const uint4* __restrict__ xu = nullptr) {
  constexpr int NCV = 32 / RL;  // column vectors per unit
  constexpr int NR = 32 / RL;   // rows per thread (RL lanes per column)
  const int lane = threadIdx.x & 31;
  const int64_t unit = static_cast<int64_t>(blockIdx.x) * (kThreads / 32) + (threadIdx.x >> 5);
  if (unit >= units) return;  // uniform per warp: the warps that go on keep all their lanes
  const int64_t cc = unit % ncc;
  int64_t t0, t_end;  // the block's rows (flat over the matrices)
  bool in_group;
  if (!unit_rows(unit, ncc, R, nbm, g, t0, t_end, in_group)) return;  // uniform per warp, as above
  const int64_t cv = cc * NCV + (lane % NCV);
  const int half = lane / NCV;
  const int64_t row0 = t0 + half * NR;  // this thread's first row
  const int64_t left = t_end - row0;    // the block's rows from row0 on (may be <= 0)
  const int nrows = static_cast<int>(left < 0 ? 0 : (left < NR ? left : NR));
  const bool col_ok = cv < ncvt;
  uint4 v[NR];
  load_rows<NR>(v, x, row0, ncvt, cv, nrows, in_group && col_ok);
  if constexpr (SWIGLU) {  // x is g: every load of u issued, then h = silu(g) * u in place (zeros stay +0)
    uint4 w[NR];
    load_rows<NR>(w, xu, row0, ncvt, cv, nrows, in_group && col_ok);
#pragma unroll
    for (int j = 0; j < NR; ++j) v[j] = swiglu_vec<IN>(v[j], w[j]);
  }
  qdq_dim1_cast<IN, OUT, ELEM, FUSED, RL>(v, y1, y0, row0, ncvt, cv, nrows, col_ok, p);
}

// The SwiGLU backward then the dim0+dim1 qdq of both its outputs (swiglu_bwd_qdq_dim0_dim1): the
// units, loads and casts of qdq_dim1_kernel's FUSED variant, on dh, g and u (one layout) read once;
// each thread forms dg and du of its NR row vectors in registers (swiglu_bwd_vec) and casts dg into
// dg0 / dg1, then du into du0 / du1. Rows in no group load as zeros: dg = du = +0 there.
template <int IN, int OUT, int ELEM, int RL>
__global__ void __launch_bounds__(kThreads, RL == 8 ? 3 : 2)
    swiglu_bwd_qdq_kernel(const uint4* __restrict__ dh, const uint4* __restrict__ g, const uint4* __restrict__ u,
                          uint32_t* __restrict__ dg0, uint32_t* __restrict__ dg1, uint32_t* __restrict__ du0,
                          uint32_t* __restrict__ du1, int64_t R, int64_t ncvt, int64_t nbm, int64_t ncc,
                          int64_t units, Groups gr, ScaleArgs p) {
  constexpr int NCV = 32 / RL;
  constexpr int NR = 32 / RL;
  const int lane = threadIdx.x & 31;
  const int64_t unit = static_cast<int64_t>(blockIdx.x) * (kThreads / 32) + (threadIdx.x >> 5);
  if (unit >= units) return;
  const int64_t cc = unit % ncc;
  int64_t t0, t_end;
  bool in_group;
  if (!unit_rows(unit, ncc, R, nbm, gr, t0, t_end, in_group)) return;
  const int64_t cv = cc * NCV + (lane % NCV);
  const int64_t row0 = t0 + (lane / NCV) * NR;
  const int64_t left = t_end - row0;
  const int nrows = static_cast<int>(left < 0 ? 0 : (left < NR ? left : NR));
  const bool col_ok = cv < ncvt;
  uint4 a[NR], b[NR];
  {
    uint4 c[NR];  // every load issued before the first use
    load_rows<NR>(a, dh, row0, ncvt, cv, nrows, in_group && col_ok);
    load_rows<NR>(c, g, row0, ncvt, cv, nrows, in_group && col_ok);
    load_rows<NR>(b, u, row0, ncvt, cv, nrows, in_group && col_ok);
#pragma unroll
    for (int j = 0; j < NR; ++j) swiglu_bwd_vec<IN>(a[j], c[j], b[j]);  // a: dg, b: du
  }
  qdq_dim1_cast<IN, OUT, ELEM, true, RL>(a, dg1, dg0, row0, ncvt, cv, nrows, col_ok, p);
  qdq_dim1_cast<IN, OUT, ELEM, true, RL>(b, du1, du0, row0, ncvt, cv, nrows, col_ok, p);
}

// Any block size, any alignment: one thread per (row block, column); row blocks of bs rows from
// each matrix's first row (nblk = B * ceil(R / bs)), or with groups the padded row space's blocks
// (nblk its upper bound), the last one short (its rows only: zeros do not change the amax); rows
// in no group get +0.
template <int IN, int OUT, int ELEM>
__global__ void __launch_bounds__(kThreads) qdq_dim1_generic_kernel(const Raw<IN>* __restrict__ x,
                                                                    void* __restrict__ y, int64_t nblk, int64_t R,
                                                                    int64_t C, int bs, Groups g, ScaleArgs p) {
  const int64_t nbm = (R + bs - 1) / bs;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; idx < nblk * C;
       idx += static_cast<int64_t>(gridDim.x) * kThreads) {
    const int64_t c = idx % C;
    const int64_t pb = idx / C;
    int64_t t0, t_end;
    bool in_group = true;
    if (g.offs != nullptr) {
      in_group = group_block_thread(g, R, bs, pb, t0, t_end);
    } else {
      const int64_t b = pb / nbm;
      t0 = b * R + (pb - b * nbm) * bs;
      t_end = b * R + R;
    }
    if (t0 >= t_end) continue;
    const int n = static_cast<int>(t_end - t0 < bs ? t_end - t0 : bs);
    const int64_t base = t0 * C + c;
    auto store = [&](int i, uint32_t bits) {
      if constexpr (OUT == MX_BF16) {
        static_cast<uint16_t*>(y)[base + i * C] = static_cast<uint16_t>(bits);
      } else {
        static_cast<uint32_t*>(y)[base + i * C] = bits;
      }
    };
    if (!in_group) {
      for (int i = 0; i < n; ++i) store(i, 0u);
      continue;
    }
    quantize_block_generic<IN, ELEM>(x + base, C, n, p, [&](int i, uint8_t q, uint32_t sb) {
      store(i, dequant_bits<OUT>(fp8x2_to_f32<ELEM>(q).x, e8m0_to_f32(sb)));
    });
  }
}

}  // namespace
