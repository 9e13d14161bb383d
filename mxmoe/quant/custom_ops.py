"""The cast kernels as `torch.library` custom ops, with fake implementations so that
`torch.compile(fullgraph=True)` traces through them without a graph break.

The quantize ops take the format by its registered name (`mxmoe.formats.FORMATS`). Every op takes
a concrete `kernel` name ("torch" | "triton" | "cuda") and checked arguments
(`mxmoe.quant.call_path` calls them only while torch.compile traces; eager calls go straight to the
backends). Inputs must be contiguous; outputs are fresh contiguous tensors. Scales are
the format's scale dtype (E8M0).
"""

from __future__ import annotations

import torch
from torch import Tensor

from mxmoe.formats import SCALE_DTYPE, get_format
from mxmoe.quant.backends import cast_fn


def _contiguous(outs):
    """The fake implementations promise contiguous outputs (torch.compile relies on it: inductor
    asserts the strides, AOTAutograd replays views with them), so the real ops must return them."""
    if isinstance(outs, tuple):
        return tuple(t.contiguous() for t in outs)
    return outs.contiguous()


def fake_dim0(x: Tensor, block_size: int, elem_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Empty outputs of a dim0 cast of x (..., C): x's shape elem_dtype, (..., C // bs) e8m0."""
    *lead, C = x.shape
    return (
        torch.empty(x.shape, dtype=elem_dtype, device=x.device),
        torch.empty((*lead, C // block_size), dtype=SCALE_DTYPE, device=x.device),
    )


def fake_dim1(x: Tensor, block_size: int, elem_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Empty outputs of a dim1 cast of x (..., R, C): (..., C, R) elem_dtype, (..., C, R // bs) e8m0."""
    *lead, R, C = x.shape
    return (
        torch.empty((*lead, C, R), dtype=elem_dtype, device=x.device),
        torch.empty((*lead, C, R // block_size), dtype=SCALE_DTYPE, device=x.device),
    )


def fake_dim0_dim1(x: Tensor, block_size: int, elem_dtype: torch.dtype):
    """Empty outputs of the fused cast of x (R, C): fake_dim0's and fake_dim1's."""
    return (*fake_dim0(x, block_size, elem_dtype), *fake_dim1(x, block_size, elem_dtype))


@torch.library.custom_op("mxmoe::quantize_dim0", mutates_args=())
def quantize_dim0(x: Tensor, fmt: str, kernel: str) -> tuple[Tensor, Tensor]:
    """x (..., C) -> qdata x's shape, scale (..., C // block_size); blocks along the last dim."""
    f = get_format(fmt)
    if x.numel() == 0:
        return fake_dim0(x, f.block_size, f.elem_dtype)
    return _contiguous(cast_fn(kernel, "dim0")(x, f.spec))


@quantize_dim0.register_fake
def _(x, fmt, kernel):
    f = get_format(fmt)
    return fake_dim0(x, f.block_size, f.elem_dtype)


@torch.library.custom_op("mxmoe::quantize_dim1", mutates_args=())
def quantize_dim1(x: Tensor, fmt: str, kernel: str) -> tuple[Tensor, Tensor]:
    """x (..., R, C), ndim >= 2 -> qdata (..., C, R), scale (..., C, R // block_size); blocks along
    R, stored transposed so that each block is contiguous (the layout a GEMM reducing over R wants)."""
    f = get_format(fmt)
    if x.numel() == 0:
        return fake_dim1(x, f.block_size, f.elem_dtype)
    return _contiguous(cast_fn(kernel, "dim1")(x, f.spec))


@quantize_dim1.register_fake
def _(x, fmt, kernel):
    f = get_format(fmt)
    return fake_dim1(x, f.block_size, f.elem_dtype)


@torch.library.custom_op("mxmoe::quantize_dim0_dim1", mutates_args=())
def quantize_dim0_dim1(x: Tensor, fmt: str, kernel: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """x (R, C) read once -> dim0 (R, C), (R, C//bs) and dim1 (C, R), (C, R//bs)."""
    f = get_format(fmt)
    if x.numel() == 0:
        return fake_dim0_dim1(x, f.block_size, f.elem_dtype)
    return _contiguous(cast_fn(kernel, "dim0_dim1")(x, f.spec))


@quantize_dim0_dim1.register_fake
def _(x, fmt, kernel):
    f = get_format(fmt)
    return fake_dim0_dim1(x, f.block_size, f.elem_dtype)


@torch.library.custom_op("mxmoe::dequantize", mutates_args=())
def dequantize(
    qdata: Tensor, scale: Tensor, block_size: int, out_dtype: torch.dtype, kernel: str
) -> Tensor:
    """qdata (R, C), scale (R, C // block_size) e8m0 -> (R, C) out_dtype."""
    if qdata.numel() == 0:
        return torch.empty(qdata.shape, dtype=out_dtype, device=qdata.device)
    return _contiguous(cast_fn(kernel, "dequant")(qdata, scale, block_size, out_dtype))


@dequantize.register_fake
def _(qdata, scale, block_size, out_dtype, kernel):
    return torch.empty(qdata.shape, dtype=out_dtype, device=qdata.device)
