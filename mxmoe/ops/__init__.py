"""MX training ops: differentiable GEMMs whose operands are cast to MX along their reduction axis.

`mx_mm` (linear layers), `mx_grouped_mm` (MoE experts, drop-in for torch._grouped_mm), the GEMM
backend function `mx_gemm`, and `MXOpConfig`. See docs/training-ops.md.
"""

from mxmoe.ops.config import GEMM_BACKENDS, MXOpConfig
from mxmoe.ops.gemm import mx_gemm
from mxmoe.ops.grouped import mx_grouped_mm
from mxmoe.ops.linear import mx_mm

__all__ = ["GEMM_BACKENDS", "MXOpConfig", "mx_gemm", "mx_grouped_mm", "mx_mm"]
