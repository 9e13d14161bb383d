// MX cast kernels for Hopper (sm_90), bit-identical to mxmoe/quant/torch_cast.py (docs/mx-format.md).
//
// Numerics. Block scales come from integer fp32 bit patterns (amax = integer max of |bits|). The
// only float arithmetic is (a) the RCEIL descale amax * fp32(1/max), used only above the T126
// threshold where it is a normal number, (b) the element product x * 2^-e and (c) the dequantize
// product q * 2^(s-127). All three are written as `mul.rn.f32` in inline PTX, which never flushes
// subnormals whatever -ftz / --use_fast_math says. fp32 -> fp8 uses the sm_89+ conversion
// `cvt.rn.satfinite.{e4m3,e5m2}x2.f32` (round to nearest even, fp8 subnormals, saturating), after
// an explicit clamp to +-max as the spec says.
//
//
// Kernels (one per cast, the fastest of the H200 sweep, plus generic kernels for everything else):
//   dim0, block 32:   dim0_grp_kernel: 256 threads, a warp quantizes groups of 16-byte input vectors
//                     (lane shuffles give each lane 16 contiguous fp8 bytes to store, 4-byte scale
//                     stores), two groups in flight per warp, one CTA per 16 groups.
//   dim1 / dim0+dim1, block 32: dim1_tile_kernel: one CTA per 256-row x 128-col tile loaded with
//                     cp.async into shared memory, column-pair quantization into a transposed fp8
//                     tile, 16-byte stores along the output rows; the fused cast also quantizes the
//                     tile along its rows (16-byte fp8 stores via lane shuffles).
//   dequantize:       dequant_flat_kernel: one-shot grid, 8 fp8 bytes per thread-vector, two vectors
//                     per thread, 256 threads per CTA.
//   qdq dim0, block 32: qdq_dim0_kernel: one-shot grid, four 16-byte input vectors per thread,
//                     quantize_vec32 (the dim0 cast's) then dequant_pairs (the dequantize's) in
//                     registers, stored in x's layout; no q or s in memory.
//   qdq dim1 / dim0+dim1, block 32: qdq_dim1_kernel: one warp per 32-row block x 16 (8) column
//                     vectors, 16-byte loads held in registers, quantize_col (the dim1 cast's) and
//                     fp8x2_to_f32 / dequant_bits (the dequantize's) per column, 16-byte stores in
//                     x's layout; the fused variant adds quantize_vec32 + dequant_pairs per row.
//                     Expert groups: the kernel finds a block's group from offs (group_block_warp:
//                     per-lane runs of groups, a shuffle scan, a ballot; once per CTA where its
//                     warps share a row block); no scratch, no pre-kernel.
//   SwiGLU + qdq dim0+dim1, block 32: qdq_dim1_kernel's fused variant with the SWIGLU prologue: it
//                     loads g and u and forms h = silu(g) * u in registers (swiglu_vec), as eager
//                     PyTorch does; h is never written (mx_swiglu_qdq_dim0_dim1).
//   SwiGLU backward + qdq dim0+dim1 of dg and du, block 32: swiglu_bwd_qdq_kernel, qdq_dim1_kernel's
//                     units and casts (qdq_dim1_cast) on dg and du formed in registers from one read
//                     of dh, g and u (swiglu_bwd_vec), as eager PyTorch's `dh * F.silu(g)` and
//                     `silu_backward(dh * u, g)`; dg and du are never written (mx_swiglu_bwd_qdq_dim0_dim1).
//   other block sizes or misaligned pointers: generic kernels, one thread per block (correct, slow).
//   rows after the last group (mx_zero_rows_after; torch._grouped_mm's output, the grouped qdq's
//                     generic path): zero_rows_after_kernel, a warp per row, 16-byte stores where
//                     the rows are 16-byte aligned, the first row read from offs on the device.
#include "mx_cast.h"

#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <type_traits>

namespace {

constexpr int kThreads = 256;
constexpr uint32_t kAbsMask = 0x7FFFFFFFu;
constexpr uint32_t kInfBits = 0x7F800000u;
constexpr uint32_t kNan4 = 0x7F7F7F7Fu;  // four fp8 NaN bytes (0x7F) of a non-finite block

struct ScaleArgs {
  int mode;
  uint32_t t127;
  uint32_t t126;
  float rceil_c;
};

template <int ELEM>
struct Elem;
template <>
struct Elem<MX_E4M3> {
  static constexpr int emax = 8;
  static constexpr int mbits = 3;
  static constexpr float max = 448.0f;
  static constexpr __nv_fp8_interpretation_t interp = __NV_E4M3;
};
template <>
struct Elem<MX_E5M2> {
  static constexpr int emax = 15;
  static constexpr int mbits = 2;
  static constexpr float max = 57344.0f;
  static constexpr __nv_fp8_interpretation_t interp = __NV_E5M2;
};

// Raw storage of an input element: bf16 bits or fp32 bits.
template <int IN>
using Raw = typename std::conditional<IN == MX_BF16, uint16_t, uint32_t>::type;

template <int IN>
__device__ __forceinline__ uint32_t f32_bits(Raw<IN> v) {
  if constexpr (IN == MX_BF16) {
    return static_cast<uint32_t>(v) << 16;
  } else {
    return v;
  }
}

// fp32 bits of element j of N 32-bit words of input (a 16-byte vector: N = 4; little endian).
template <int IN, int N>
__device__ __forceinline__ uint32_t vec_bits(const uint32_t (&w)[N], int j) {
  if constexpr (IN == MX_BF16) {
    return (j & 1) ? (w[j >> 1] & 0xFFFF0000u) : (w[j >> 1] << 16);
  } else {
    return w[j];
  }
}

// IEEE fp32 multiply, round to nearest even, subnormal inputs and results kept (no .ftz).
__device__ __forceinline__ float mul_rn(float a, float b) {
  float d;
  asm("mul.rn.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
  return d;
}

// Unbiased block exponent e in [-127, 127] from the amax bit pattern A of a finite block
// (torch_cast.scale_exponent). For a non-finite A the value is unused (but well defined).
// FM >= 0: the mode is that compile-time constant (p.mode is ignored; the launcher dispatched on it).
template <int ELEM, int FM = -1>
__device__ __forceinline__ int block_exponent(uint32_t A, const ScaleArgs& p) {
  constexpr int emax = Elem<ELEM>::emax;
  const int mode = FM >= 0 ? FM : p.mode;
  int e;
  if (mode == MX_FLOOR) {
    e = static_cast<int>(A >> 23) - 127 - emax;
  } else if (mode == MX_CEIL) {
    e = static_cast<int>(A >> 23) - 127 + ((A & 0x7FFFFFu) != 0u) - emax;
  } else if (mode == MX_EVEN) {
    e = static_cast<int>((A + (1u << (22 - Elem<ELEM>::mbits))) >> 23) - 127 - emax;
  } else {  // RCEIL: the fp32 product is only formed where it is a normal number
    if (A <= p.t127) {
      e = -127;
    } else if (A <= p.t126) {
      e = -126;
    } else {
      const uint32_t d = __float_as_uint(mul_rn(__uint_as_float(A), p.rceil_c));
      e = static_cast<int>(d >> 23) - 127 + ((d & 0x7FFFFFu) != 0u);
    }
  }
  return min(max(e, -127), 127);
}

// 2^-e as an fp32 number built from bits (normal for e in [-127, 126]).
__device__ __forceinline__ float recip_pow2(int e) { return __uint_as_float(static_cast<uint32_t>(127 - e) << 23); }

__device__ __forceinline__ uint32_t scale_byte(uint32_t A, int e) {
  return A >= kInfBits ? 0xFFu : static_cast<uint32_t>(e + 127);
}

// Two elements (fp32 bits) -> two fp8 bytes (a in the low byte): y = x * r, clamp, RNE + satfinite.
// CLAMP=false drops the explicit clamp: cvt.rn.satfinite already maps every finite |y| > max to
// +-max (PTX ISA: "if the absolute value of the input is greater than MAX_NORM ... the result is
// sign-preserved MAX_NORM"), and y is always finite here (|y| < 2^(emax+1) for finite blocks).
template <int ELEM, bool CLAMP = true>
__device__ __forceinline__ uint32_t quant2(uint32_t a_bits, uint32_t b_bits, float r) {
  constexpr float m = Elem<ELEM>::max;
  float a = mul_rn(__uint_as_float(a_bits), r);
  float b = mul_rn(__uint_as_float(b_bits), r);
  if constexpr (CLAMP) {
    a = fminf(fmaxf(a, -m), m);
    b = fminf(fmaxf(b, -m), m);
  }
  return static_cast<uint32_t>(__nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, Elem<ELEM>::interp));
}

// Four elements -> one 32-bit word of fp8 bytes (element 0 in the low byte).
template <int ELEM, bool CLAMP = true>
__device__ __forceinline__ uint32_t quant4(uint32_t x0, uint32_t x1, uint32_t x2, uint32_t x3, float r) {
  return quant2<ELEM, CLAMP>(x0, x1, r) | (quant2<ELEM, CLAMP>(x2, x3, r) << 16);
}

// One 16-byte input vector of a 32-element block shared by LPB consecutive lanes: amax across the
// lanes, then VEC fp8 bytes in out[0 .. VEC/4). Every lane of the warp must call it (shuffles).
// bf16: the amax of the vector by packed 16x2 integer max of the absolute bit patterns (then the two
// halves as fp32 bit patterns), fp32: one max per element.
template <int IN, int ELEM, bool CLAMP = true, int FM = -1>
__device__ __forceinline__ uint32_t quantize_vec32(const uint4& v, const ScaleArgs& p, uint32_t (&out)[4]) {
  constexpr int VEC = 16 / static_cast<int>(sizeof(Raw<IN>));
  constexpr int LPB = 32 / VEC;
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
  uint32_t A = 0;
  if constexpr (IN == MX_BF16) {
    const uint32_t M = __vmaxu2(__vmaxu2(w[0] & 0x7FFF7FFFu, w[1] & 0x7FFF7FFFu),
                                __vmaxu2(w[2] & 0x7FFF7FFFu, w[3] & 0x7FFF7FFFu));
    A = max(M << 16, M & 0xFFFF0000u);
  } else {
#pragma unroll
    for (int j = 0; j < VEC; ++j) A = max(A, vec_bits<IN>(w, j) & kAbsMask);
  }
#pragma unroll
  for (int o = 1; o < LPB; o <<= 1) A = max(A, __shfl_xor_sync(0xFFFFFFFFu, A, o));
  const int e = block_exponent<ELEM, FM>(A, p);
  const float r = recip_pow2(e);
  const bool nonfinite = A >= kInfBits;
#pragma unroll
  for (int k = 0; k < VEC / 4; ++k) {
    const uint32_t packed = quant4<ELEM, CLAMP>(vec_bits<IN>(w, 4 * k), vec_bits<IN>(w, 4 * k + 1),
                                         vec_bits<IN>(w, 4 * k + 2), vec_bits<IN>(w, 4 * k + 3), r);
    out[k] = nonfinite ? kNan4 : packed;
  }
  return scale_byte(A, e);
}

// One column block of N rows (N % 4 == 0) with amax bit pattern A (over its N rows, and over
// whatever other rows share its scale): bits(i) = fp32 bits of row i -> o[N / 4] fp8 words (row 0
// in the low byte of o[0]); returns the scale byte. The dim1 cast (dim1_tile_kernel) and the dim1
// qdq (qdq_dim1_kernel) quantize their column blocks with it; no explicit clamp (see quant2).
template <int ELEM, int FM, int N, typename Bits>
__device__ __forceinline__ uint32_t quantize_col(uint32_t A, const ScaleArgs& p, Bits&& bits, uint32_t (&o)[N / 4]) {
  const int e = block_exponent<ELEM, FM>(A, p);
  const float rs = recip_pow2(e);
  const bool nonfinite = A >= kInfBits;
#pragma unroll
  for (int kk = 0; kk < N / 4; ++kk) {
    const uint32_t packed = quant4<ELEM, false>(bits(4 * kk), bits(4 * kk + 1), bits(4 * kk + 2), bits(4 * kk + 3), rs);
    o[kk] = nonfinite ? kNan4 : packed;
  }
  return scale_byte(A, e);
}

// Transpose within each G-lane group (G * WV == 4): lane G*m + j ends with out[j][0 .. WV) of lanes
// G*m + 0 .. G-1, in lane order, in fin[0 .. 4). Every lane of the warp must call it (shuffles).
template <int G, int WV>
__device__ __forceinline__ void group_transpose(const uint32_t (&out)[G][4], int lane, uint32_t (&fin)[4]) {
  static_assert(G * WV == 4, "16 bytes per lane");
  const int j = lane & (G - 1);
#pragma unroll
  for (int r = 0; r < G; ++r) {
    const int send_c = (j - r) & (G - 1);
    const int k = (j + r) & (G - 1);
#pragma unroll
    for (int w = 0; w < WV; ++w) {
      uint32_t send = out[0][w];
#pragma unroll
      for (int c = 1; c < G; ++c) send = send_c == c ? out[c][w] : send;
      const uint32_t recv = r == 0 ? send : __shfl_sync(0xFFFFFFFFu, send, (lane & ~(G - 1)) | k);
#pragma unroll
      for (int kk = 0; kk < G; ++kk) {
        if (kk == k) fin[kk * WV + w] = recv;
      }
    }
  }
}

// dim0, block 32, "grouped": a warp handles a group of G chunks of 32 consecutive 16-byte vectors
// (G = 2 for bf16, 4 for fp32; GV = 32 * G vectors). Lane l loads vector l of every chunk (each
// load instruction is 512 contiguous bytes), quantizes it (amax over the LPB lanes of a block, as in
// quantize_vec32), then G lanes exchange their fp8 words with shuffles so that every lane holds 16
// contiguous fp8 bytes (G consecutive vectors of one chunk): one 16-byte store per lane instead of
// G 8- / 4-byte stores. The 16 scale bytes of a group are gathered by lanes 0..3 (4 shuffles) and
// written as four 4-byte words (one store instruction) instead of 16 one-byte stores.

// dim0, block 32, "grouped": a warp handles a group of G chunks of 32 consecutive 16-byte vectors
// (G = 2 for bf16, 4 for fp32; GV = 32 * G vectors). Lane l loads vector l of every chunk (each
// load instruction is 512 contiguous bytes), quantizes it (amax over the LPB lanes of a block, as in
// quantize_vec32), then G lanes exchange their fp8 words with shuffles so that every lane holds 16
// contiguous fp8 bytes (G consecutive vectors of one chunk): one 16-byte store per lane instead of
// G 8- / 4-byte stores. The 16 scale bytes of a group are gathered by lanes 0..3 (4 shuffles) and
// written as four 4-byte words (one store instruction) instead of 16 one-byte stores.
// U = 2 groups per warp per loop trip, all U * G loads issued before the first use; the launcher
// gives one CTA per 8 warps x U groups (the loop runs once), a one-shot grid.
template <int IN, int ELEM>
__global__ void __launch_bounds__(kThreads) dim0_grp_kernel(const uint4* __restrict__ x, uint8_t* __restrict__ q,
                                                            uint8_t* __restrict__ s, int64_t nvec, ScaleArgs p) {
  constexpr int U = 2;
  constexpr int VEC = 16 / static_cast<int>(sizeof(Raw<IN>));  // elements per vector: 8 / 4
  constexpr int LPB = 32 / VEC;                                 // lanes per block: 4 / 8
  constexpr int WV = VEC / 4;                                   // fp8 words per vector: 2 / 1
  constexpr int G = 4 / WV;                                     // chunks per group: 2 / 4
  constexpr int GV = 32 * G;                                    // vectors per group
  constexpr int BPC = 32 / LPB;                                 // blocks per chunk: 8 / 4
  static_assert(G * BPC == 16, "16 scale bytes per group");
  constexpr int WARPS = kThreads / 32;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int j = lane & (G - 1);
  const int64_t ngroups = (nvec + GV - 1) / GV;
  const int64_t nblk = nvec / LPB;
  const int64_t step = static_cast<int64_t>(gridDim.x) * WARPS * U;
  // The loop bound is uniform per CTA, so every lane reaches the shuffles.
  for (int64_t g0 = static_cast<int64_t>(blockIdx.x) * WARPS * U; g0 < ngroups; g0 += step) {
    uint4 v[U][G];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t gbase = (g0 + u * WARPS + warp) * GV;
#pragma unroll
      for (int c = 0; c < G; ++c) {
        const int64_t i = gbase + c * 32 + lane;
        v[u][c] = i < nvec ? __ldcs(x + i) : make_uint4(0u, 0u, 0u, 0u);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t grp = g0 + u * WARPS + warp;
      uint32_t out[G][4];
      uint32_t S = 0;
#pragma unroll
      for (int c = 0; c < G; ++c) S |= quantize_vec32<IN, ELEM, false>(v[u][c], p, out[c]) << (8 * c);
      uint32_t fin[4];
      group_transpose<G, WV>(out, lane, fin);
      const int64_t vi = grp * GV + j * 32 + (lane & ~(G - 1));  // first of this lane's G vectors
      if (vi < nvec) __stcs(reinterpret_cast<uint4*>(q + vi * VEC), make_uint4(fin[0], fin[1], fin[2], fin[3]));
      // Scales: lane w < 4 writes blocks 4w .. 4w+3 of the group.
      uint32_t sw = 0;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int b = 4 * (lane & 3) + i;
        const int c = b / BPC;
        const uint32_t t = __shfl_sync(0xFFFFFFFFu, S, (b % BPC) * LPB);
        sw |= ((t >> (8 * c)) & 0xFFu) << (8 * i);
      }
      const int64_t b0 = grp * 16 + 4 * lane;
      if (lane < 4 && b0 < nblk) {
        if (b0 + 4 <= nblk) {
          *reinterpret_cast<uint32_t*>(s + b0) = sw;
        } else {
          for (int i = 0; b0 + i < nblk; ++i) s[b0 + i] = static_cast<uint8_t>(sw >> (8 * i));
        }
      }
    }
  }
}

// dim1 (and fused dim0+dim1), block 32: one CTA per (batch, TR-row, TC-col) tile (TR = 256: 256
// contiguous fp8 bytes per output column; TC = 128: 256 contiguous input bytes per bf16 tile row),
// dynamic shared memory:
//  - loads: cp.async.cg, 16 bytes (zero-fill outside the tensor, no registers);
//  - dim1 quantization: bf16 threads own a column pair (32-bit shared-memory reads of 32 rows, the
//    packed amax with one 16x2 max per word), fp32 threads one column; the transposed fp8 tile puts
//    column c at row (c % CPT) * (TC / CPT) + c / CPT so that both 16-byte store instructions of a
//    warp are conflict-free (pitch TR + 16); no explicit clamp (see quant2);
//  - fused dim0 part: each thread quantizes 16-byte vectors of the shared tile along its rows
//    (quantize_vec32), G vectors at a time; group_transpose gives each lane 16 contiguous fp8 bytes
//    (one 16-byte store) and the row's first lane gathers the TC / 32 scale bytes of the tile row
//    (shuffles) and writes them with one 2- / 4-byte store where aligned.
// FM >= 0 compiles the scale mode in (the launcher dispatches RCEIL and FLOOR of e4m3 so).
// Needs x 16-byte aligned and C % VEC == 0 (the launcher falls back to the generic kernels
// otherwise); arbitrary C (masked), R % 32 == 0, batch via the grid index.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const int src_size = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(gmem), "r"(src_size) : "memory");
}

template <int IN, int TR, int TC>
struct TileSmem {
  static constexpr int kRowPitch = TC * static_cast<int>(sizeof(Raw<IN>));  // input tile, bytes
  static constexpr int kTile = TR * kRowPitch;
  static constexpr int kPitch = TR + 16;  // transposed fp8 tile pitch
  static constexpr int kQt = TC * kPitch;
  static constexpr int kBytes = kTile + kQt + TC * (TR / 32);
};

template <int IN, int ELEM, bool FUSED, int TR, int TC, int MINB, int FM = -1>
__global__ void __launch_bounds__(kThreads, MINB)
    dim1_tile_kernel(const void* __restrict__ xv, uint8_t* __restrict__ q1, uint8_t* __restrict__ s1,
                     uint8_t* __restrict__ q0, uint8_t* __restrict__ s0, int64_t R, int64_t C, int64_t tiles_r,
                     int64_t tiles_c, int s1_wide, int s0_wide, ScaleArgs p) {
  using Rw = Raw<IN>;
  using Cfg = TileSmem<IN, TR, TC>;
  constexpr int BS = 32;
  constexpr int VEC = 16 / static_cast<int>(sizeof(Rw));  // elements per 16-byte vector
  constexpr int CPR = TC / VEC;                           // 16-byte vectors per tile row
  constexpr int NB = TR / BS;                             // row blocks per tile (scale bytes per column)
  constexpr int NV = TR * CPR / kThreads;                 // tile vectors per thread
  constexpr int PITCH = Cfg::kPitch;
  constexpr int TPE = Cfg::kRowPitch / static_cast<int>(sizeof(Rw));  // input tile row pitch, elements
  static_assert(NV * kThreads == TR * CPR, "tile vectors spread evenly over the threads");
  static_assert(CPR <= 32 && 32 % CPR == 0, "a tile row's vectors lie in one warp");
  static_assert(TR % BS == 0 && TC % BS == 0 && (NB == 4 || NB == 8), "tile shape");
  extern __shared__ __align__(16) uint8_t smem[];
  Rw(*tile)[TPE] = reinterpret_cast<Rw(*)[TPE]>(smem);
  uint8_t(*qt)[PITCH] = reinterpret_cast<uint8_t(*)[PITCH]>(smem + Cfg::kTile);
  uint8_t(*st)[NB] = reinterpret_cast<uint8_t(*)[NB]>(smem + Cfg::kTile + Cfg::kQt);

  int64_t t = blockIdx.x;
  const int64_t ct = t % tiles_c;
  t /= tiles_c;
  const int64_t rt = t % tiles_r;
  const int64_t b = t / tiles_r;
  const int64_t r0 = rt * TR, c0 = ct * TC;
  const Rw* __restrict__ x = static_cast<const Rw*>(xv) + b * R * C;
  const int tid = threadIdx.x;

  // Phase 1: global -> shared (C % VEC == 0: a vector is wholly inside or outside; outside reads 0).
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    const int idx = k * kThreads + tid;
    const int rr = idx / CPR, cc = (idx % CPR) * VEC;
    const int64_t r = r0 + rr, c = c0 + cc;
    const bool ok = r < R && c < C;
    cp_async16(&tile[rr][cc], ok ? static_cast<const void*>(x + r * C + c) : xv, ok);
  }
  asm volatile("cp.async.wait_all;" ::: "memory");
  __syncthreads();

  if constexpr (FUSED) {
    // Blocks along the tile rows (C % 32 == 0: the LPB lanes of a block, and the G vectors of a
    // 16-byte output, agree on validity). Vector idx = k * kThreads + tid; lanes of one tile row
    // are the CPR consecutive lanes lane0 .. lane0 + CPR - 1 of one warp.
    constexpr int LPB = BS / VEC;  // lanes per block: 4 / 8
    constexpr int WV = VEC / 4;    // fp8 words per vector: 2 / 1
    constexpr int G = 4 / WV;      // vectors per 16-byte output: 2 / 4
    constexpr int NBC = TC / BS;   // blocks (scale bytes) per tile row: 2 / 4
    static_assert(NV % G == 0 && CPR % G == 0 && (NBC == 2 || NBC == 4), "fused tile shape");
    const int lane = tid & 31;
    const int j = lane & (G - 1);
    const int row_lane0 = lane & ~(CPR - 1);
    const int64_t nblk_row = C / BS;  // scale bytes per row of s0
    const int64_t nbc = min(static_cast<int64_t>(NBC), (C - c0) / BS);  // valid blocks of this tile row
#pragma unroll
    for (int k0 = 0; k0 < NV; k0 += G) {
      uint32_t out[G][4];
#pragma unroll
      for (int g = 0; g < G; ++g) {
        const int idx = (k0 + g) * kThreads + tid;
        const int rr = idx / CPR, cc = (idx % CPR) * VEC;
        const uint32_t sb =
            quantize_vec32<IN, ELEM, false, FM>(*reinterpret_cast<const uint4*>(&tile[rr][cc]), p, out[g]);
        // The first lane of the tile row gathers its NBC scale bytes.
        uint32_t sw = 0;
#pragma unroll
        for (int bb = 0; bb < NBC; ++bb) sw |= __shfl_sync(0xFFFFFFFFu, sb, row_lane0 + bb * LPB) << (8 * bb);
        const int64_t r = r0 + rr;
        if (lane == row_lane0 && r < R && nbc > 0) {
          uint8_t* dst = s0 + r * nblk_row + c0 / BS;
          if (s0_wide && nbc == NBC) {
            if constexpr (NBC == 2) {
              *reinterpret_cast<uint16_t*>(dst) = static_cast<uint16_t>(sw);
            } else {
              *reinterpret_cast<uint32_t*>(dst) = sw;
            }
          } else {
            for (int bb = 0; bb < nbc; ++bb) dst[bb] = static_cast<uint8_t>(sw >> (8 * bb));
          }
        }
      }
      uint32_t fin[4];
      group_transpose<G, WV>(out, lane, fin);
      // This lane: vectors (tid & ~(G-1)) .. + G-1 of vector row k0 + j: 16 contiguous fp8 bytes.
      const int idx = (k0 + j) * kThreads + (tid & ~(G - 1));
      const int64_t r = r0 + idx / CPR, c = c0 + (idx % CPR) * VEC;
      if (r < R && c < C) *reinterpret_cast<uint4*>(q0 + r * C + c) = make_uint4(fin[0], fin[1], fin[2], fin[3]);
    }
  }

  // Phase 2: one thread per (CPT columns, 32-row block) -> transposed fp8 tile in shared memory.
  {
    constexpr int CPT = IN == MX_BF16 ? 2 : 1;  // columns per thread (one 32-bit word per row)
    constexpr int NP = TC / CPT;                // column groups per tile
    constexpr int UNITS = NP * NB;
    static_assert(NP % 32 == 0, "a warp reads one row block");
#pragma unroll
    for (int k = 0; k < (UNITS + kThreads - 1) / kThreads; ++k) {
      const int u = k * kThreads + tid;
      const int cp = u % NP, rb = u / NP;
      if ((UNITS % kThreads == 0 || u < UNITS) && c0 + cp * CPT < C && r0 + rb * BS < R) {
        uint32_t w[BS];
        uint32_t M = 0;
#pragma unroll
        for (int i = 0; i < BS; ++i) {
          w[i] = *reinterpret_cast<const uint32_t*>(&tile[rb * BS + i][cp * CPT]);
          if constexpr (IN == MX_BF16) {
            M = __vmaxu2(M, w[i] & 0x7FFF7FFFu);
          } else {
            M = max(M, w[i] & kAbsMask);
          }
        }
#pragma unroll
        for (int h = 0; h < CPT; ++h) {
          const int col = cp * CPT + h;
          if (h > 0 && c0 + col >= C) break;
          // fp32 bits of row i of this column.
          auto bits = [&](int i) -> uint32_t {
            if constexpr (IN == MX_BF16) {
              return h == 0 ? w[i] << 16 : w[i] & 0xFFFF0000u;
            } else {
              return w[i];
            }
          };
          const uint32_t A = IN == MX_BF16 ? (h == 0 ? M << 16 : M & 0xFFFF0000u) : M;
          uint32_t o[BS / 4];
          const uint32_t sb = quantize_col<ELEM, FM, BS>(A, p, bits, o);
          uint8_t* qrow = qt[h * NP + cp];  // column col = cp * CPT + h
          *reinterpret_cast<uint4*>(qrow + rb * BS) = make_uint4(o[0], o[1], o[2], o[3]);
          *reinterpret_cast<uint4*>(qrow + rb * BS + 16) = make_uint4(o[4], o[5], o[6], o[7]);
          st[col][rb] = static_cast<uint8_t>(sb);
        }
      }
    }
  }
  __syncthreads();

  // Phase 3: 16-byte stores along rows of the transposed output (R % 32 == 0: whole vectors).
  {
    constexpr int CPT = IN == MX_BF16 ? 2 : 1;
    constexpr int NP = TC / CPT;
    constexpr int CH = TR / 16;  // 16-byte chunks per output column
    static_assert((TC * CH) % kThreads == 0 && TC <= kThreads, "even split");
    uint8_t* __restrict__ qb = q1 + b * C * R;
#pragma unroll
    for (int k = 0; k < TC * CH / kThreads; ++k) {
      const int idx = k * kThreads + tid;
      const int col = idx / CH, ch = idx % CH;
      const int64_t c = c0 + col, r = r0 + ch * 16;
      if (c < C && r < R) {
        *reinterpret_cast<uint4*>(qb + c * R + r) =
            *reinterpret_cast<const uint4*>(&qt[(col % CPT) * NP + col / CPT][ch * 16]);
      }
    }
    if (tid < TC && c0 + tid < C) {
      const int64_t nsr = R / BS;  // scales per output row
      uint8_t* dst = s1 + (b * C + c0 + tid) * nsr + r0 / BS;
      const int64_t nb = min(static_cast<int64_t>(NB), (R - r0) / BS);
      if (s1_wide && nb == NB) {
        if constexpr (NB == 4) {
          *reinterpret_cast<uint32_t*>(dst) = *reinterpret_cast<const uint32_t*>(&st[tid][0]);
        } else {
          *reinterpret_cast<uint2*>(dst) = *reinterpret_cast<const uint2*>(&st[tid][0]);
        }
      } else {
        for (int jj = 0; jj < nb; ++jj) dst[jj] = st[tid][jj];
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Generic kernels: any block size, any alignment. One thread per block.
template <int IN, int ELEM>
__device__ __forceinline__ uint8_t quant1(uint32_t x_bits, float r) {
  return static_cast<uint8_t>(quant2<ELEM>(x_bits, 0u, r) & 0xFFu);
}

// A block of bs elements at x, x + stride, ...: emit(i, fp8 byte of element i, scale byte) for each
// element, returns the scale byte. The cast kernels store
// the bytes; the qdq kernel dequantizes them in registers.
template <int IN, int ELEM, typename Emit>
__device__ __forceinline__ uint32_t quantize_block_generic(const Raw<IN>* x, int64_t stride, int bs,
                                                           const ScaleArgs& p, Emit&& emit) {
  uint32_t A = 0;
  for (int i = 0; i < bs; ++i) A = max(A, f32_bits<IN>(x[i * stride]) & kAbsMask);
  const int e = block_exponent<ELEM>(A, p);
  const float r = recip_pow2(e);
  const bool nonfinite = A >= kInfBits;
  const uint32_t sb = scale_byte(A, e);
  for (int i = 0; i < bs; ++i) {
    emit(i, nonfinite ? uint8_t(0x7F) : quant1<IN, ELEM>(f32_bits<IN>(x[i * stride]), r), sb);
  }
  return sb;
}

template <int IN, int ELEM>
__global__ void __launch_bounds__(kThreads) dim0_generic_kernel(const Raw<IN>* __restrict__ x, uint8_t* __restrict__ q,
                                                                uint8_t* __restrict__ s, int64_t nblk, int bs,
                                                                ScaleArgs p) {
  for (int64_t blk = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; blk < nblk;
       blk += static_cast<int64_t>(gridDim.x) * kThreads) {
    uint8_t* qb = q + blk * bs;
    s[blk] = static_cast<uint8_t>(
        quantize_block_generic<IN, ELEM>(x + blk * bs, 1, bs, p, [&](int i, uint8_t b, uint32_t) { qb[i] = b; }));
  }
}

// x (B, R, C) -> q (B, C, R), s (B, C, R / bs); one thread per (b, row block, c), c fastest.
template <int IN, int ELEM>
__global__ void __launch_bounds__(kThreads) dim1_generic_kernel(const Raw<IN>* __restrict__ x, uint8_t* __restrict__ q,
                                                                uint8_t* __restrict__ s, int64_t B, int64_t R,
                                                                int64_t C, int bs, ScaleArgs p) {
  const int64_t nrb = R / bs;
  const int64_t total = B * nrb * C;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * kThreads) {
    const int64_t c = idx % C;
    const int64_t rest = idx / C;
    const int64_t rb = rest % nrb, b = rest / nrb;
    uint8_t* qb = q + (b * C + c) * R + rb * bs;
    s[(b * C + c) * nrb + rb] = static_cast<uint8_t>(
        quantize_block_generic<IN, ELEM>(x + (b * R + rb * bs) * C + c, C, bs, p, [&](int i, uint8_t v, uint32_t) { qb[i] = v; }));
  }
}

// ---------------------------------------------------------------------------------------------
// Dequantize.
__device__ __forceinline__ float e8m0_to_f32(uint32_t sb) {
  const uint32_t bits = sb == 0u ? 0x00400000u : (sb == 0xFFu ? 0x7FC00000u : sb << 23);
  return __uint_as_float(bits);
}

__device__ __forceinline__ float half_bits_to_f32(unsigned short h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}

// Two fp8 bytes (low byte first) -> two exact fp32 values.
template <int ELEM>
__device__ __forceinline__ float2 fp8x2_to_f32(uint32_t two) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two & 0xFFFFu), Elem<ELEM>::interp);
  return make_float2(half_bits_to_f32(h.x), half_bits_to_f32(h.y));
}

__device__ __forceinline__ uint32_t bf16_bits_rn(float v) {
  unsigned short h;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(v));
  return h;
}

// q * scale with a canonical NaN: fp32 0x7FC00000, bf16 0x7FC0 (what torch's CPU bf16 conversion writes).
template <int OUT>
__device__ __forceinline__ uint32_t dequant_bits(float qv, float scale) {
  const float v = mul_rn(qv, scale);
  if constexpr (OUT == MX_BF16) {
    return v != v ? 0x7FC0u : bf16_bits_rn(v);
  } else {
    return v != v ? 0x7FC00000u : __float_as_uint(v);
  }
}

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
// SwiGLU prologue of the fused qdq (swiglu_qdq_dim0_dim1): h = silu(g) * u formed in registers as
// eager PyTorch forms `F.silu(g) * u` on CUDA. silu: ATen's silu_kernel (ActivationSiluKernel.cu),
// x / (1 + exp(-x)) in fp32 (the opmath type of bf16 and fp32) with CUDA's expf (this file is
// built without fast math, as ATen is: expf is not replaced by __expf), then rounded to the input
// dtype; the product: ATen's mul in fp32, rounded to the input dtype. Every step is an IEEE
// operation with round to nearest even and no flush (add.rn / div.rn / mul.rn, cvt.rn.bf16x2.f32)
// except expf, CUDA's libdevice function: the same one ATen's kernel calls, bit for bit as long as
// torch and this extension are built with CUDA math libraries that agree (the GPU test compares
// against torch on the device).
__device__ __forceinline__ float div_rn(float a, float b) {
  float d;
  asm("div.rn.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
  return d;
}

// 1 + exp(-x): the denominator of silu and of silu's backward (ATen's kernels, one expf each).
__device__ __forceinline__ float one_plus_exp_neg(float x) {
  float d;
  asm("add.rn.f32 %0, %1, %2;" : "=f"(d) : "f"(1.0f), "f"(expf(-x)));
  return d;
}

__device__ __forceinline__ float silu_f32(float x) { return div_rn(x, one_plus_exp_neg(x)); }

// Two fp32 values -> a bf16x2 word (lo in the low half), each rounded to nearest even (NaN: the
// canonical bf16 NaN, as torch's CUDA float -> bf16 conversion).
__device__ __forceinline__ uint32_t bf16x2_rn(float lo, float hi) {
  uint32_t d;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
}

// One 32-bit word of g and u (two bf16 or one fp32 element) -> the word of h = silu(g) * u.
template <int IN>
__device__ __forceinline__ uint32_t swiglu_word(uint32_t g, uint32_t u) {
  if constexpr (IN == MX_BF16) {
    const uint32_t s = bf16x2_rn(silu_f32(__uint_as_float(g << 16)), silu_f32(__uint_as_float(g & 0xFFFF0000u)));
    return bf16x2_rn(mul_rn(__uint_as_float(s << 16), __uint_as_float(u << 16)),
                     mul_rn(__uint_as_float(s & 0xFFFF0000u), __uint_as_float(u & 0xFFFF0000u)));
  } else {
    return __float_as_uint(mul_rn(silu_f32(__uint_as_float(g)), __uint_as_float(u)));
  }
}

template <int IN>
__device__ __forceinline__ uint4 swiglu_vec(const uint4& g, const uint4& u) {
  return make_uint4(swiglu_word<IN>(g.x, u.x), swiglu_word<IN>(g.y, u.y), swiglu_word<IN>(g.z, u.z),
                    swiglu_word<IN>(g.w, u.w));
}

// SwiGLU backward (swiglu_bwd_qdq_dim0_dim1): given dh = dL/dh of h = F.silu(g) * u, dg and du as
// the unfused backward forms them on CUDA, one eager op after another, each result rounded to the
// input dtype: du = dh * F.silu(g) (silu as above, then mul) and dg = aten::silu_backward(dh * u, g).
// silu_backward: ATen's silu_backward_kernel (ActivationSiluKernel.cu) in fp32, s = 1 / (1 + exp(-x)),
// dy * s * (1 + x * (1 - s)) evaluated left to right. nvcc (default -fmad=true, as ATen is built)
// compiles that expression (sm_90 PTX) to rcp.rn(1 + e), mul(dy, s), sub(1, s), fma.rn(x, 1 - s, 1),
// mul: 1 + x * (1 - s) is one fma, written so here (fma.rn), the rest as the same IEEE operations
// (div.rn(1, d) == rcp.rn(d)). It also contracts 1 + expf(-x) with expf's last product, a power of
// two times ex2's result: exact unless subnormal (then 1 + e rounds to 1 either way), so add.rn of
// expf's value gives the same bits. expf is shared with silu (the same value). d = 1 + exp(-x).
__device__ __forceinline__ float silu_bwd_f32(float dy, float x, float d) {
  float one_s, k;
  const float s = div_rn(1.0f, d);
  asm("sub.rn.f32 %0, %1, %2;" : "=f"(one_s) : "f"(1.0f), "f"(s));
  asm("fma.rn.f32 %0, %1, %2, %3;" : "=f"(k) : "f"(x), "f"(one_s), "f"(1.0f));
  return mul_rn(mul_rn(dy, s), k);
}

// One 32-bit word of dh, g and u (two bf16 or one fp32 element) -> the words of dg (in dh) and du
// (in u).
template <int IN>
__device__ __forceinline__ void swiglu_bwd_word(uint32_t& dh, uint32_t g, uint32_t& u) {
  if constexpr (IN == MX_BF16) {
    const float x0 = __uint_as_float(g << 16), x1 = __uint_as_float(g & 0xFFFF0000u);
    const float h0 = __uint_as_float(dh << 16), h1 = __uint_as_float(dh & 0xFFFF0000u);
    const float d0 = one_plus_exp_neg(x0), d1 = one_plus_exp_neg(x1);
    const uint32_t s = bf16x2_rn(div_rn(x0, d0), div_rn(x1, d1));  // F.silu(g)
    const uint32_t t = bf16x2_rn(mul_rn(h0, __uint_as_float(u << 16)),  // dh * u
                                 mul_rn(h1, __uint_as_float(u & 0xFFFF0000u)));
    u = bf16x2_rn(mul_rn(h0, __uint_as_float(s << 16)), mul_rn(h1, __uint_as_float(s & 0xFFFF0000u)));
    dh = bf16x2_rn(silu_bwd_f32(__uint_as_float(t << 16), x0, d0),
                   silu_bwd_f32(__uint_as_float(t & 0xFFFF0000u), x1, d1));
  } else {
    const float x = __uint_as_float(g), h = __uint_as_float(dh);
    const float d = one_plus_exp_neg(x);
    const float t = mul_rn(h, __uint_as_float(u));
    u = __float_as_uint(mul_rn(h, div_rn(x, d)));
    dh = __float_as_uint(silu_bwd_f32(t, x, d));
  }
}

// 16-byte vectors of dh, g, u -> dg in dh, du in u.
template <int IN>
__device__ __forceinline__ void swiglu_bwd_vec(uint4& dh, const uint4& g, uint4& u) {
  swiglu_bwd_word<IN>(dh.x, g.x, u.x);
  swiglu_bwd_word<IN>(dh.y, g.y, u.y);
  swiglu_bwd_word<IN>(dh.z, g.z, u.z);
  swiglu_bwd_word<IN>(dh.w, g.w, u.w);
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

// ---------------------------------------------------------------------------------------------
// Host side.
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

// dequant_flat_kernel<8 bytes, 2 vectors, 256 threads> over vectors [0, nvec) with a one-shot grid,
// in as many launches as gridDim.x's limit needs (one for any n below 2^40 elements).
template <int OUT, int EL>
cudaError_t launch_dequant_flat(const uint8_t* q, const uint8_t* s, void* out, int64_t nvec, int lg_bs,
                                cudaStream_t st) {
  constexpr int kEpt = 8, kVecs = 2, kCta = 256;
  constexpr int64_t kPerCta = static_cast<int64_t>(kCta) * kVecs;
  constexpr int64_t kMaxCtas = int64_t{1} << 30;  // below gridDim.x's limit 2^31 - 1
  for (int64_t begin = 0; begin < nvec; begin += kMaxCtas * kPerCta) {
    const int64_t want = (nvec - begin + kPerCta - 1) / kPerCta;
    const unsigned grid = static_cast<unsigned>(want < kMaxCtas ? want : kMaxCtas);
    dequant_flat_kernel<OUT, EL, kEpt, kVecs, kCta>
        <<<grid, kCta, 0, st>>>(q, s, static_cast<uint32_t*>(out), begin, nvec, lg_bs);
    const cudaError_t err = launch_status();
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

// One CTA per 256 x 128 tile of dim1_tile_kernel (x 16-byte aligned, C % VEC == 0: checked by the
// caller); RCEIL and FLOOR of e4m3 with the mode compiled in.
template <int IN, int EL, bool FUSED, int FM = -1>
cudaError_t launch_dim1_tile(const void* x, uint8_t* q1, uint8_t* s1, uint8_t* q0, uint8_t* s0, int64_t B, int64_t R,
                             int64_t C, const ScaleArgs& p, cudaStream_t st) {
  if constexpr (FM < 0 && EL == MX_E4M3) {
    if (p.mode == MX_RCEIL) return launch_dim1_tile<IN, EL, FUSED, MX_RCEIL>(x, q1, s1, q0, s0, B, R, C, p, st);
    if (p.mode == MX_FLOOR) return launch_dim1_tile<IN, EL, FUSED, MX_FLOOR>(x, q1, s1, q0, s0, B, R, C, p, st);
  }
  constexpr int TR = 256, TC = 128, NB = TR / 32, NBC = TC / 32;
  constexpr int MINB = IN == MX_BF16 ? 2 : 1;  // CTAs per SM that __launch_bounds__ asks registers for
  constexpr int SMEM = TileSmem<IN, TR, TC>::kBytes;
  const int64_t tiles_r = (R + TR - 1) / TR, tiles_c = (C + TC - 1) / TC;
  const int64_t tiles = B * tiles_r * tiles_c;
  if (tiles > INT_MAX) return cudaErrorInvalidValue;
  auto kernel = dim1_tile_kernel<IN, EL, FUSED, TR, TC, MINB, FM>;
  const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM);
  if (err != cudaSuccess) return err;
  const int s1_wide = aligned(s1, NB) && (R / 32) % NB == 0;
  const int s0_wide = FUSED && aligned(s0, NBC) && (C / 32) % NBC == 0;
  kernel<<<static_cast<unsigned>(tiles), kThreads, SMEM, st>>>(x, q1, s1, q0, s0, R, C, tiles_r, tiles_c, s1_wide,
                                                               s0_wide, p);
  return launch_status();
}

template <int IN, int EL>
cudaError_t launch_dim0_generic(const void* x, uint8_t* q, uint8_t* s, int64_t n, int bs, const ScaleArgs& p,
                                cudaStream_t st) {
  const int64_t nblk = n / bs;
  auto kernel = dim0_generic_kernel<IN, EL>;
  const unsigned grid = grid_for<dim0_generic_kernel<IN, EL>>((nblk + kThreads - 1) / kThreads);
  kernel<<<grid, kThreads, 0, st>>>(static_cast<const Raw<IN>*>(x), q, s, nblk, bs, p);
  return launch_status();
}

template <int IN, int EL>
cudaError_t launch_dim1_generic(const void* x, uint8_t* q, uint8_t* s, int64_t B, int64_t R, int64_t C, int bs,
                                const ScaleArgs& p, cudaStream_t st) {
  const int64_t total = B * (R / bs) * C;
  auto kernel = dim1_generic_kernel<IN, EL>;
  const unsigned grid = grid_for<dim1_generic_kernel<IN, EL>>((total + kThreads - 1) / kThreads);
  kernel<<<grid, kThreads, 0, st>>>(static_cast<const Raw<IN>*>(x), q, s, B, R, C, bs, p);
  return launch_status();
}

// The tiled dim1 kernel's preconditions: block 32, 16-byte vectors of x never straddle a row.
template <int IN>
bool dim1_fast(const void* x, int64_t C, int block_size) {
  constexpr int VEC = 16 / static_cast<int>(sizeof(Raw<IN>));
  return block_size == 32 && aligned(x, 16) && C % VEC == 0;
}

// zero_rows_after_kernel<U> with a grid that fills the device (at most one warp per row).
template <typename U>
cudaError_t launch_zero_rows_after(void* y, const int32_t* end, int64_t rows, int64_t row_units, int64_t row_stride,
                                   cudaStream_t st) {
  const unsigned grid = grid_for<zero_rows_after_kernel<U>>((rows + kZeroRows - 1) / kZeroRows);
  zero_rows_after_kernel<U><<<grid, dim3(32, kZeroRows), 0, st>>>(static_cast<U*>(y), end, rows, row_units, row_stride);
  return launch_status();
}

}  // namespace

cudaError_t mx_quantize_dim0(const void* x, int in_dtype, uint8_t* q, uint8_t* s, int64_t n, int block_size, int mode,
                             int elem, uint32_t rceil_t127, uint32_t rceil_t126, float rceil_c, intptr_t stream) {
  if (!valid_common(in_dtype, block_size, elem) || mode < 0 || mode > 3 || n < 0 || n % block_size) {
    return cudaErrorInvalidValue;
  }
  if (n == 0) return cudaSuccess;
  const ScaleArgs p{mode, rceil_t127, rceil_t126, rceil_c};
  cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
  return dispatch(in_dtype, elem, [&](auto codes) -> cudaError_t {
    constexpr int IN = decltype(codes)::first, EL = decltype(codes)::second;
    if (block_size == 32 && aligned(x, 16) && aligned(q, 16) && aligned(s, 4)) {
      constexpr int VEC = 16 / static_cast<int>(sizeof(Raw<IN>));
      constexpr int64_t kPerCta = (kThreads / 32) * 2 * 32 * (4 / (VEC / 4));  // 8 warps x 2 groups
      const int64_t nvec = n / VEC;
      const int64_t want = (nvec + kPerCta - 1) / kPerCta;
      if (want > INT_MAX) return cudaErrorInvalidValue;
      dim0_grp_kernel<IN, EL><<<static_cast<unsigned>(want), kThreads, 0, st>>>(static_cast<const uint4*>(x), q, s,
                                                                              nvec, p);
      return launch_status();
    }
    return launch_dim0_generic<IN, EL>(x, q, s, n, block_size, p, st);
  });
}

cudaError_t mx_quantize_dim1(const void* x, int in_dtype, uint8_t* q, uint8_t* s, int64_t batch, int64_t rows,
                             int64_t cols, int block_size, int mode, int elem, uint32_t rceil_t127,
                             uint32_t rceil_t126, float rceil_c, intptr_t stream) {
  if (!valid_common(in_dtype, block_size, elem) || mode < 0 || mode > 3 || batch < 0 || rows < 0 || cols < 0 ||
      rows % block_size) {
    return cudaErrorInvalidValue;
  }
  if (batch == 0 || rows == 0 || cols == 0) return cudaSuccess;
  const ScaleArgs p{mode, rceil_t127, rceil_t126, rceil_c};
  cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
  return dispatch(in_dtype, elem, [&](auto codes) -> cudaError_t {
    constexpr int IN = decltype(codes)::first, EL = decltype(codes)::second;
    if (dim1_fast<IN>(x, cols, block_size) && aligned(q, 16)) {
      return launch_dim1_tile<IN, EL, false>(x, q, s, nullptr, nullptr, batch, rows, cols, p, st);
    }
    return launch_dim1_generic<IN, EL>(x, q, s, batch, rows, cols, block_size, p, st);
  });
}

cudaError_t mx_quantize_dim0_dim1(const void* x, int in_dtype, uint8_t* q0, uint8_t* s0, uint8_t* q1, uint8_t* s1,
                                  int64_t rows, int64_t cols, int block_size, int mode, int elem,
                                  uint32_t rceil_t127, uint32_t rceil_t126, float rceil_c, intptr_t stream) {
  if (!valid_common(in_dtype, block_size, elem) || mode < 0 || mode > 3 || rows < 0 || cols < 0 ||
      rows % block_size || cols % block_size) {
    return cudaErrorInvalidValue;
  }
  if (rows == 0 || cols == 0) return cudaSuccess;
  const ScaleArgs p{mode, rceil_t127, rceil_t126, rceil_c};
  cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
  return dispatch(in_dtype, elem, [&](auto codes) -> cudaError_t {
    constexpr int IN = decltype(codes)::first, EL = decltype(codes)::second;
    if (dim1_fast<IN>(x, cols, block_size) && aligned(q0, 16) && aligned(q1, 16)) {
      return launch_dim1_tile<IN, EL, true>(x, q1, s1, q0, s0, 1, rows, cols, p, st);
    }
    // Generic fallback: two passes over x.
    const cudaError_t err = launch_dim0_generic<IN, EL>(x, q0, s0, rows * cols, block_size, p, st);
    if (err != cudaSuccess) return err;
    return launch_dim1_generic<IN, EL>(x, q1, s1, 1, rows, cols, block_size, p, st);
  });
}

cudaError_t mx_dequantize(const uint8_t* q, const uint8_t* s, void* out, int out_dtype, int64_t n, int block_size,
                          int elem, intptr_t stream) {
  if (!valid_common(out_dtype, block_size, elem) || n < 0 || n % block_size) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
  const int lg_bs = log2_pow2(block_size);
  return dispatch(out_dtype, elem, [&](auto codes) -> cudaError_t {
    constexpr int OUT = decltype(codes)::first, EL = decltype(codes)::second;
    // 8 fp8 bytes per thread-vector (one block: block_size >= 8), stored as 16 / 2 x 16 bytes.
    if (block_size >= 8 && aligned(q, 8) && aligned(out, 16)) return launch_dequant_flat<OUT, EL>(q, s, out, n / 8, lg_bs, st);
    auto kernel = dequant_generic_kernel<OUT, EL>;
    const unsigned grid = grid_for<dequant_generic_kernel<OUT, EL>>((n + kThreads - 1) / kThreads);
    kernel<<<grid, kThreads, 0, st>>>(q, s, out, 0, n, lg_bs);
    return launch_status();
  });
}

cudaError_t mx_qdq_dim0(const void* x, int in_dtype, void* y, int out_dtype, int64_t n, int block_size, int mode,
                        int elem, uint32_t rceil_t127, uint32_t rceil_t126, float rceil_c, intptr_t stream) {
  if (!valid_common(in_dtype, block_size, elem) || (out_dtype != MX_BF16 && out_dtype != MX_F32) || mode < 0 ||
      mode > 3 || n < 0 || n % block_size) {
    return cudaErrorInvalidValue;
  }
  if (n == 0) return cudaSuccess;
  const ScaleArgs p{mode, rceil_t127, rceil_t126, rceil_c};
  cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
  return dispatch(in_dtype, elem, [&](auto codes) -> cudaError_t {
    constexpr int IN = decltype(codes)::first, EL = decltype(codes)::second;
    auto launch = [&](auto out_code) -> cudaError_t {
      constexpr int OUT = decltype(out_code)::value;
      if (block_size == 32 && aligned(x, 16) && aligned(y, 16)) {
        constexpr int V = 4;
        constexpr int VEC = 16 / static_cast<int>(sizeof(Raw<IN>));
        const int64_t nvec = n / VEC;
        const int64_t want = (nvec + kThreads * V - 1) / (kThreads * V);
        if (want > INT_MAX) return cudaErrorInvalidValue;
        qdq_dim0_kernel<IN, OUT, EL, V><<<static_cast<unsigned>(want), kThreads, 0, st>>>(
            static_cast<const uint4*>(x), static_cast<uint32_t*>(y), nvec, p);
        return launch_status();
      }
      const int64_t nblk = n / block_size;
      const unsigned grid = grid_for<qdq_dim0_generic_kernel<IN, OUT, EL>>((nblk + kThreads - 1) / kThreads);
      qdq_dim0_generic_kernel<IN, OUT, EL><<<grid, kThreads, 0, st>>>(static_cast<const Raw<IN>*>(x), y, nblk,
                                                                      block_size, p);
      return launch_status();
    };
    return out_dtype == MX_BF16 ? launch(std::integral_constant<int, MX_BF16>{})
                                : launch(std::integral_constant<int, MX_F32>{});
  });
}

namespace {

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

// swiglu_bwd_qdq_kernel on dh, g, u (B, R, C) (qdq_dim1_fast holds for each input and output).
template <int IN, int OUT, int EL>
cudaError_t launch_swiglu_bwd_qdq(const void* dh, const void* g, const void* u, void* dg0, void* dg1, void* du0,
                                  void* du1, int64_t B, int64_t R, int64_t C, const Groups& gr, const ScaleArgs& p,
                                  cudaStream_t st) {
  // lanes per column: fp32 as the SWIGLU variant (NR = 8 rows per thread), bf16 8 (NR = 4; at 4 its
  // three inputs' vectors and dg, du spill ~120 bytes at 128 registers); bf16 at three CTAs per SM
  // (the kernel's bounds: 80 registers, 24 bytes spilled), faster than two (92 registers)
  constexpr int RL = IN == MX_BF16 ? 8 : 4;
  const DimUnits<IN, RL> d(B, R, C, gr);
  if (d.ctas > INT_MAX) return cudaErrorInvalidValue;
  swiglu_bwd_qdq_kernel<IN, OUT, EL, RL><<<static_cast<unsigned>(d.ctas), kThreads, 0, st>>>(
      static_cast<const uint4*>(dh), static_cast<const uint4*>(g), static_cast<const uint4*>(u),
      static_cast<uint32_t*>(dg0), static_cast<uint32_t*>(dg1), static_cast<uint32_t*>(du0), static_cast<uint32_t*>(du1),
      R, d.ncvt, d.nbm, d.ncc, d.units, gr, p);
  return launch_status();
}

template <int IN, int OUT, int EL>
cudaError_t launch_qdq_dim1_generic(const void* x, void* y, int64_t B, int64_t R, int64_t C, int bs, const Groups& g,
                                    const ScaleArgs& p, cudaStream_t st) {
  const int64_t nblk = g.offs != nullptr ? (R + (bs - 1) * static_cast<int64_t>(g.E) + bs - 1) / bs
                                         : B * ((R + bs - 1) / bs);
  const unsigned grid = grid_for<qdq_dim1_generic_kernel<IN, OUT, EL>>((nblk * C + kThreads - 1) / kThreads);
  qdq_dim1_generic_kernel<IN, OUT, EL><<<grid, kThreads, 0, st>>>(static_cast<const Raw<IN>*>(x), y, nblk, R, C, bs,
                                                                  g, p);
  return launch_status();
}

// f(Pair<in, elem>{}, integral_constant<out>{}) with compile-time codes.
template <typename F>
cudaError_t dispatch_out(int in_dtype, int elem, int out_dtype, F&& f) {
  return dispatch(in_dtype, elem, [&](auto codes) -> cudaError_t {
    return out_dtype == MX_BF16 ? f(codes, std::integral_constant<int, MX_BF16>{})
                                : f(codes, std::integral_constant<int, MX_F32>{});
  });
}

}  // namespace

cudaError_t mx_qdq_dim1(const void* x, int in_dtype, void* y, int out_dtype, int64_t batch, int64_t rows,
                        int64_t cols, int block_size, int mode, int elem, uint32_t rceil_t127, uint32_t rceil_t126,
                        float rceil_c, const int32_t* offs, int64_t num_groups, intptr_t stream) {
  if (!valid_common(in_dtype, block_size, elem) || (out_dtype != MX_BF16 && out_dtype != MX_F32) || mode < 0 ||
      mode > 3 || batch < 0 || rows < 0 || cols < 0 ||
      (offs != nullptr && (batch != 1 || num_groups < 1 || num_groups > INT_MAX))) {
    return cudaErrorInvalidValue;
  }
  if (batch == 0 || rows == 0 || cols == 0) return cudaSuccess;
  const ScaleArgs p{mode, rceil_t127, rceil_t126, rceil_c};
  cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
  const Groups g{offs, offs != nullptr ? static_cast<int>(num_groups) : 0};
  return dispatch_out(in_dtype, elem, out_dtype, [&](auto codes, auto out_code) -> cudaError_t {
    constexpr int IN = decltype(codes)::first, EL = decltype(codes)::second, OUT = decltype(out_code)::value;
    if (qdq_dim1_fast(in_dtype, x, nullptr, y, cols, block_size)) {
      return launch_qdq_dim1<IN, OUT, EL, false>(x, nullptr, y, batch, rows, cols, g, p, st);
    }
    return launch_qdq_dim1_generic<IN, OUT, EL>(x, y, batch, rows, cols, block_size, g, p, st);
  });
}

cudaError_t mx_qdq_dim0_dim1(const void* x, int in_dtype, void* y0, void* y1, int out_dtype, int64_t batch,
                             int64_t rows, int64_t cols, int block_size, int mode, int elem, uint32_t rceil_t127,
                             uint32_t rceil_t126, float rceil_c, const int32_t* offs, int64_t num_groups,
                             intptr_t stream) {
  if (!valid_common(in_dtype, block_size, elem) || (out_dtype != MX_BF16 && out_dtype != MX_F32) || mode < 0 ||
      mode > 3 || batch < 0 || rows < 0 || cols < 0 || cols % block_size ||
      (offs != nullptr && (batch != 1 || num_groups < 1 || num_groups > INT_MAX))) {
    return cudaErrorInvalidValue;
  }
  if (batch == 0 || rows == 0 || cols == 0) return cudaSuccess;
  const ScaleArgs p{mode, rceil_t127, rceil_t126, rceil_c};
  cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
  if (qdq_dim1_fast(in_dtype, x, y0, y1, cols, block_size)) {
    const Groups g{offs, offs != nullptr ? static_cast<int>(num_groups) : 0};
    return dispatch_out(in_dtype, elem, out_dtype, [&](auto codes, auto out_code) -> cudaError_t {
      constexpr int IN = decltype(codes)::first, EL = decltype(codes)::second, OUT = decltype(out_code)::value;
      return launch_qdq_dim1<IN, OUT, EL, true>(x, y0, y1, batch, rows, cols, g, p, st);
    });
  }
  // Other block sizes or alignments: two passes over x (the dim0 qdq, its rows after the groups
  // zeroed, and the dim1 qdq).
  const cudaError_t e0 = mx_qdq_dim0(x, in_dtype, y0, out_dtype, batch * rows * cols, block_size, mode, elem,
                                     rceil_t127, rceil_t126, rceil_c, stream);
  if (e0 != cudaSuccess) return e0;
  if (offs != nullptr) {
    const cudaError_t ez = mx_zero_rows_after(y0, out_dtype, rows, cols, cols, offs + num_groups - 1, stream);
    if (ez != cudaSuccess) return ez;
  }
  return mx_qdq_dim1(x, in_dtype, y1, out_dtype, batch, rows, cols, block_size, mode, elem, rceil_t127, rceil_t126,
                     rceil_c, offs, num_groups, stream);
}

bool mx_swiglu_qdq_one_pass(int in_dtype, const void* g, const void* u, const void* y0, const void* y1, int64_t cols,
                            int block_size) {
  return qdq_dim1_fast(in_dtype, g, y0, y1, cols, block_size) && aligned(u, 16);
}

cudaError_t mx_swiglu_qdq_dim0_dim1(const void* g, const void* u, int in_dtype, void* y0, void* y1, int out_dtype,
                                    int64_t batch, int64_t rows, int64_t cols, int block_size, int mode, int elem,
                                    uint32_t rceil_t127, uint32_t rceil_t126, float rceil_c, const int32_t* offs,
                                    int64_t num_groups, intptr_t stream) {
  if (!valid_common(in_dtype, block_size, elem) || (out_dtype != MX_BF16 && out_dtype != MX_F32) || mode < 0 ||
      mode > 3 || batch < 0 || rows < 0 || cols < 0 || cols % block_size ||
      (offs != nullptr && (batch != 1 || num_groups < 1 || num_groups > INT_MAX))) {
    return cudaErrorInvalidValue;
  }
  if (batch == 0 || rows == 0 || cols == 0) return cudaSuccess;
  if (!mx_swiglu_qdq_one_pass(in_dtype, g, u, y0, y1, cols, block_size)) return cudaErrorInvalidValue;
  const ScaleArgs p{mode, rceil_t127, rceil_t126, rceil_c};
  cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
  const Groups gr{offs, offs != nullptr ? static_cast<int>(num_groups) : 0};
  return dispatch_out(in_dtype, elem, out_dtype, [&](auto codes, auto out_code) -> cudaError_t {
    constexpr int IN = decltype(codes)::first, EL = decltype(codes)::second, OUT = decltype(out_code)::value;
    return launch_qdq_dim1<IN, OUT, EL, true, true>(g, y0, y1, batch, rows, cols, gr, p, st, u);
  });
}

bool mx_swiglu_bwd_qdq_one_pass(int in_dtype, const void* dh, const void* g, const void* u, const void* dg0,
                                const void* dg1, const void* du0, const void* du1, int64_t cols, int block_size) {
  return qdq_dim1_fast(in_dtype, dh, dg0, dg1, cols, block_size) && aligned(g, 16) && aligned(u, 16) &&
         aligned(du0, 16) && aligned(du1, 16);
}

cudaError_t mx_swiglu_bwd_qdq_dim0_dim1(const void* dh, const void* g, const void* u, int in_dtype, void* dg0,
                                        void* dg1, void* du0, void* du1, int out_dtype, int64_t batch, int64_t rows,
                                        int64_t cols, int block_size, int mode, int elem, uint32_t rceil_t127,
                                        uint32_t rceil_t126, float rceil_c, const int32_t* offs, int64_t num_groups,
                                        intptr_t stream) {
  if (!valid_common(in_dtype, block_size, elem) || (out_dtype != MX_BF16 && out_dtype != MX_F32) || mode < 0 ||
      mode > 3 || batch < 0 || rows < 0 || cols < 0 || cols % block_size ||
      (offs != nullptr && (batch != 1 || num_groups < 1 || num_groups > INT_MAX))) {
    return cudaErrorInvalidValue;
  }
  if (batch == 0 || rows == 0 || cols == 0) return cudaSuccess;
  if (!mx_swiglu_bwd_qdq_one_pass(in_dtype, dh, g, u, dg0, dg1, du0, du1, cols, block_size)) {
    return cudaErrorInvalidValue;
  }
  const ScaleArgs p{mode, rceil_t127, rceil_t126, rceil_c};
  cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
  const Groups gr{offs, offs != nullptr ? static_cast<int>(num_groups) : 0};
  return dispatch_out(in_dtype, elem, out_dtype, [&](auto codes, auto out_code) -> cudaError_t {
    constexpr int IN = decltype(codes)::first, EL = decltype(codes)::second, OUT = decltype(out_code)::value;
    return launch_swiglu_bwd_qdq<IN, OUT, EL>(dh, g, u, dg0, dg1, du0, du1, batch, rows, cols, gr, p, st);
  });
}

cudaError_t mx_zero_rows_after(void* y, int dtype, int64_t rows, int64_t cols, int64_t row_stride, const int32_t* end,
                               intptr_t stream) {
  if ((dtype != MX_BF16 && dtype != MX_F32) || rows < 0 || cols < 0 || row_stride < 0 || end == nullptr) {
    return cudaErrorInvalidValue;
  }
  if (rows == 0 || cols == 0) return cudaSuccess;
  cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
  const int64_t eb = dtype == MX_BF16 ? 2 : 4;
  // 16-byte stores where every row starts and ends on a 16-byte boundary (torch._grouped_mm's
  // outputs: their row stride is padded to 16 bytes); else element stores.
  if (aligned(y, 16) && (cols * eb) % 16 == 0 && (rows == 1 || (row_stride * eb) % 16 == 0)) {
    return launch_zero_rows_after<uint4>(y, end, rows, cols * eb / 16, row_stride * eb / 16, st);
  }
  if (eb == 2) return launch_zero_rows_after<uint16_t>(y, end, rows, cols, row_stride, st);
  return launch_zero_rows_after<uint32_t>(y, end, rows, cols, row_stride, st);
}
