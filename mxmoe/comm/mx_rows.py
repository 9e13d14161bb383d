"""The MXFP8 exchange's rows: quantized along the last dim in an `MXFormat` (the recipe's `fmt`,
with its dim0_kernel chosen by `mxmoe.quant.backends.cast_kernel`), and dequantized back; the fused
default-format kernels (`mxmoe.comm.kernels`) where they apply. Every transport (`mxmoe.comm.nccl`,
`mxmoe.comm.symm`) and the reference use these."""

from __future__ import annotations

import torch
from torch import Tensor

from mxmoe.comm.kernels import dequantize_into, qdq_into
from mxmoe.formats import DEFAULT_FORMAT, MXFormat
from mxmoe.quant import custom_ops
from mxmoe.quant.backends import backend, cast_kernel
from mxmoe.recipe import DEFAULT_RECIPE, MXRecipe


def _recipe(recipe: MXRecipe | None, fn: str) -> MXRecipe:
    """The exchange's recipe (None: DEFAULT_RECIPE); a TypeError naming `fn` for anything else."""
    if recipe is None:
        return DEFAULT_RECIPE
    if not isinstance(recipe, MXRecipe):
        raise TypeError(f"{fn}: recipe must be an mxmoe.MXRecipe or None, got {type(recipe).__name__}")
    return recipe


def _fast(fmt: MXFormat) -> bool:
    """Whether the fused kernels (own rows' qdq, symmetric memory), written for the default format,
    take `fmt`."""
    return fmt == DEFAULT_FORMAT


def _kernel(r: MXRecipe, device: torch.device) -> str:
    """The exchange's concrete cast kernel (its quantize and dequantize run along the rows: the
    recipe's dim0_kernel); a clear error for a kernel that cannot run here."""
    return cast_kernel(r, device, "dim0")


def quantize_rows(x: Tensor, *, recipe: MXRecipe | None = None) -> tuple[Tensor, Tensor]:
    """x (R, C) bf16/fp32 contiguous, C % block_size == 0 -> (q (R, C) elem_dtype, s (R, C //
    block_size) e8m0), with the recipe's format and dim0_kernel (default DEFAULT_RECIPE:
    e4m3, RCEIL, blocks of 32): the exchange's quantize."""
    r = _recipe(recipe, "quantize_rows")
    return _quantize(x, r.fmt, _kernel(r, x.device))


def _quantize(x: Tensor, fmt: MXFormat, k: str) -> tuple[Tensor, Tensor]:
    # `k` is concrete. The backend is called directly: the same kernel as the custom op, without
    # the dispatcher's per-call cost (the pipeline makes several calls per round).
    if x.numel() == 0:
        return custom_ops.quantize_dim0(x, fmt.name, k)
    return backend(k).quantize_dim0(x, fmt.spec)


def _dequantize(q: Tensor, s: Tensor, dtype: torch.dtype, fmt: MXFormat, k: str) -> Tensor:
    """q (R, C) elements (or uint8 view), s (R, C // block) scales (or uint8 view) -> (R, C) dtype."""
    return custom_ops.dequantize(q.view(fmt.elem_dtype), s.view(fmt.scale_dtype), fmt.block_size, dtype, k)


def _dequantize_into(q: Tensor, s: Tensor, out: Tensor, r: MXFormat, k: str) -> None:
    if _fast(r):
        dequantize_into(q, s, out, k)
    elif q.numel():
        out.copy_(_dequantize(q, s, out.dtype, r, k))


def _qdq_into(x: Tensor, out: Tensor, r: MXFormat, k: str) -> None:
    """out = dequantize(quantize(x)): one fused pass for the default format."""
    if _fast(r):
        qdq_into(x, out, k)
    elif x.numel():
        out.copy_(_dequantize(*_quantize(x, r, k), out.dtype, r, k))
