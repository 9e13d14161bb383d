// MX numerics on CUDA: the bit-exact scalar building blocks of every kernel (docs/mx-format.md).
//
// Block scales come from integer fp32 bit patterns (amax = integer max of |bits|). The only float
// arithmetic is (a) the RCEIL descale amax * fp32(1/max), used only above the T126 threshold where it
// is a normal number, (b) the element product x * 2^-e and (c) the dequantize product q * 2^(s-127).
// All three are written as `mul.rn.f32` in inline PTX, which never flushes subnormals whatever -ftz /
// --use_fast_math says. fp32 -> fp8 uses the sm_89+ conversion `cvt.rn.satfinite.{e4m3,e5m2}x2.f32`
// (round to nearest even, fp8 subnormals, saturating), after an explicit clamp to +-max as the spec
// says. Here: the scale rule (block_exponent, scale_byte), the conversions both ways (quant2 / quant4,
// fp8x2_to_f32, dequant_bits) and the SwiGLU forward and backward math of the fused qdq kernels.
//
// Included by mx_cast.cu, the extension's one translation unit (every kernel compiled together);
// its definitions are in that unit's anonymous namespace.
#pragma once

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


// ---------------------------------------------------------------------------------------------
// Dequantize: fp8 and E8M0 bytes to exact fp32, one rounding to the output dtype.
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

// ---------------------------------------------------------------------------------------------
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

}  // namespace
