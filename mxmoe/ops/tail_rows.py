"""`zero_rows_after(out, offs)`: zero, in place, the rows of a grouped GEMM's output that belong to
no group (rows at or after offs[-1]), without a host sync and without touching the other rows.

torch._grouped_mm (2D x 3D) leaves those rows unwritten. Zeroing them with a mask (arange >=
offs[-1], then masked_fill) runs three kernels and reads and writes the whole output: an extra
elementwise pass per grouped forward and dgrad GEMM (72 per moe_1b training step), which the bf16
step does not run. Instead one kernel reads offs[-1] on the device and stores only the rows from
there on; in a MoE step the groups cover every row, so it costs one launch and one 4-byte load per
CTA / program, and tail rows, where there are some, are written once.

Two kernels, the same result bit for bit:
  "cuda": the C++ operator `mxmoe_cuda::zero_rows_after` of the CUDA cast extension
      (csrc/mx_qdq_kernels.cuh: a warp per row, 16-byte stores where the rows are 16-byte aligned; a fake
      implementation for torch.compile), for its host cost: about half the Triton kernel's launch
      (`mxmoe bench overhead`, rows `zero_rows_after`).
  "triton": a Triton kernel; each program covers a tile of 64 rows x 256 columns and stops at once
      when its rows all lie before offs[-1]. Runs on CUDA tensors, and on CPU tensors under
      TRITON_INTERPRET=1 (tests).
"auto" (what the grouped GEMM uses, `zero_rows_after_trusted`) takes "cuda" on CUDA tensors when
the extension builds or is loaded (`mxmoe.quant.backends.resolve_kernel`'s "auto", as the casts),
else "triton".
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from mxmoe.quant import cuda_cast
from mxmoe.quant.backends import cdiv, resolve_kernel, why_unavailable

KERNELS = ("auto", "triton", "cuda")

_BLOCK_R = 64  # rows per program
_BLOCK_N = 256  # columns per program


@triton.jit(do_not_specialize=["T", "last"])
def _zero_rows_after_kernel(out_ptr, offs_ptr, last, T, N, stride, BLOCK_R: tl.constexpr,
                            BLOCK_N: tl.constexpr):
    """out (T, N) with row stride `stride` (elements): rows end .. T - 1 set to zero, end =
    offs_ptr[last] (last: the offset, in elements, of offs[-1]); program (p, q) covers rows
    p*BLOCK_R.. and columns q*BLOCK_N.."""
    r0 = tl.program_id(0) * BLOCK_R
    end = tl.load(offs_ptr + last)
    if r0 + BLOCK_R > end:  # a scalar branch: programs wholly before the tail store nothing
        rows = r0 + tl.arange(0, BLOCK_R)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = ((rows >= end) & (rows < T))[:, None] & (cols < N)[None, :]
        ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride + cols[None, :]
        tl.store(ptrs, tl.zeros((BLOCK_R, BLOCK_N), dtype=out_ptr.dtype.element_ty), mask=mask)


def zero_rows_after(out: Tensor, offs: Tensor, *, kernel: str = "auto") -> Tensor:
    """Rows offs[-1] .. T - 1 of out set to zero in place; returns out.

    out: (T, N) bf16/fp32 with unit column stride (any row stride, e.g. torch._grouped_mm's padded
    one). offs: (E,) int32 cumulative group ends on out's device (any strides), offs[-1] <= T.
    kernel: "auto" (the C++ operator on CUDA where the extension builds, else Triton), "cuda" or
    "triton" (module docstring).
    """
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r}; expected one of {list(KERNELS)}")
    if out.ndim != 2 or out.stride(1) != 1:
        raise ValueError(f"out must be 2D with unit column stride, got shape {tuple(out.shape)}, "
                         f"strides {out.stride()}")
    if out.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"out must be bfloat16 or float32, got {out.dtype}")
    if offs.ndim != 1 or offs.dtype != torch.int32 or offs.shape[0] == 0 or offs.device != out.device:
        raise ValueError(f"offs must be a non-empty 1D int32 tensor on {out.device}, got {offs.dtype} "
                         f"{tuple(offs.shape)} on {offs.device}")
    if kernel == "auto":
        return zero_rows_after_trusted(out, offs)
    reason = why_unavailable(kernel, out.device)
    if reason is not None:
        raise RuntimeError(reason)
    if kernel == "cuda":
        return cuda_cast.zero_rows_after(out, offs)
    return _zero_rows_after_triton(out, offs)


def zero_rows_after_trusted(out: Tensor, offs: Tensor) -> Tensor:
    """`zero_rows_after(kernel="auto")` for arguments that are as it requires (a grouped GEMM's
    output and its checked offs): no checks, offs[-1] read in the kernel (no slice op on the host).
    On CUDA the C++ operator where the extension builds (the choice cached per process by
    resolve_kernel: a dict lookup per call), else the Triton kernel. While torch.compile traces
    before anything loaded the extension, the Triton kernel (the operator does not exist yet)."""
    if (
        out.is_cuda
        and resolve_kernel("auto", out.device, "dim0") == "cuda"
        and (cuda_cast.ops_loaded or not torch.compiler.is_compiling())
    ):
        return cuda_cast.zero_rows_after(out, offs)
    return _zero_rows_after_triton(out, offs)


def _zero_rows_after_triton(out: Tensor, offs: Tensor) -> Tensor:
    """The Triton kernel on checked arguments (a CUDA tensor, or CPU under TRITON_INTERPRET=1)."""
    T, N = out.shape
    if out.numel():
        _zero_rows_after_kernel[(cdiv(T, _BLOCK_R), cdiv(N, _BLOCK_N))](  # plain int math: host cost
            out, offs, (offs.shape[0] - 1) * offs.stride(0), T, N, out.stride(0), BLOCK_R=_BLOCK_R,
            BLOCK_N=_BLOCK_N, num_warps=4,
        )
    return out
