// MX casts on CUDA (docs/mx-format.md): host launchers with a plain C-like interface.
//
// No torch headers here or in mx_cast.cu: scripts/check_cuda_build.sh compiles mx_cast.cu alone.
// All tensors are raw device pointers to contiguous row-major data; every launcher enqueues on the
// stream given as an integer handle (torch.cuda.current_stream().cuda_stream) and returns the
// error of its launch(es) (cudaSuccess, or cudaErrorInvalidValue for bad arguments).
//
// Codes (they equal mxmoe.formats.MODE_IDS and the order of mxmoe.formats.ELEM_FORMATS):
//   in_dtype / out_dtype: 0 = bfloat16, 1 = float32
//   elem:                 0 = float8_e4m3fn, 1 = float8_e5m2
//   mode:                 0 = FLOOR, 1 = RCEIL, 2 = CEIL, 3 = EVEN
// RCEIL needs the fp32 constant c = fp32(1/max) and the amax thresholds T127 <= T126 (fp32 bit
// patterns) from mxmoe.formats.CastSpec.{rceil_c, rceil_t127, rceil_t126}.
// Scales are E8M0 bytes; elements are fp8 bytes.
//
// `variant` picks a kernel implementation (all bit-identical; mxmoe/quant/cuda_cast.py chooses the
// default per cast). Where a variant's preconditions do not hold (block size, alignment) the
// launcher falls back to variant 0, which itself falls back to the generic kernels.
//   dim0     0: 4 x 16-byte loads / thread, 8-byte (bf16) fp8 stores, 1-byte scale stores, persistent
//            1: grouped (16-byte fp8 stores via lane shuffles, 4-byte scale stores), 2 groups in
//               flight per warp, ld/st .cs, persistent grid        (needs s 4-byte aligned)
//            2: as 1 with 4 groups in flight
//            3: as 1 with ld.global.nc.L1::no_allocate loads and plain stores
//            4: as 1 with a one-shot grid (one CTA per 16 groups)
//            5: as 2 with .nc.L1::no_allocate loads, plain stores and a one-shot grid
//   dim1 and dim0_dim1
//            0: one CTA per 128-row x 64-col tile (load, sync, quantize, sync, store)
//            1: persistent CTAs, cp.async double-buffered 128 x 64 tiles (needs x 16-byte aligned,
//               cols % (16 / sizeof(in)) == 0)
//            2: as 1 with 128 x 128 tiles
//            3: "tiled" (one CTA per tile, as 0): bf16 threads quantize column pairs (32-bit shared
//               reads, packed 16x2 amax), fused dim0 part with 16-byte fp8 stores (lane shuffles)
//               and one 2-byte scale store per tile row, ld.global.nc.L1::no_allocate loads, plain
//               stores; 128 x 64 tiles (needs x 16-byte aligned, cols % (16 / sizeof(in)) == 0)
//            4: as 3 with 256 x 64 tiles (256 contiguous fp8 bytes per output column, 8-byte scale
//               stores)
//            5: as 3 with 128 x 128 tiles (256 contiguous input bytes per bf16 tile row, 4-byte
//               dim0 scale stores)
//            6: as 3 with 256 x 128 tiles, loads by cp.async.cg
//            7: as 6 with a shuffle-free fused dim0 part: input tile row pitch padded by 16 bytes
//               (conflict-free 16-byte column reads), each thread quantizes whole 32-element blocks
//               of one tile row (packed integer amax), two 16-byte fp8 stores per block, one
//               4-byte scale store per tile row
//            8: as 7 with 128 x 128 tiles (each thread half a tile row: 2-byte scale stores)
//   dequant  0: 8 (bf16 out) / 4 (fp32 out) fp8 bytes per thread-vector, 4 in flight
//            1: 16 fp8 bytes per thread-vector (one 16-byte load, 2 / 4 16-byte stores), 2 in flight,
//               .cs hints (needs block_size >= 16, q 16-byte aligned)
//            2: as 1 with 4 in flight, .nc.L1::no_allocate loads, plain stores
//            3: as 0 with 8 in flight
//            4: one-shot grid (one CTA of 256 threads per 1024 elements, no grid-stride loop), each
//               thread one 4-byte fp8 load -> one 8-byte (bf16) / 16-byte (fp32) store, one scale
//               byte load per thread, plain loads and stores (needs block_size >= 4, q 4-byte and
//               out 8- (bf16) / 16-byte (fp32) aligned)
//            5: as 4 with one 8-byte fp8 load -> one 16-byte (bf16) / two 16-byte (fp32) stores per
//               thread, 128 threads per CTA (1024 elements, the launch shape of inductor's Triton
//               kernel) (needs block_size >= 8, q 8-byte and out 16-byte aligned)
//            6: as 5 with 2 vectors per thread, 256 threads per CTA (4096 elements)
enum MxVariants : int { MX_DIM0_VARIANTS = 6, MX_DIM1_VARIANTS = 9, MX_DEQUANT_VARIANTS = 7 };
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
                             uint32_t rceil_t126, float rceil_c, intptr_t stream, int variant);

// x: (batch, rows, cols), blocks along rows (rows % block_size == 0); q: (batch, cols, rows);
// s: (batch, cols, rows / block_size).
cudaError_t mx_quantize_dim1(const void* x, int in_dtype, uint8_t* q, uint8_t* s, int64_t batch,
                             int64_t rows, int64_t cols, int block_size, int mode, int elem,
                             uint32_t rceil_t127, uint32_t rceil_t126, float rceil_c, intptr_t stream,
                             int variant);

// x: (rows, cols), both divisible by block_size, read once:
// q0 (rows, cols), s0 (rows, cols / bs) along cols; q1 (cols, rows), s1 (cols, rows / bs) along rows.
cudaError_t mx_quantize_dim0_dim1(const void* x, int in_dtype, uint8_t* q0, uint8_t* s0, uint8_t* q1,
                                  uint8_t* s1, int64_t rows, int64_t cols, int block_size, int mode,
                                  int elem, uint32_t rceil_t127, uint32_t rceil_t126, float rceil_c,
                                  intptr_t stream, int variant);

// q: (n,) fp8 bytes, s: (n / block_size,) E8M0 bytes -> out: (n,) of out_dtype,
// value = q * 2^(s - 127) exact in fp32, then one round-to-nearest-even to out_dtype.
cudaError_t mx_dequantize(const uint8_t* q, const uint8_t* s, void* out, int out_dtype, int64_t n,
                          int block_size, int elem, intptr_t stream, int variant);
