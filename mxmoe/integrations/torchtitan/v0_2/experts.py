"""`MXGroupedExperts`: torchtitan 0.2's `GroupedExperts` on MX operands (made by the converter,
`v0_2.converter`; given mxmoe's exchange by `v0_2.expert_parallel`, both above this module);
`MXFeedForward`: its `FeedForward` (dense layers, shared experts) with one cast of x for w1 and w3."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.tensor import DTensor
from torchtitan.models.moe.moe import FeedForward, GroupedExperts

from mxmoe.nn import grouped_mm, project
from mxmoe.nn.mx_experts import run_on_mx_rounded_rows
from mxmoe.ops import mx_grouped_swiglu_mlp
from mxmoe.quant.mx_tensor import MXTensor
from mxmoe.recipe import DEFAULT_RECIPE, MXRecipe
from mxmoe.token_dispatch import ExpertRows


def _local(t: Tensor) -> Tensor:
    # Expert- / data-parallel shards reach the GEMMs as local tensors (as torchtitan's experts).
    return t.to_local() if isinstance(t, DTensor) else t


class MXGroupedExperts(GroupedExperts):
    """torchtitan 0.2's `GroupedExperts` with its grouped GEMMs on MX operands (`mx_grouped_mm`'s).

    forward(x, num_tokens_per_expert (E,) counts, float or int) -> (T, dim): x is (T, dim) tokens
    grouped by expert (out: x's dtype), or a 2D MXTensor blocked along dim (the MXFP8 exchange's
    rows, bf16 origin; out: bf16). silu(x @ w1[e].T) * (x @ w3[e].T) @ w2[e].T for the rows of
    expert e, computed in bf16 as torchtitan's `_run_experts_grouped_mm` (x and weights cast to
    bf16): every GEMM on MX operands (`mx_grouped_swiglu_mlp`: w1 and w3 sharing one cast of x);
    with the recipe's `expert_gemm = "bf16"`, bf16 grouped GEMMs on the rows rounded to MX once (an
    MXTensor's rows dequantized: they are rounded already; a tensor's rounded here, and its output's
    gradient too, as the MXFP8 exchange would). Rows after the last group give zeros. Made by
    `MXMoEConverter` (a class swap: same parameters), which also sets `recipe`, `mxfp8_a2a` and
    `a2a_transport`.
    """

    recipe: MXRecipe = DEFAULT_RECIPE
    mxfp8_a2a: bool = True
    a2a_transport: str = "auto"

    def forward(self, x: Tensor | MXTensor, num_tokens_per_expert: Tensor) -> Tensor:
        w1, w2, w3 = (_local(w).bfloat16().transpose(-2, -1) for w in (self.w1, self.w2, self.w3))
        offs = torch.cumsum(num_tokens_per_expert, dim=0, dtype=torch.int32)
        r = self.recipe
        if r.expert_gemm == "bf16":
            out = run_on_mx_rounded_rows(
                x, r, lambda rows: _swiglu_bf16(rows, w1, w3, w2, offs), dtype=torch.bfloat16
            )
            return out if isinstance(x, MXTensor) else out.type_as(x)
        xb = x if isinstance(x, MXTensor) else x.bfloat16()
        # mx_grouped_mm(F.silu(g) * u, w2) of g, u = mx_grouped_mm_shared(xb, (w1, w3)) bit for bit,
        # as one autograd op where it fuses (its docstring)
        out = mx_grouped_swiglu_mlp(xb, w1, w3, w2, offs, r)
        return out if isinstance(x, MXTensor) else out.type_as(x)

    def expert_rows(self) -> ExpertRows:
        """What these experts take from mxmoe's exchange: MX rows in their recipe, as an MXTensor."""
        return ExpertRows(self.recipe)

    def extra_repr(self) -> str:
        c = self.recipe
        gemm = ", expert_gemm=bf16" if c.expert_gemm == "bf16" else ""
        return f"num_experts={self.num_experts}, mx={c.elem_dtype}/{c.scaling_mode}/{c.block_size}{gemm}"


def _swiglu_bf16(x: Tensor, w1_t: Tensor, w3_t: Tensor, w2_t: Tensor, offs: Tensor) -> Tensor:
    """torchtitan's SwiGLU experts in bf16: x (T, dim) bf16 grouped by expert, w*_t (E, K, N) bf16."""
    h = F.silu(grouped_mm(x, w1_t, offs)) * grouped_mm(x, w3_t, offs)
    return grouped_mm(h, w2_t, offs)


class MXFeedForward(FeedForward):
    """torchtitan 0.2's `FeedForward` (the SwiGLU MLP of the dense layers and of the shared experts)
    whose w1 and w3 are MXLinears: w2(F.silu(g) * u) of g, u = `mxmoe.nn.project(x, w1, w3)`, one
    cast of x for both (one op, x along M kept once), the outputs and gradients of w1(x) and w3(x)
    bit for bit. Made by `MXMoEConverter` (a class swap: same module and parameters)."""

    def forward(self, x: Tensor) -> Tensor:
        g, u = project(x, self.w1, self.w3)
        return self.w2(F.silu(g) * u)
