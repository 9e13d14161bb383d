// MX casts on CUDA (docs/mx-format.md): host launchers with a plain C-like interface.
//
// No torch headers here or in mx_cast.cu: the CPU suite (and scripts/check_cuda_build.sh) compiles
// mx_cast.cu alone.
// All tensors are raw device pointers to contiguous row-major data (mx_zero_rows_after: any row
// stride); every launcher enqueues on the stream given as an integer handle
// (torch.cuda.current_stream().cuda_stream) and returns the error of its launch(es) (cudaSuccess,
// or cudaErrorInvalidValue for bad arguments).
//
// Codes (they equal mxmoe.formats.MODE_IDS and the order of mxmoe.formats.ELEM_FORMATS):
//   in_dtype / out_dtype: 0 = bfloat16, 1 = float32
//   elem:                 0 = float8_e4m3fn, 1 = float8_e5m2
//   mode:                 0 = FLOOR, 1 = RCEIL, 2 = CEIL, 3 = EVEN
// RCEIL needs the fp32 constant c = fp32(1/max) and the amax thresholds T127 <= T126 (fp32 bit
// patterns) from mxmoe.formats.CastSpec.{rceil_c, rceil_t127, rceil_t126}.
// Scales are E8M0 bytes; elements are fp8 bytes.
//
// Each cast runs the kernel the H200 sweep picked where its preconditions hold (block size 32,
// aligned pointers; see mx_cast.cu), else a generic kernel that covers every shape.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

enum MxDtype : int { MX_BF16 = 0, MX_F32 = 1 };
enum MxElem : int { MX_E4M3 = 0, MX_E5M2 = 1 };
enum MxMode : int { MX_FLOOR = 0, MX_RCEIL = 1, MX_CEIL = 2, MX_EVEN = 3 };

// x: (n,) elements in blocks of block_size along the flat index (a contiguous (R, C) tensor with
// C % block_size == 0); q: (n,) bytes; s: (n / block_size,) bytes.
cudaError_t mx_quantize_dim0(const void* x, int in_dtype, uint8_t* q, uint8_t* s, int64_t n,
                             int block_size, int mode, int elem, uint32_t rceil_t127,
                             uint32_t rceil_t126, float rceil_c, intptr_t stream);

// x: (batch, rows, cols), blocks along rows (rows % block_size == 0); q: (batch, cols, rows);
// s: (batch, cols, rows / block_size).
cudaError_t mx_quantize_dim1(const void* x, int in_dtype, uint8_t* q, uint8_t* s, int64_t batch,
                             int64_t rows, int64_t cols, int block_size, int mode, int elem,
                             uint32_t rceil_t127, uint32_t rceil_t126, float rceil_c, intptr_t stream);

// x: (rows, cols), both divisible by block_size, read once:
// q0 (rows, cols), s0 (rows, cols / bs) along cols; q1 (cols, rows), s1 (cols, rows / bs) along rows.
cudaError_t mx_quantize_dim0_dim1(const void* x, int in_dtype, uint8_t* q0, uint8_t* s0, uint8_t* q1,
                                  uint8_t* s1, int64_t rows, int64_t cols, int block_size, int mode,
                                  int elem, uint32_t rceil_t127, uint32_t rceil_t126, float rceil_c,
                                  intptr_t stream);

// q: (n,) fp8 bytes, s: (n / block_size,) E8M0 bytes -> out: (n,) of out_dtype,
// value = q * 2^(s - 127) exact in fp32, then one round-to-nearest-even to out_dtype.
cudaError_t mx_dequantize(const uint8_t* q, const uint8_t* s, void* out, int out_dtype, int64_t n,
                          int block_size, int elem, intptr_t stream);

// Quantize-dequantize along dim0: x (n,) in blocks of block_size along the flat index (as
// mx_quantize_dim0) -> y (n,) of out_dtype = mx_dequantize(mx_quantize_dim0(x)) bit for bit, without
// writing the fp8 elements and scales.
cudaError_t mx_qdq_dim0(const void* x, int in_dtype, void* y, int out_dtype, int64_t n, int block_size,
                        int mode, int elem, uint32_t rceil_t127, uint32_t rceil_t126, float rceil_c,
                        intptr_t stream);

// Quantize-dequantize along dim1: x (batch, rows, cols), blocks of block_size rows from each
// matrix's first row, the last one short (rows need not be a multiple of block_size) -> y of x's
// shape and layout, out_dtype: the values of casting the matrices zero-padded to whole blocks
// along rows (mx_quantize_dim1) and dequantizing (mx_dequantize), at x's positions, bit for bit.
// Groups (batch == 1; offs == nullptr: none): offs (num_groups,) int32 cumulative group ends on the
// device; the blocks start at each group's first row instead (group e = rows offs[e-1]:offs[e]), and
// the rows at or after offs[num_groups - 1] are zero.
cudaError_t mx_qdq_dim1(const void* x, int in_dtype, void* y, int out_dtype, int64_t batch, int64_t rows,
                        int64_t cols, int block_size, int mode, int elem, uint32_t rceil_t127,
                        uint32_t rceil_t126, float rceil_c, const int32_t* offs, int64_t num_groups,
                        intptr_t stream);

// Both: y0 = mx_qdq_dim0 and y1 = mx_qdq_dim1 of x (batch, rows, cols), cols % block_size == 0,
// from one read of x (block 32, 16-byte aligned pointers; else the two launchers in turn); with
// groups the rows after the last group are zero in y0 too.
cudaError_t mx_qdq_dim0_dim1(const void* x, int in_dtype, void* y0, void* y1, int out_dtype, int64_t batch,
                             int64_t rows, int64_t cols, int block_size, int mode, int elem,
                             uint32_t rceil_t127, uint32_t rceil_t126, float rceil_c, const int32_t* offs,
                             int64_t num_groups, intptr_t stream);

// SwiGLU then both qdq's: y0, y1 = mx_qdq_dim0_dim1(h) with h = silu(g) * u formed in registers as
// eager PyTorch's `F.silu(g) * u` (silu in fp32 as ATen's silu_kernel, x / (1 + expf(-x)), rounded to
// in_dtype; the product in fp32, rounded to in_dtype); h is never written. g, u: (batch, rows, cols)
// of in_dtype, the same layout. One pass only: needs mx_swiglu_qdq_one_pass (block 32, 16-byte
// aligned pointers), else cudaErrorInvalidValue (the caller forms h and calls mx_qdq_dim0_dim1).
bool mx_swiglu_qdq_one_pass(int in_dtype, const void* g, const void* u, const void* y0, const void* y1, int64_t cols,
                            int block_size);
cudaError_t mx_swiglu_qdq_dim0_dim1(const void* g, const void* u, int in_dtype, void* y0, void* y1, int out_dtype,
                                    int64_t batch, int64_t rows, int64_t cols, int block_size, int mode, int elem,
                                    uint32_t rceil_t127, uint32_t rceil_t126, float rceil_c, const int32_t* offs,
                                    int64_t num_groups, intptr_t stream);

// SwiGLU backward then both qdq's of its outputs: given dh, the gradient of h = silu(g) * u,
// dg0, dg1 = mx_qdq_dim0_dim1(dg) and du0, du1 = mx_qdq_dim0_dim1(du) with dg and du formed in
// registers as eager PyTorch's `silu_backward(dh * u, g)` and `dh * F.silu(g)` on CUDA (every
// intermediate op's result rounded to in_dtype as there; ATen's silu_backward_kernel in fp32 with
// 1 + x * (1 - s) one fma, as nvcc contracts it); dg and du are never written. dh, g, u: (batch,
// rows, cols) of in_dtype, one layout; groups as mx_qdq_dim1. One pass only: needs
// mx_swiglu_bwd_qdq_one_pass (block 32, 16-byte aligned pointers), else cudaErrorInvalidValue (the
// caller forms dg and du and calls mx_qdq_dim0_dim1 on each).
bool mx_swiglu_bwd_qdq_one_pass(int in_dtype, const void* dh, const void* g, const void* u, const void* dg0,
                                const void* dg1, const void* du0, const void* du1, int64_t cols, int block_size);
cudaError_t mx_swiglu_bwd_qdq_dim0_dim1(const void* dh, const void* g, const void* u, int in_dtype, void* dg0,
                                        void* dg1, void* du0, void* du1, int out_dtype, int64_t batch, int64_t rows,
                                        int64_t cols, int block_size, int mode, int elem, uint32_t rceil_t127,
                                        uint32_t rceil_t126, float rceil_c, const int32_t* offs, int64_t num_groups,
                                        intptr_t stream);

// y (rows, cols) of dtype (bf16 / fp32), unit column stride, row_stride elements between rows:
// rows *end .. rows - 1 set to zero, the others untouched (the rows after the last expert group of
// a grouped GEMM's output). end: a device pointer to the last group end, offs[num_groups - 1]; it is
// read on the device (no host sync) and clamped to [0, rows].
cudaError_t mx_zero_rows_after(void* y, int dtype, int64_t rows, int64_t cols, int64_t row_stride, const int32_t* end,
                               intptr_t stream);
