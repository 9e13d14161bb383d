// MX cast kernels (quantize along dim0, dim1, both at once): the warp-level quantizers the qdq
// kernels reuse (quantize_vec32, quantize_col, quantize_block_generic), the fast kernels
// (dim0_grp_kernel, dim1_tile_kernel) and the generic ones (any block size, any alignment).
//
// Included by mx_cast.cu, the extension's one translation unit (every kernel compiled together);
// its definitions are in that unit's anonymous namespace.
#pragma once

#include "mx_numerics.cuh"

namespace {

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

}  // namespace
