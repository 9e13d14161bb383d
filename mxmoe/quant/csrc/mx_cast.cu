// MX cast kernels for Hopper (sm_90), bit-identical to mxmoe/quant/torch_cast.py (docs/mx-format.md):
// the host launchers of mx_cast.h, in one translation unit with the kernels of its parts:
//   mx_numerics.cuh          the bit-exact scalar numerics (scale rule, conversions, SwiGLU math);
//   mx_cast_kernels.cuh      quantize along dim0, dim1, both;
//   mx_dequant_kernels.cuh   dequantize;
//   mx_qdq_kernels.cuh       quantize-dequantize (qdq), its SwiGLU variants, zero_rows_after.
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

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <type_traits>

#include "mx_cast_kernels.cuh"
#include "mx_dequant_kernels.cuh"
#include "mx_numerics.cuh"
#include "mx_qdq_kernels.cuh"

namespace {

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