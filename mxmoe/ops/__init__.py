"""MX training ops: differentiable GEMMs whose operands are cast to MX along their reduction axis.

`mx_mm` (linear layers), `mx_grouped_mm` (MoE experts, drop-in for torch._grouped_mm), their
`*_shared` forms (several weights, one cast of the shared input), `mx_grouped_mm_swiglu` (the
experts' w2 GEMM on F.silu(g) * u, h cast straight from g and u), `mx_grouped_swiglu_mlp` (the
whole SwiGLU expert MLP as one op: dg and du cast straight from dh, g and u in backward), the GEMM
backend function `mx_gemm`, all configured by an `mxmoe.MXRecipe` (the parameter `recipe`). See
docs/training-ops.md. `check_offsets` checks group ends (done in the op for offsets on the host).
"""

from mxmoe.ops.gemm import mx_gemm
from mxmoe.ops.grouped import (
    check_offsets,
    mx_grouped_mm,
    mx_grouped_mm_shared,
    mx_grouped_mm_swiglu,
    mx_grouped_swiglu_mlp,
)
from mxmoe.ops.linear import mx_mm, mx_mm_shared
from mxmoe.recipe import GEMM_BACKENDS

__all__ = [
    "GEMM_BACKENDS",
    "check_offsets",
    "mx_gemm",
    "mx_grouped_mm",
    "mx_grouped_mm_shared",
    "mx_grouped_mm_swiglu",
    "mx_grouped_swiglu_mlp",
    "mx_mm",
    "mx_mm_shared",
]
