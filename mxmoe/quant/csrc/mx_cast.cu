// MX cast kernels for Hopper (sm_90), bit-identical to mxmoe/quant/torch_cast.py (docs/mx-format.md):
// the host launchers of mx_cast.h in three translation units, compiled at once by the extension's
// build: this one (quantize, dequantize), mx_qdq.cu (quantize-dequantize, zero_rows_after) and
// mx_swiglu_qdq.cu (the SwiGLU's qdq casts), on the host helpers of mx_launch.cuh and the kernels of:
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
#include "mx_launch.cuh"

namespace {

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
