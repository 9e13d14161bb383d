// The SwiGLU's forward and backward fused with their qdq casts (mx_cast.h:
// mx_swiglu_qdq_dim0_dim1, mx_swiglu_bwd_qdq_dim0_dim1); kernels in mx_qdq_kernels.cuh.
#include "mx_launch.cuh"

namespace {

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

}  // namespace

bool mx_swiglu_qdq_one_pass(int in_dtype, const void* g, const void* u, const void* y0, const void* y1, int64_t cols,
                            int block_size) {
  return qdq_dim1_fast(in_dtype, g, y0, y1, cols, block_size) && aligned(u, 16);
}

cudaError_t mx_swiglu_qdq_dim0_dim1(const void* g, const void* u, int in_dtype, void* y0, void* y1, int out_dtype,
                                    int64_t batch, int64_t rows, int64_t cols, int block_size, int mode, int elem,
                                    uint32_t rceil_t127, uint32_t rceil_t126, float rceil_c, const int32_t* offs,
                                    int64_t num_groups, intptr_t stream) {
  if (!valid_qdq(in_dtype, out_dtype, block_size, mode, elem, batch, rows, cols, offs, num_groups, true)) {
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
  if (!valid_qdq(in_dtype, out_dtype, block_size, mode, elem, batch, rows, cols, offs, num_groups, true)) {
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
