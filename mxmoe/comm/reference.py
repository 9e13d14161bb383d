"""The definition the MXFP8 all-to-all must match, written plainly: `to_mx` with the recipe, the
process group's all_to_all_single of element and scale bytes, `dequantize` (docs/comm.md)."""

from __future__ import annotations

import torch
from torch import Tensor

from mxmoe.comm.mx_rows import _recipe
from mxmoe.comm.nccl import all_to_all_rows
from mxmoe.quant.mx_tensor import MXTensor, to_mx
from mxmoe.recipe import MXRecipe


class _Reference(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, outs, ins, group, r):
        ctx.args = (outs, ins, group, r)
        return _reference_once(x, outs, ins, group, r)

    @staticmethod
    def backward(ctx, grad):
        outs, ins, group, r = ctx.args
        return _reference_once(grad.contiguous(), ins, outs, group, r), None, None, None, None


def _reference_once(x: Tensor, outs: list[int], ins: list[int], group, r: MXRecipe) -> Tensor:
    mx = to_mx(x, axis=-1, recipe=r)
    rows, dim = sum(outs), x.shape[1]
    q = torch.empty((rows, dim), dtype=torch.uint8, device=x.device)
    s = torch.empty((rows, dim // r.block_size), dtype=torch.uint8, device=x.device)
    all_to_all_rows(q, mx.qdata_blocked.view(torch.uint8), outs, ins, group)
    all_to_all_rows(s, mx.scale_blocked.view(torch.uint8), outs, ins, group)
    out = MXTensor(
        q.view(r.elem_dtype), s.view(r.fmt.scale_dtype), 1, r.block_size, r.scaling_mode, x.dtype
    )
    return out.dequantize(recipe=r)


def reference_mxfp8_a2a(
    x: Tensor,
    output_splits,
    input_splits,
    group=None,
    *,
    recipe: MXRecipe | None = None,
) -> Tensor:
    """The definition the MXFP8 all-to-all must match: quantize (to_mx with the recipe, default
    DEFAULT_RECIPE: RCEIL, e4m3, along dim) -> plain all_to_all_single of element and scale bytes ->
    dequantize to x.dtype, both with the recipe's dim0_kernel. Differentiable: backward does the
    same to the gradient with the splits swapped. No overlap, no checks."""
    r = _recipe(recipe, "reference_mxfp8_a2a")
    outs = list(output_splits.tolist() if isinstance(output_splits, Tensor) else output_splits)
    ins = list(input_splits.tolist() if isinstance(input_splits, Tensor) else input_splits)
    return _Reference.apply(x, outs, ins, group, r)
