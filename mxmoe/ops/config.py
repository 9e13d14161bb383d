"""`MXOpConfig`: how an MX training op quantizes its operands and which GEMM backend it uses."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mxmoe.formats import check_block_size, check_elem_dtype, check_scaling_mode
from mxmoe.quant.kernels import KERNELS

GEMM_BACKENDS = ("emulated", "fp8")
GEMM_DTYPES = (None, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class MXOpConfig:
    """Quantization and GEMM choices shared by `mx_mm` and `mx_grouped_mm` (hashable, immutable).

    Every GEMM operand is cast to MX along its reduction axis (docs/training-ops.md), with
    these settings:
    """

    elem_dtype: torch.dtype = torch.float8_e4m3fn
    """Element format: torch.float8_e4m3fn (MXFP8, default) or torch.float8_e5m2."""
    block_size: int = 32
    """Elements per scale along the reduction axis: a power of two >= 2 (MX uses 32)."""
    scaling_mode: str = "rceil"
    """Block exponent rule: "rceil" (cuBLAS round-up, never saturates), "floor" (OCP), "ceil", "even"."""
    kernel: str = "auto"
    """Cast kernel for dim0-only casts and for dequantizing: "auto" | "torch" | "triton" | "cuda"."""
    dim1_kernel: str = "auto"
    """Cast kernel for every cast that produces a dim1 (transposed) result, including the fused
    dim0+dim1 cast of gradients and activations: "auto" | "torch" | "triton" | "cuda"."""
    gemm_backend: str = "emulated"
    """GEMM on MX operands. "emulated": dequantize both operands (exactly, see `gemm_dtype`) and
    run a high-precision GEMM with fp32 accumulation (the default). "fp8": one fp8 MMA per 32-block
    of K on sm_90's tensor cores, promoted with the block scales (opt-in; e4m3, block 32)."""
    gemm_dtype: torch.dtype | None = None
    """Operand dtype of the emulated GEMM. None: bf16 on CUDA, fp32 elsewhere. bf16 holds every
    dequantized e4m3 value exactly unless its block scale byte is < 3 (e5m2: < 10), i.e. blocks with
    amax below ~2^-116; fp32 holds all of them exactly. Output is rounded to the input's dtype."""

    def __post_init__(self) -> None:
        check_elem_dtype(self.elem_dtype)
        check_block_size(self.block_size)
        object.__setattr__(self, "scaling_mode", check_scaling_mode(self.scaling_mode).value)
        for name in ("kernel", "dim1_kernel"):
            value = getattr(self, name)
            if value != "auto" and value not in KERNELS:
                raise ValueError(
                    f"{name}={value!r} is not a cast kernel; expected 'auto' or one of {KERNELS}"
                )
        if self.gemm_backend not in GEMM_BACKENDS:
            raise ValueError(
                f"gemm_backend={self.gemm_backend!r} is not supported; expected one of {GEMM_BACKENDS}"
            )
        if self.gemm_dtype not in GEMM_DTYPES:
            raise TypeError(
                f"gemm_dtype={self.gemm_dtype} is not supported; expected None, bfloat16 or float32"
            )

    def compute_dtype(self, device: torch.device) -> torch.dtype:
        """The emulated GEMM's operand dtype on `device`."""
        if self.gemm_dtype is not None:
            return self.gemm_dtype
        return torch.bfloat16 if device.type == "cuda" else torch.float32

    def cast_kwargs(self, dim1: bool = False) -> dict:
        """Keyword arguments for `to_mx` / `to_mx_dim0_dim1`."""
        return {
            "scaling_mode": self.scaling_mode,
            "elem_dtype": self.elem_dtype,
            "block_size": self.block_size,
            "kernel": self.dim1_kernel if dim1 else self.kernel,
        }
