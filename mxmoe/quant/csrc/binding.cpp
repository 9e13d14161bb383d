// The MX cast launchers of mx_cast.cu as torch operators (namespace mxmoe_cuda), so that a call from
// Python or from a compiled graph goes through the dispatcher straight to the kernel: the checks,
// the output allocation, the device guard and the current stream are all here, in C++.
//
//   quantize_dim0(Tensor x, int block_size, int mode, ScalarType elem_dtype) -> (Tensor q, Tensor s)
//       x (..., C) bf16/fp32, ndim >= 1 -> q x's shape elem_dtype, s (..., C / bs) float8_e8m0fnu;
//       blocks along C (any leading dims, so that callers need no reshape)
//   quantize_dim0_out(Tensor x, int block_size, int mode, Tensor(a!) q, Tensor(b!) s) -> ()
//       the same into q (R, C) and s (R, C / bs) (fp8 / e8m0 or their uint8 views; e.g. a peer's
//       buffer); the element format is q's dtype (uint8: e4m3)
//   quantize_dim1(Tensor x, int block_size, int mode, ScalarType elem_dtype) -> (Tensor q, Tensor s)
//       x (..., R, C), ndim >= 2 -> q (..., C, R), s (..., C, R / bs); blocks along R, stored
//       transposed, every matrix x[..., :, :] on its own (2D x: q (C, R), s (C, R / bs))
//   quantize_dim0_dim1(Tensor x, int block_size, int mode, ScalarType elem_dtype)
//       -> (Tensor q0, Tensor s0, Tensor q1, Tensor s1): x (R, C) read once, both of the above
//   dequantize(Tensor q, Tensor s, int block_size, ScalarType out_dtype) -> Tensor
//       q (R, C) fp8, s (R, C / bs) e8m0 (or uint8) -> (R, C) bf16 / fp32
//   dequantize_out(Tensor q, Tensor s, int block_size, Tensor(a!) out) -> ()
//   qdq_dim0(Tensor x, int block_size, int mode, ScalarType elem_dtype, ScalarType out_dtype) -> Tensor
//       x (..., C) bf16/fp32 contiguous -> x's shape, out_dtype (bf16/fp32): the values of
//       dequantize(quantize_dim0(x)) bit for bit, blocks along C, without writing q and s
//   qdq_dim0_out(Tensor x, int block_size, int mode, ScalarType elem_dtype, Tensor(a!) out) -> ()
//       the same into out (x's shape, bf16/fp32, contiguous)
//   qdq_dim1(Tensor x, int block_size, int mode, ScalarType elem_dtype, ScalarType out_dtype,
//            Tensor? offs=None) -> Tensor
//       x (..., R, C) bf16/fp32 contiguous, ndim >= 2 -> x's shape, out_dtype: blocks of block_size
//       rows from each matrix x[..., :, :]'s first row (the last one short), the values of
//       quantize_dim1 of the zero-padded matrices then dequantize, at x's positions, bit for bit;
//       offs (E,) int32 cumulative group ends on x's device (x 2D): the blocks start at each
//       group's first row, the rows at or after offs[-1] are zero (mxmoe.quant.qdq's groups)
//   qdq_dim0_dim1(Tensor x, int block_size, int mode, ScalarType elem_dtype, ScalarType out_dtype,
//                 Tensor? offs=None) -> (Tensor y0, Tensor y1): x as for qdq_dim1 with
//       C % block_size == 0, read once: y0 = qdq_dim0(x) (with offs its rows at or after offs[-1]
//       zero), y1 = qdq_dim1(x, offs)
//   swiglu_qdq_dim0_dim1(Tensor g, Tensor u, int block_size, int mode, ScalarType elem_dtype,
//                        ScalarType out_dtype, Tensor? offs=None) -> (Tensor y0, Tensor y1)
//       g, u of one shape (..., R, C) and dtype (bf16/fp32), contiguous, C % block_size == 0:
//       qdq_dim0_dim1(h, offs) of h = silu(g) * u formed as eager PyTorch forms `F.silu(g) * u`,
//       in one pass without writing h (block 32, 16-byte aligned; else h from at::silu and mul)
//   swiglu_bwd_qdq_dim0_dim1(Tensor dh, Tensor g, Tensor u, int block_size, int mode,
//                            ScalarType elem_dtype, ScalarType out_dtype, Tensor? offs=None)
//       -> (Tensor dg0, Tensor dg1, Tensor du0, Tensor du1)
//       dh, g, u of one shape (..., R, C) and dtype (bf16/fp32), contiguous, C % block_size == 0:
//       qdq_dim0_dim1(dg, offs) and qdq_dim0_dim1(du, offs) of the SwiGLU backward dg =
//       silu_backward(dh * u, g), du = dh * silu(g) formed as eager PyTorch forms them, in one pass
//       without writing dg and du (block 32, 16-byte aligned; else dg, du from ATen's ops)
//   zero_rows_after(Tensor(a!) out, Tensor offs) -> ()
//       out (T, N) bf16/fp32, unit column stride, any row stride (torch._grouped_mm's output, its
//       row stride padded); offs (E >= 1,) int32 cumulative group ends on out's device, any stride:
//       rows offs[E-1] .. T-1 of out set to zero in place, the others untouched; offs[E-1] is read
//       on the device (no host sync; below 0 counts as 0, above T as T)
//   format_constants(ScalarType elem_dtype) -> int[]
//       [emax, mbits, bits of max, bits of fp32(1/max), T127, T126]: what the kernels compile in,
//       compared with mxmoe.formats when the extension loads
// mode: mxmoe.formats.MODE_IDS (0 FLOOR, 1 RCEIL, 2 CEIL, 3 EVEN). Every allocated output is contiguous.
// Fake (meta) implementations for torch.compile are registered from Python (mxmoe/quant/cuda_cast.py).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/accumulate.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "mx_cast.h"

namespace {

using at::Tensor;

struct ElemConstants {
  int64_t emax, mbits, max_bits, rceil_c_bits, t127, t126;
};

// Check messages are built here into one std::string. c10::str of integer, shape or device
// arguments segfaulted inside this extension when a check failed (torch 2.11), while std::string
// messages were raised as clean Python errors.
void append(std::string& o, const char* v) { o += v; }
void append(std::string& o, const std::string& v) { o += v; }
void append(std::string& o, int64_t v) { o += std::to_string(v); }
void append(std::string& o, int v) { o += std::to_string(v); }
void append(std::string& o, at::ScalarType v) { o += c10::toString(v); }
void append(std::string& o, const c10::Device& v) { o += v.str(); }
void append(std::string& o, at::IntArrayRef v) {
  o += "(";
  for (size_t i = 0; i < v.size(); ++i) o += (i ? ", " : "") + std::to_string(v[i]);
  o += ")";
}
template <typename... Args>
std::string msg(const Args&... args) {
  std::string o;
  (append(o, args), ...);
  return o;
}

// mxmoe.formats: ELEM_FORMATS, rceil_constant, rceil_subnormal_thresholds (checked at load).
ElemConstants constants(int elem) {
  if (elem == MX_E4M3) return {8, 3, 0x43E00000, 0x3B124925, 0x4600001, 0x4E00000};
  return {15, 2, 0x47600000, 0x37924925, 0x7E00001, 0x8600000};
}

int elem_code(at::ScalarType t, const char* name) {
  if (t == at::kFloat8_e4m3fn) return MX_E4M3;
  if (t == at::kFloat8_e5m2) return MX_E5M2;
  TORCH_CHECK_TYPE(false, msg("mxmoe_cuda: ", name, " is ", t, "; expected Float8_e4m3fn or Float8_e5m2"));
  return -1;
}

int float_code(at::ScalarType t, const char* name) {
  if (t == at::kBFloat16) return MX_BF16;
  if (t == at::kFloat) return MX_F32;
  TORCH_CHECK_TYPE(false, msg("mxmoe_cuda: ", name, " is ", t, "; expected BFloat16 or Float"));
  return -1;
}

// ndim: the number of dims x must have; with at_least, the fewest it may have.
void check_args(const Tensor& x, int64_t ndim, int64_t block_size, int64_t mode, bool at_least = false) {
  TORCH_CHECK_WITH(Error, x.is_cuda(), msg("mxmoe_cuda: x must be a CUDA tensor, got device ", x.device()));
  TORCH_CHECK_WITH(Error, x.dim() == ndim || (at_least && x.dim() > ndim), msg("mxmoe_cuda: x must be ", ndim, "D", at_least ? " or more" : "", ", got shape ", x.sizes()));
  TORCH_CHECK_WITH(Error, block_size >= 2 && (block_size & (block_size - 1)) == 0, msg("mxmoe_cuda: block_size must be a power of two >= 2, got ", block_size));
  TORCH_CHECK_WITH(Error, mode >= 0 && mode <= 3, msg("mxmoe_cuda: mode must be 0..3 (FLOOR, RCEIL, CEIL, EVEN), got ", mode));
  float_code(x.scalar_type(), "x");
}

void check_out(const Tensor& t, const char* name, at::IntArrayRef shape, const Tensor& x) {
  TORCH_CHECK_WITH(Error, t.device() == x.device(), msg("mxmoe_cuda: ", name, " is on ", t.device(), ", x on ", x.device()));
  TORCH_CHECK_WITH(Error, t.sizes() == shape && t.is_contiguous(), msg("mxmoe_cuda: ", name, " must be contiguous of shape ", shape, ", got ", t.sizes()));
}

void check_launch(cudaError_t err, const char* what) {
  TORCH_CHECK_WITH(Error, err == cudaSuccess, msg("mxmoe_cuda: ", what, " failed: ", cudaGetErrorName(err), " (", cudaGetErrorString(err), ")"));
}

uint8_t* bytes(const Tensor& t) { return static_cast<uint8_t*>(t.data_ptr()); }

intptr_t stream_of(const Tensor& t) {
  return reinterpret_cast<intptr_t>(c10::cuda::getCurrentCUDAStream(t.device().index()).stream());
}

// Launch the dim0 cast of contiguous x (R, C) into q, s (checked).
void launch_dim0(const Tensor& x, const Tensor& q, const Tensor& s, int64_t block_size, int64_t mode, int elem) {
  const ElemConstants k = constants(elem);
  check_launch(mx_quantize_dim0(x.data_ptr(), float_code(x.scalar_type(), "x"), bytes(q), bytes(s), x.numel(),
                                static_cast<int>(block_size), static_cast<int>(mode), elem,
                                static_cast<uint32_t>(k.t127), static_cast<uint32_t>(k.t126),
                                c10::bit_cast<float>(static_cast<uint32_t>(k.rceil_c_bits)), stream_of(x)),
               "mx_quantize_dim0");
}

std::tuple<Tensor, Tensor> quantize_dim0(const Tensor& x_, int64_t block_size, int64_t mode, at::ScalarType elem) {
  check_args(x_, 1, block_size, mode, /*at_least=*/true);
  const int el = elem_code(elem, "elem_dtype");
  const Tensor x = x_.contiguous();
  const int64_t C = x.size(-1);
  TORCH_CHECK_WITH(Error, C % block_size == 0, msg("mxmoe_cuda: x.shape[-1]=", C, " is not divisible by block_size=", block_size));
  const c10::cuda::CUDAGuard guard(x.device());
  at::DimVector shape(x.sizes().begin(), x.sizes().end());
  Tensor q = at::empty(shape, x.options().dtype(elem));
  shape.back() = C / block_size;
  Tensor s = at::empty(shape, x.options().dtype(at::kFloat8_e8m0fnu));
  if (x.numel()) launch_dim0(x, q, s, block_size, mode, el);
  return {q, s};
}

void quantize_dim0_out(const Tensor& x_, int64_t block_size, int64_t mode, Tensor& q, Tensor& s) {
  check_args(x_, 2, block_size, mode);
  const int el = q.scalar_type() == at::kByte ? MX_E4M3 : elem_code(q.scalar_type(), "q");
  TORCH_CHECK_WITH(Error, s.scalar_type() == at::kFloat8_e8m0fnu || s.scalar_type() == at::kByte, msg("mxmoe_cuda: s must be Float8_e8m0fnu or uint8, got ", s.scalar_type()));
  const Tensor x = x_.contiguous();
  const int64_t R = x.size(0), C = x.size(1);
  TORCH_CHECK_WITH(Error, C % block_size == 0, msg("mxmoe_cuda: x.shape[-1]=", C, " is not divisible by block_size=", block_size));
  check_out(q, "q", {R, C}, x);
  check_out(s, "s", {R, C / block_size}, x);
  const c10::cuda::CUDAGuard guard(x.device());
  if (x.numel()) launch_dim0(x, q, s, block_size, mode, el);
}

std::tuple<Tensor, Tensor> quantize_dim1(const Tensor& x_, int64_t block_size, int64_t mode, at::ScalarType elem) {
  check_args(x_, 2, block_size, mode, /*at_least=*/true);
  const int el = elem_code(elem, "elem_dtype");
  const Tensor x = x_.contiguous();
  const int64_t n = x.dim(), R = x.size(-2), C = x.size(-1);
  TORCH_CHECK_WITH(Error, R % block_size == 0, msg("mxmoe_cuda: x.shape[-2]=", R, " is not divisible by block_size=", block_size));
  const int64_t B = c10::multiply_integers(x.sizes().begin(), x.sizes().end() - 2);  // the matrices
  const c10::cuda::CUDAGuard guard(x.device());
  at::DimVector shape(x.sizes().begin(), x.sizes().end());
  shape[n - 2] = C;
  shape[n - 1] = R;
  Tensor q = at::empty(shape, x.options().dtype(elem));
  shape[n - 1] = R / block_size;
  Tensor s = at::empty(shape, x.options().dtype(at::kFloat8_e8m0fnu));
  if (x.numel()) {
    const ElemConstants k = constants(el);
    check_launch(mx_quantize_dim1(x.data_ptr(), float_code(x.scalar_type(), "x"), bytes(q), bytes(s), B, R, C,
                                  static_cast<int>(block_size), static_cast<int>(mode), el,
                                  static_cast<uint32_t>(k.t127), static_cast<uint32_t>(k.t126),
                                  c10::bit_cast<float>(static_cast<uint32_t>(k.rceil_c_bits)), stream_of(x)),
                 "mx_quantize_dim1");
  }
  return {q, s};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> quantize_dim0_dim1(const Tensor& x_, int64_t block_size, int64_t mode,
                                                              at::ScalarType elem) {
  check_args(x_, 2, block_size, mode);
  const int el = elem_code(elem, "elem_dtype");
  const Tensor x = x_.contiguous();
  const int64_t R = x.size(0), C = x.size(1);
  TORCH_CHECK_WITH(Error, R % block_size == 0 && C % block_size == 0, msg("mxmoe_cuda: x of shape ", x.sizes(), " must have both dims divisible by block_size=", block_size));
  const c10::cuda::CUDAGuard guard(x.device());
  Tensor q0 = at::empty({R, C}, x.options().dtype(elem));
  Tensor s0 = at::empty({R, C / block_size}, x.options().dtype(at::kFloat8_e8m0fnu));
  Tensor q1 = at::empty({C, R}, x.options().dtype(elem));
  Tensor s1 = at::empty({C, R / block_size}, x.options().dtype(at::kFloat8_e8m0fnu));
  if (x.numel()) {
    const ElemConstants k = constants(el);
    check_launch(mx_quantize_dim0_dim1(x.data_ptr(), float_code(x.scalar_type(), "x"), bytes(q0), bytes(s0),
                                       bytes(q1), bytes(s1), R, C, static_cast<int>(block_size),
                                       static_cast<int>(mode), el, static_cast<uint32_t>(k.t127),
                                       static_cast<uint32_t>(k.t126),
                                       c10::bit_cast<float>(static_cast<uint32_t>(k.rceil_c_bits)), stream_of(x)),
                 "mx_quantize_dim0_dim1");
  }
  return {q0, s0, q1, s1};
}

void dequantize_out(const Tensor& q_, const Tensor& s_, int64_t block_size, Tensor& out) {
  TORCH_CHECK_WITH(Error, q_.is_cuda() && q_.dim() == 2, msg("mxmoe_cuda: q must be a 2D CUDA tensor, got ", q_.sizes(), " on ", q_.device()));
  TORCH_CHECK_WITH(Error, block_size >= 2 && (block_size & (block_size - 1)) == 0, msg("mxmoe_cuda: block_size must be a power of two >= 2, got ", block_size));
  const int el = elem_code(q_.scalar_type(), "q");
  TORCH_CHECK_WITH(Error, s_.scalar_type() == at::kFloat8_e8m0fnu || s_.scalar_type() == at::kByte, msg("mxmoe_cuda: s must be Float8_e8m0fnu or uint8, got ", s_.scalar_type()));
  const int64_t R = q_.size(0), C = q_.size(1);
  TORCH_CHECK_WITH(Error, C % block_size == 0, msg("mxmoe_cuda: q.shape[-1]=", C, " is not divisible by block_size=", block_size));
  TORCH_CHECK_WITH(Error, s_.sizes() == at::IntArrayRef({R, C / block_size}) && s_.device() == q_.device(), msg("mxmoe_cuda: s must be (", R, ", ", C / block_size, ") on ", q_.device(), ", got ", s_.sizes(), " on ", s_.device()));
  check_out(out, "out", {R, C}, q_);
  const int od = float_code(out.scalar_type(), "out");
  const Tensor q = q_.contiguous(), s = s_.contiguous();
  const c10::cuda::CUDAGuard guard(q.device());
  if (q.numel()) {
    check_launch(mx_dequantize(bytes(q), bytes(s), out.data_ptr(), od, q.numel(), static_cast<int>(block_size), el,
                               stream_of(q)),
                 "mx_dequantize");
  }
}

Tensor dequantize(const Tensor& q, const Tensor& s, int64_t block_size, at::ScalarType out_dtype) {
  float_code(out_dtype, "out_dtype");
  Tensor out = at::empty(q.sizes(), q.options().dtype(out_dtype));
  dequantize_out(q, s, block_size, out);
  return out;
}

// x (..., C) bf16/fp32 contiguous, C % block_size == 0, into out (x's shape, bf16/fp32, contiguous).
void qdq_dim0_out(const Tensor& x, int64_t block_size, int64_t mode, at::ScalarType elem, Tensor& out) {
  TORCH_CHECK_WITH(Error, x.is_cuda(), msg("mxmoe_cuda: x must be a CUDA tensor, got device ", x.device()));
  TORCH_CHECK_WITH(Error, x.dim() >= 1, msg("mxmoe_cuda: x must have at least 1 dim, got shape ", x.sizes()));
  TORCH_CHECK_WITH(Error, block_size >= 2 && (block_size & (block_size - 1)) == 0, msg("mxmoe_cuda: block_size must be a power of two >= 2, got ", block_size));
  TORCH_CHECK_WITH(Error, mode >= 0 && mode <= 3, msg("mxmoe_cuda: mode must be 0..3 (FLOOR, RCEIL, CEIL, EVEN), got ", mode));
  const int in = float_code(x.scalar_type(), "x");
  const int el = elem_code(elem, "elem_dtype");
  const int od = float_code(out.scalar_type(), "out");
  TORCH_CHECK_WITH(Error, x.is_contiguous(), msg("mxmoe_cuda: x must be contiguous, got shape ", x.sizes(), " strides ", x.strides()));
  const int64_t C = x.size(-1);
  TORCH_CHECK_WITH(Error, C % block_size == 0, msg("mxmoe_cuda: x.shape[-1]=", C, " is not divisible by block_size=", block_size));
  check_out(out, "out", x.sizes(), x);
  const c10::cuda::CUDAGuard guard(x.device());
  if (x.numel()) {
    const ElemConstants k = constants(el);
    check_launch(mx_qdq_dim0(x.data_ptr(), in, out.data_ptr(), od, x.numel(), static_cast<int>(block_size),
                             static_cast<int>(mode), el, static_cast<uint32_t>(k.t127), static_cast<uint32_t>(k.t126),
                             c10::bit_cast<float>(static_cast<uint32_t>(k.rceil_c_bits)), stream_of(x)),
                 "mx_qdq_dim0");
  }
}

Tensor qdq_dim0(const Tensor& x, int64_t block_size, int64_t mode, at::ScalarType elem, at::ScalarType out_dtype) {
  float_code(out_dtype, "out_dtype");
  Tensor out = at::empty(x.sizes(), x.options().dtype(out_dtype));
  qdq_dim0_out(x, block_size, mode, elem, out);
  return out;
}

// The checks of qdq_dim1 / qdq_dim0_dim1: x (..., R, C) contiguous CUDA bf16/fp32, ndim >= 2;
// offs: none, or (E >= 1,) int32 on x's device with x 2D. Returns offs contiguous (or undefined).
// name: x's name in the messages (g for swiglu_qdq_dim0_dim1).
Tensor check_qdq_rows(const Tensor& x, int64_t block_size, int64_t mode, at::ScalarType elem,
                      at::ScalarType out_dtype, const std::optional<Tensor>& offs, const char* name = "x") {
  TORCH_CHECK_WITH(Error, x.is_cuda(), msg("mxmoe_cuda: ", name, " must be a CUDA tensor, got device ", x.device()));
  TORCH_CHECK_WITH(Error, x.dim() >= 2, msg("mxmoe_cuda: ", name, " must have at least 2 dims, got shape ", x.sizes()));
  TORCH_CHECK_WITH(Error, block_size >= 2 && (block_size & (block_size - 1)) == 0, msg("mxmoe_cuda: block_size must be a power of two >= 2, got ", block_size));
  TORCH_CHECK_WITH(Error, mode >= 0 && mode <= 3, msg("mxmoe_cuda: mode must be 0..3 (FLOOR, RCEIL, CEIL, EVEN), got ", mode));
  float_code(x.scalar_type(), name);
  elem_code(elem, "elem_dtype");
  float_code(out_dtype, "out_dtype");
  TORCH_CHECK_WITH(Error, x.is_contiguous(), msg("mxmoe_cuda: ", name, " must be contiguous, got shape ", x.sizes(), " strides ", x.strides()));
  if (!offs.has_value() || !offs->defined()) return Tensor();
  const Tensor& o = *offs;
  TORCH_CHECK_WITH(Error, x.dim() == 2, msg("mxmoe_cuda: ", name, " must be 2D (T, C) with offs, got shape ", x.sizes()));
  TORCH_CHECK_TYPE(o.scalar_type() == at::kInt && o.dim() == 1, msg("mxmoe_cuda: offs must be a 1D Int tensor of cumulative group ends, got ", o.scalar_type(), " of shape ", o.sizes()));
  TORCH_CHECK_WITH(Error, o.size(0) >= 1 && o.size(0) <= INT32_MAX, msg("mxmoe_cuda: offs must have at least 1 group, got shape ", o.sizes()));
  TORCH_CHECK_WITH(Error, o.device() == x.device(), msg("mxmoe_cuda: offs is on ", o.device(), ", ", name, " on ", x.device()));
  return o.contiguous();
}

// (offs pointer, group count) of checked offs (undefined: no groups).
struct GroupArgs {
  const int32_t* offs = nullptr;
  int64_t E = 0;
};

GroupArgs group_args(const Tensor& offs) {
  if (!offs.defined()) return {};
  return {offs.data_ptr<int32_t>(), offs.size(0)};
}

Tensor qdq_dim1(const Tensor& x, int64_t block_size, int64_t mode, at::ScalarType elem, at::ScalarType out_dtype,
                const std::optional<Tensor>& offs_) {
  const Tensor offs = check_qdq_rows(x, block_size, mode, elem, out_dtype, offs_);
  const int64_t R = x.size(-2), C = x.size(-1);
  const c10::cuda::CUDAGuard guard(x.device());
  Tensor y = at::empty(x.sizes(), x.options().dtype(out_dtype));
  if (x.numel()) {
    const int el = elem_code(elem, "elem_dtype");
    const ElemConstants k = constants(el);
    const GroupArgs g = group_args(offs);
    check_launch(mx_qdq_dim1(x.data_ptr(), float_code(x.scalar_type(), "x"), y.data_ptr(),
                             float_code(out_dtype, "out_dtype"), x.numel() / (R * C), R, C,
                             static_cast<int>(block_size), static_cast<int>(mode), el, static_cast<uint32_t>(k.t127),
                             static_cast<uint32_t>(k.t126), c10::bit_cast<float>(static_cast<uint32_t>(k.rceil_c_bits)),
                             g.offs, g.E, stream_of(x)),
                 "mx_qdq_dim1");
  }
  return y;
}

std::tuple<Tensor, Tensor> qdq_dim0_dim1(const Tensor& x, int64_t block_size, int64_t mode, at::ScalarType elem,
                                         at::ScalarType out_dtype, const std::optional<Tensor>& offs_) {
  const Tensor offs = check_qdq_rows(x, block_size, mode, elem, out_dtype, offs_);
  const int64_t R = x.size(-2), C = x.size(-1);
  TORCH_CHECK_WITH(Error, C % block_size == 0, msg("mxmoe_cuda: x.shape[-1]=", C, " is not divisible by block_size=", block_size));
  const c10::cuda::CUDAGuard guard(x.device());
  Tensor y0 = at::empty(x.sizes(), x.options().dtype(out_dtype));
  Tensor y1 = at::empty(x.sizes(), x.options().dtype(out_dtype));
  if (x.numel()) {
    const int el = elem_code(elem, "elem_dtype");
    const ElemConstants k = constants(el);
    const GroupArgs g = group_args(offs);
    check_launch(mx_qdq_dim0_dim1(x.data_ptr(), float_code(x.scalar_type(), "x"), y0.data_ptr(), y1.data_ptr(),
                                  float_code(out_dtype, "out_dtype"), x.numel() / (R * C), R, C,
                                  static_cast<int>(block_size), static_cast<int>(mode), el,
                                  static_cast<uint32_t>(k.t127), static_cast<uint32_t>(k.t126),
                                  c10::bit_cast<float>(static_cast<uint32_t>(k.rceil_c_bits)), g.offs, g.E,
                                  stream_of(x)),
                 "mx_qdq_dim0_dim1");
  }
  return {y0, y1};
}

// h = silu(g) * u (as eager PyTorch's `F.silu(g) * u`), then qdq_dim0_dim1(h, offs), without h in
// memory where the one-pass kernel applies (block 32, 16-byte aligned); else h is formed with ATen's
// own silu and mul (the definition) and cast by mx_qdq_dim0_dim1.
std::tuple<Tensor, Tensor> swiglu_qdq_dim0_dim1(const Tensor& g, const Tensor& u, int64_t block_size, int64_t mode,
                                                at::ScalarType elem, at::ScalarType out_dtype,
                                                const std::optional<Tensor>& offs_) {
  const Tensor offs = check_qdq_rows(g, block_size, mode, elem, out_dtype, offs_, "g");
  TORCH_CHECK_WITH(Error, u.device() == g.device(), msg("mxmoe_cuda: u is on ", u.device(), ", g on ", g.device()));
  TORCH_CHECK_TYPE(u.scalar_type() == g.scalar_type(), msg("mxmoe_cuda: u is ", u.scalar_type(), "; expected g's dtype ", g.scalar_type()));
  TORCH_CHECK_WITH(Error, u.sizes() == g.sizes() && u.is_contiguous(), msg("mxmoe_cuda: u must be contiguous of g's shape ", g.sizes(), ", got shape ", u.sizes(), " strides ", u.strides()));
  const int64_t R = g.size(-2), C = g.size(-1);
  TORCH_CHECK_WITH(Error, C % block_size == 0, msg("mxmoe_cuda: g.shape[-1]=", C, " is not divisible by block_size=", block_size));
  const c10::cuda::CUDAGuard guard(g.device());
  Tensor y0 = at::empty(g.sizes(), g.options().dtype(out_dtype));
  Tensor y1 = at::empty(g.sizes(), g.options().dtype(out_dtype));
  if (g.numel()) {
    const int in = float_code(g.scalar_type(), "g"), od = float_code(out_dtype, "out_dtype");
    const int el = elem_code(elem, "elem_dtype");
    const ElemConstants k = constants(el);
    const GroupArgs ga = group_args(offs);
    const auto t127 = static_cast<uint32_t>(k.t127), t126 = static_cast<uint32_t>(k.t126);
    const float c = c10::bit_cast<float>(static_cast<uint32_t>(k.rceil_c_bits));
    if (mx_swiglu_qdq_one_pass(in, g.data_ptr(), u.data_ptr(), y0.data_ptr(), y1.data_ptr(), C,
                               static_cast<int>(block_size))) {
      check_launch(mx_swiglu_qdq_dim0_dim1(g.data_ptr(), u.data_ptr(), in, y0.data_ptr(), y1.data_ptr(), od,
                                           g.numel() / (R * C), R, C, static_cast<int>(block_size),
                                           static_cast<int>(mode), el, t127, t126, c, ga.offs, ga.E,
                                           stream_of(g)),
                   "mx_swiglu_qdq_dim0_dim1");
    } else {
      const Tensor h = at::silu(g) * u;
      check_launch(mx_qdq_dim0_dim1(h.data_ptr(), in, y0.data_ptr(), y1.data_ptr(), od, h.numel() / (R * C), R, C,
                                    static_cast<int>(block_size), static_cast<int>(mode), el, t127, t126, c, ga.offs,
                                    ga.E, stream_of(h)),
                   "mx_qdq_dim0_dim1");
    }
  }
  return {y0, y1};
}

// The SwiGLU backward of h = silu(g) * u given dh (as eager PyTorch: du = dh * silu(g), dg =
// silu_backward(dh * u, g)), then qdq_dim0_dim1 of dg and of du with offs, without dg and du in memory
// where the one-pass kernel applies (block 32, 16-byte aligned); else dg and du are formed with ATen's
// own ops (the definition) and cast by mx_qdq_dim0_dim1.
std::tuple<Tensor, Tensor, Tensor, Tensor> swiglu_bwd_qdq_dim0_dim1(const Tensor& dh, const Tensor& g, const Tensor& u,
                                                                    int64_t block_size, int64_t mode,
                                                                    at::ScalarType elem, at::ScalarType out_dtype,
                                                                    const std::optional<Tensor>& offs_) {
  const Tensor offs = check_qdq_rows(dh, block_size, mode, elem, out_dtype, offs_, "dh");
  auto check_like_dh = [&](const Tensor& t, const char* name) {
    TORCH_CHECK_WITH(Error, t.device() == dh.device(), msg("mxmoe_cuda: ", name, " is on ", t.device(), ", dh on ", dh.device()));
    TORCH_CHECK_TYPE(t.scalar_type() == dh.scalar_type(), msg("mxmoe_cuda: ", name, " is ", t.scalar_type(), "; expected dh's dtype ", dh.scalar_type()));
    TORCH_CHECK_WITH(Error, t.sizes() == dh.sizes() && t.is_contiguous(), msg("mxmoe_cuda: ", name, " must be contiguous of dh's shape ", dh.sizes(), ", got shape ", t.sizes(), " strides ", t.strides()));
  };
  check_like_dh(g, "g");
  check_like_dh(u, "u");
  const int64_t R = dh.size(-2), C = dh.size(-1);
  TORCH_CHECK_WITH(Error, C % block_size == 0, msg("mxmoe_cuda: dh.shape[-1]=", C, " is not divisible by block_size=", block_size));
  const c10::cuda::CUDAGuard guard(dh.device());
  const auto opts = dh.options().dtype(out_dtype);
  Tensor dg0 = at::empty(dh.sizes(), opts), dg1 = at::empty(dh.sizes(), opts);
  Tensor du0 = at::empty(dh.sizes(), opts), du1 = at::empty(dh.sizes(), opts);
  if (dh.numel()) {
    const int in = float_code(dh.scalar_type(), "dh"), od = float_code(out_dtype, "out_dtype");
    const int el = elem_code(elem, "elem_dtype");
    const ElemConstants k = constants(el);
    const GroupArgs ga = group_args(offs);
    const auto t127 = static_cast<uint32_t>(k.t127), t126 = static_cast<uint32_t>(k.t126);
    const float c = c10::bit_cast<float>(static_cast<uint32_t>(k.rceil_c_bits));
    const int64_t B = dh.numel() / (R * C);
    const int bs = static_cast<int>(block_size), md = static_cast<int>(mode);
    if (mx_swiglu_bwd_qdq_one_pass(in, dh.data_ptr(), g.data_ptr(), u.data_ptr(), dg0.data_ptr(), dg1.data_ptr(),
                                   du0.data_ptr(), du1.data_ptr(), C, bs)) {
      check_launch(mx_swiglu_bwd_qdq_dim0_dim1(dh.data_ptr(), g.data_ptr(), u.data_ptr(), in, dg0.data_ptr(),
                                               dg1.data_ptr(), du0.data_ptr(), du1.data_ptr(), od, B, R, C, bs, md, el,
                                               t127, t126, c, ga.offs, ga.E, stream_of(dh)),
                   "mx_swiglu_bwd_qdq_dim0_dim1");
    } else {
      const Tensor du = dh * at::silu(g);
      const Tensor dg = at::silu_backward(dh * u, g);
      auto cast = [&](const Tensor& x, Tensor& y0, Tensor& y1) {
        check_launch(mx_qdq_dim0_dim1(x.data_ptr(), in, y0.data_ptr(), y1.data_ptr(), od, B, R, C, bs, md, el, t127,
                                      t126, c, ga.offs, ga.E, stream_of(x)),
                     "mx_qdq_dim0_dim1");
      };
      cast(dg, dg0, dg1);
      cast(du, du0, du1);
    }
  }
  return {dg0, dg1, du0, du1};
}

void zero_rows_after(Tensor& out, const Tensor& offs) {
  TORCH_CHECK_WITH(Error, out.is_cuda(), msg("mxmoe_cuda: out must be a CUDA tensor, got device ", out.device()));
  TORCH_CHECK_WITH(Error, out.dim() == 2 && out.stride(1) == 1, msg("mxmoe_cuda: out must be 2D (T, N) with unit column stride, got shape ", out.sizes(), " strides ", out.strides()));
  const int od = float_code(out.scalar_type(), "out");
  TORCH_CHECK_TYPE(offs.scalar_type() == at::kInt && offs.dim() == 1, msg("mxmoe_cuda: offs must be a 1D Int tensor of cumulative group ends, got ", offs.scalar_type(), " of shape ", offs.sizes()));
  TORCH_CHECK_WITH(Error, offs.size(0) >= 1, msg("mxmoe_cuda: offs must have at least 1 group, got shape ", offs.sizes()));
  TORCH_CHECK_WITH(Error, offs.device() == out.device(), msg("mxmoe_cuda: offs is on ", offs.device(), ", out on ", out.device()));
  if (out.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(out.device());
  const int32_t* end = offs.data_ptr<int32_t>() + (offs.size(0) - 1) * offs.stride(0);  // offs[E-1]
  check_launch(mx_zero_rows_after(out.data_ptr(), od, out.size(0), out.size(1), out.stride(0), end, stream_of(out)),
               "mx_zero_rows_after");
}

std::vector<int64_t> format_constants(at::ScalarType elem) {
  const ElemConstants k = constants(elem_code(elem, "elem_dtype"));
  return {k.emax, k.mbits, k.max_bits, k.rceil_c_bits, k.t127, k.t126};
}

}  // namespace

TORCH_LIBRARY(mxmoe_cuda, m) {
  m.def("quantize_dim0(Tensor x, int block_size, int mode, ScalarType elem_dtype) -> (Tensor, Tensor)");
  m.def("quantize_dim0_out(Tensor x, int block_size, int mode, Tensor(a!) q, Tensor(b!) s) -> ()");
  m.def("quantize_dim1(Tensor x, int block_size, int mode, ScalarType elem_dtype) -> (Tensor, Tensor)");
  m.def("quantize_dim0_dim1(Tensor x, int block_size, int mode, ScalarType elem_dtype) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("dequantize(Tensor q, Tensor s, int block_size, ScalarType out_dtype) -> Tensor");
  m.def("dequantize_out(Tensor q, Tensor s, int block_size, Tensor(a!) out) -> ()");
  m.def("qdq_dim0(Tensor x, int block_size, int mode, ScalarType elem_dtype, ScalarType out_dtype) -> Tensor");
  m.def("qdq_dim0_out(Tensor x, int block_size, int mode, ScalarType elem_dtype, Tensor(a!) out) -> ()");
  m.def("qdq_dim1(Tensor x, int block_size, int mode, ScalarType elem_dtype, ScalarType out_dtype, Tensor? offs=None) -> Tensor");
  m.def("qdq_dim0_dim1(Tensor x, int block_size, int mode, ScalarType elem_dtype, ScalarType out_dtype, Tensor? offs=None) -> (Tensor, Tensor)");
  m.def("swiglu_qdq_dim0_dim1(Tensor g, Tensor u, int block_size, int mode, ScalarType elem_dtype, ScalarType out_dtype, Tensor? offs=None) -> (Tensor, Tensor)");
  m.def("swiglu_bwd_qdq_dim0_dim1(Tensor dh, Tensor g, Tensor u, int block_size, int mode, ScalarType elem_dtype, ScalarType out_dtype, Tensor? offs=None) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("zero_rows_after(Tensor(a!) out, Tensor offs) -> ()");
  m.def("format_constants(ScalarType elem_dtype) -> int[]", &format_constants);
}

TORCH_LIBRARY_IMPL(mxmoe_cuda, CUDA, m) {
  m.impl("quantize_dim0", &quantize_dim0);
  m.impl("quantize_dim0_out", &quantize_dim0_out);
  m.impl("quantize_dim1", &quantize_dim1);
  m.impl("quantize_dim0_dim1", &quantize_dim0_dim1);
  m.impl("dequantize", &dequantize);
  m.impl("dequantize_out", &dequantize_out);
  m.impl("qdq_dim0", &qdq_dim0);
  m.impl("qdq_dim0_out", &qdq_dim0_out);
  m.impl("qdq_dim1", &qdq_dim1);
  m.impl("qdq_dim0_dim1", &qdq_dim0_dim1);
  m.impl("swiglu_qdq_dim0_dim1", &swiglu_qdq_dim0_dim1);
  m.impl("swiglu_bwd_qdq_dim0_dim1", &swiglu_bwd_qdq_dim0_dim1);
  m.impl("zero_rows_after", &zero_rows_after);
}
