// MX quantize-dequantize launchers (mx_cast.h: mx_qdq_dim0, mx_qdq_dim1, mx_qdq_dim0_dim1) and
// mx_zero_rows_after; the kernels are mx_qdq_kernels.cuh's (see mx_cast.cu's list).
#include "mx_launch.cuh"

namespace {

// zero_rows_after_kernel<U> with a grid that fills the device (at most one warp per row).
template <typename U>
cudaError_t launch_zero_rows_after(void* y, const int32_t* end, int64_t rows, int64_t row_units, int64_t row_stride,
                                   cudaStream_t st) {
  const unsigned grid = grid_for<zero_rows_after_kernel<U>>((rows + kZeroRows - 1) / kZeroRows);
  zero_rows_after_kernel<U><<<grid, dim3(32, kZeroRows), 0, st>>>(static_cast<U*>(y), end, rows, row_units, row_stride);
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

}  // namespace

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

cudaError_t mx_qdq_dim1(const void* x, int in_dtype, void* y, int out_dtype, int64_t batch, int64_t rows,
                        int64_t cols, int block_size, int mode, int elem, uint32_t rceil_t127, uint32_t rceil_t126,
                        float rceil_c, const int32_t* offs, int64_t num_groups, intptr_t stream) {
  if (!valid_qdq(in_dtype, out_dtype, block_size, mode, elem, batch, rows, cols, offs, num_groups, false)) {
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
  if (!valid_qdq(in_dtype, out_dtype, block_size, mode, elem, batch, rows, cols, offs, num_groups, true)) {
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