"""The MXFP8 exchange's format: rows quantized along the last dim with an `MXRecipe` (its elem
dtype, block size, scaling mode, and its dim0_kernel chosen by `mxmoe.quant.backends.cast_kernel`),
and dequantized back; the fused default-format kernels (`mxmoe.comm.kernels`) where they apply.
Every transport (`mxmoe.comm.nccl`, `mxmoe.comm.symm`) and the reference use these."""

from __future__ import annotations

import torch
from torch import Tensor

from mxmoe.comm.kernels import dequantize_into, qdq_into
from mxmoe.comm.splits import BLOCK_SIZE
from mxmoe.quant import custom_ops
from mxmoe.quant.backends import backend, cast_kernel
from mxmoe.quant.checks import spec_of
from mxmoe.recipe import DEFAULT_RECIPE, MXRecipe

# The format the fused kernels (own rows' quantize+dequantize, symmetric memory) are written for.
ELEM_DTYPE = torch.float8_e4m3fn
SCALING_MODE = "rceil"


def _recipe(recipe: MXRecipe | None, fn: str) -> MXRecipe:
    """The exchange's recipe (None: DEFAULT_RECIPE); a TypeError naming `fn` for anything else."""
    if recipe is None:
        return DEFAULT_RECIPE
    if not isinstance(recipe, MXRecipe):
        raise TypeError(f"{fn}: recipe must be an mxmoe.MXRecipe or None, got {type(recipe).__name__}")
    return recipe


def _fast(r: MXRecipe) -> bool:
    """Whether the fused default-format kernels (own rows' qdq, symmetric memory) take r's format."""
    return (r.elem_dtype, r.block_size, r.scaling_mode) == (ELEM_DTYPE, BLOCK_SIZE, SCALING_MODE)


def _kernel(r: MXRecipe, device: torch.device) -> str:
    """The exchange's concrete cast kernel (its quantize and dequantize run along the rows: the
    recipe's dim0_kernel); a clear error for a kernel that cannot run here."""
    return cast_kernel(r, device, "dim0")


def quantize_rows(x: Tensor, *, recipe: MXRecipe | None = None) -> tuple[Tensor, Tensor]:
    """x (R, C) bf16/fp32 contiguous, C % block_size == 0 -> (q (R, C) elem_dtype, s (R, C //
    block_size) float8_e8m0fnu), with the recipe's format and dim0_kernel (default DEFAULT_RECIPE:
    e4m3, RCEIL, blocks of 32): the exchange's quantize."""
    r = _recipe(recipe, "quantize_rows")
    return _quantize(x, r, _kernel(r, x.device))


def _quantize(x: Tensor, r: MXRecipe, k: str) -> tuple[Tensor, Tensor]:
    # `k` is concrete. The backend is called directly: the same kernel as the custom op, without
    # the dispatcher's per-call cost (the pipeline makes several calls per round).
    if x.numel() == 0:
        return custom_ops.quantize_dim0(x, r.block_size, r.scaling_mode, r.elem_dtype, k)
    return backend(k).quantize_dim0(x, spec_of(r.block_size, r.scaling_mode, r.elem_dtype))


def _dequantize(q: Tensor, s: Tensor, dtype: torch.dtype, r: MXRecipe, k: str) -> Tensor:
    """q (R, C) elements (or uint8 view), s (R, C // block) scales (or uint8 view) -> (R, C) dtype."""
    return custom_ops.dequantize(q.view(r.elem_dtype), s.view(torch.float8_e8m0fnu), r.block_size, dtype, k)


def _dequantize_into(q: Tensor, s: Tensor, out: Tensor, r: MXRecipe, k: str) -> None:
    if _fast(r):
        dequantize_into(q, s, out, k)
    elif q.numel():
        out.copy_(_dequantize(q, s, out.dtype, r, k))


def _qdq_into(x: Tensor, out: Tensor, r: MXRecipe, k: str) -> None:
    """out = dequantize(quantize(x)): one fused pass for the default format."""
    if _fast(r):
        qdq_into(x, out, k)
    elif x.numel():
        out.copy_(_dequantize(*_quantize(x, r, k), out.dtype, r, k))
