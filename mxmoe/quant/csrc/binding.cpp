// Thin torch binding of the MX cast launchers in mx_cast.cu (see mx_cast.h for the codes).
//
// Python (mxmoe/quant/cuda_cast.py) allocates every output, passes fp8 / E8M0 tensors as uint8
// views, sets the current device to the tensors' device and passes the current stream as an integer
// (torch.cuda.current_stream().cuda_stream). Every launch's cudaError_t is checked here and turned
// into a RuntimeError naming the launcher.
#include <torch/extension.h>

#include <cstdint>

#include "mx_cast.h"

namespace {

void check_cuda_tensor(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), "mxmoe cuda cast: ", name, " must be a CUDA tensor, got device ", t.device());
  TORCH_CHECK(t.is_contiguous(), "mxmoe cuda cast: ", name, " must be contiguous");
}

void check_bytes(const torch::Tensor& t, const char* name, int64_t numel) {
  check_cuda_tensor(t, name);
  TORCH_CHECK(t.scalar_type() == torch::kByte, "mxmoe cuda cast: ", name, " must be a uint8 view, got ",
              t.scalar_type());
  TORCH_CHECK(t.numel() == numel, "mxmoe cuda cast: ", name, " has ", t.numel(), " elements, expected ", numel);
}

int float_code(const torch::Tensor& t, const char* name) {
  if (t.scalar_type() == torch::kBFloat16) return MX_BF16;
  if (t.scalar_type() == torch::kFloat) return MX_F32;
  TORCH_CHECK(false, "mxmoe cuda cast: ", name, " must be bfloat16 or float32, got ", t.scalar_type());
  return -1;
}

void check_launch(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, "mxmoe cuda cast: ", what, " failed: ", cudaGetErrorName(err), " (",
              cudaGetErrorString(err), ")");
}

void quantize_dim0(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& s, int64_t block_size,
                   int64_t mode, int64_t elem, int64_t rceil_t127, int64_t rceil_t126, double rceil_c,
                   int64_t stream, int64_t variant) {
  check_cuda_tensor(x, "x");
  const int in = float_code(x, "x");
  TORCH_CHECK(block_size > 0, "mxmoe cuda cast: block_size must be positive, got ", block_size);
  check_bytes(q, "q", x.numel());
  check_bytes(s, "s", x.numel() / block_size);
  check_launch(mx_quantize_dim0(x.data_ptr(), in, q.data_ptr<uint8_t>(), s.data_ptr<uint8_t>(), x.numel(),
                                static_cast<int>(block_size), static_cast<int>(mode), static_cast<int>(elem),
                                static_cast<uint32_t>(rceil_t127), static_cast<uint32_t>(rceil_t126),
                                static_cast<float>(rceil_c), static_cast<intptr_t>(stream), static_cast<int>(variant)),
               "mx_quantize_dim0");
}

void quantize_dim1(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& s, int64_t block_size,
                   int64_t mode, int64_t elem, int64_t rceil_t127, int64_t rceil_t126, double rceil_c,
                   int64_t stream, int64_t variant) {
  check_cuda_tensor(x, "x");
  TORCH_CHECK(x.dim() == 3, "mxmoe cuda cast: quantize_dim1 wants x of shape (B, R, C), got ", x.sizes());
  const int in = float_code(x, "x");
  TORCH_CHECK(block_size > 0, "mxmoe cuda cast: block_size must be positive, got ", block_size);
  check_bytes(q, "q", x.numel());
  check_bytes(s, "s", x.numel() / block_size);
  check_launch(mx_quantize_dim1(x.data_ptr(), in, q.data_ptr<uint8_t>(), s.data_ptr<uint8_t>(), x.size(0),
                                x.size(1), x.size(2), static_cast<int>(block_size), static_cast<int>(mode),
                                static_cast<int>(elem), static_cast<uint32_t>(rceil_t127),
                                static_cast<uint32_t>(rceil_t126), static_cast<float>(rceil_c),
                                static_cast<intptr_t>(stream), static_cast<int>(variant)),
               "mx_quantize_dim1");
}

void quantize_dim0_dim1(const torch::Tensor& x, const torch::Tensor& q0, const torch::Tensor& s0,
                        const torch::Tensor& q1, const torch::Tensor& s1, int64_t block_size, int64_t mode,
                        int64_t elem, int64_t rceil_t127, int64_t rceil_t126, double rceil_c, int64_t stream,
                        int64_t variant) {
  check_cuda_tensor(x, "x");
  TORCH_CHECK(x.dim() == 2, "mxmoe cuda cast: quantize_dim0_dim1 wants x of shape (R, C), got ", x.sizes());
  const int in = float_code(x, "x");
  TORCH_CHECK(block_size > 0, "mxmoe cuda cast: block_size must be positive, got ", block_size);
  check_bytes(q0, "q0", x.numel());
  check_bytes(s0, "s0", x.numel() / block_size);
  check_bytes(q1, "q1", x.numel());
  check_bytes(s1, "s1", x.numel() / block_size);
  check_launch(mx_quantize_dim0_dim1(x.data_ptr(), in, q0.data_ptr<uint8_t>(), s0.data_ptr<uint8_t>(),
                                     q1.data_ptr<uint8_t>(), s1.data_ptr<uint8_t>(), x.size(0), x.size(1),
                                     static_cast<int>(block_size), static_cast<int>(mode), static_cast<int>(elem),
                                     static_cast<uint32_t>(rceil_t127), static_cast<uint32_t>(rceil_t126),
                                     static_cast<float>(rceil_c), static_cast<intptr_t>(stream), static_cast<int>(variant)),
               "mx_quantize_dim0_dim1");
}

void dequantize(const torch::Tensor& q, const torch::Tensor& s, const torch::Tensor& out, int64_t block_size,
                int64_t elem, int64_t stream, int64_t variant) {
  TORCH_CHECK(block_size > 0, "mxmoe cuda cast: block_size must be positive, got ", block_size);
  check_bytes(q, "q", q.numel());
  check_bytes(s, "s", q.numel() / block_size);
  check_cuda_tensor(out, "out");
  const int od = float_code(out, "out");
  TORCH_CHECK(out.numel() == q.numel(), "mxmoe cuda cast: out has ", out.numel(), " elements, expected ",
              q.numel());
  check_launch(mx_dequantize(q.data_ptr<uint8_t>(), s.data_ptr<uint8_t>(), out.data_ptr(), od, q.numel(),
                             static_cast<int>(block_size), static_cast<int>(elem), static_cast<intptr_t>(stream),
                             static_cast<int>(variant)),
               "mx_dequantize");
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "mxmoe MX cast kernels (CUDA, sm_90)";
  m.def("quantize_dim0", &quantize_dim0, "x (R, C) -> q (R, C) uint8, s (R, C / bs) uint8");
  m.def("quantize_dim1", &quantize_dim1, "x (B, R, C) -> q (B, C, R) uint8, s (B, C, R / bs) uint8");
  m.def("quantize_dim0_dim1", &quantize_dim0_dim1, "x (R, C) -> q0, s0 (along C) and q1, s1 (along R)");
  m.def("dequantize", &dequantize, "q (n,) uint8, s (n / bs,) uint8 -> out (n,) bf16 / fp32");
}
