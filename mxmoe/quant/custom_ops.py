"""The cast kernels as `torch.library` custom ops, with fake implementations so that
`torch.compile(fullgraph=True)` traces through them without a graph break.

Every op takes a concrete `kernel` name ("torch" | "triton" | "cuda"); `mxmoe.quant.kernels`
resolves "auto" before the call. Inputs must be contiguous; outputs are fresh contiguous tensors.
Scales are `torch.float8_e8m0fnu`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mxmoe.formats import OUTPUT_DTYPES, check_block_size, check_elem_dtype, make_spec
from mxmoe.quant.kernels import backend


def _contiguous(outs):
    """The fake implementations promise contiguous outputs (torch.compile relies on it: inductor
    asserts the strides, AOTAutograd replays views with them), so the real ops must return them.
    A no-op for outputs that already are (the torch backend's dim1 result of a 2D input is not)."""
    if isinstance(outs, tuple):
        return tuple(t.contiguous() for t in outs)
    return outs.contiguous()


def _empty_like_rows(x: Tensor, shape, dtype) -> Tensor:
    return torch.empty(shape, dtype=dtype, device=x.device)


@torch.library.custom_op("mxmoe::quantize_dim0", mutates_args=())
def quantize_dim0(
    x: Tensor, block_size: int, scaling_mode: str, elem_dtype: torch.dtype, kernel: str
) -> tuple[Tensor, Tensor]:
    """x (R, C) -> qdata (R, C), scale (R, C // block_size); blocks along the last dim."""
    spec = make_spec(block_size, scaling_mode, elem_dtype)
    if x.numel() == 0:
        return _fake_dim0(x, block_size, scaling_mode, elem_dtype, kernel)
    return _contiguous(backend(kernel).quantize_dim0(x, spec))


@quantize_dim0.register_fake
def _fake_dim0(x, block_size, scaling_mode, elem_dtype, kernel):
    R, C = x.shape
    return (
        _empty_like_rows(x, (R, C), elem_dtype),
        _empty_like_rows(x, (R, C // block_size), torch.float8_e8m0fnu),
    )


@torch.library.custom_op("mxmoe::quantize_dim1", mutates_args=())
def quantize_dim1(
    x: Tensor, block_size: int, scaling_mode: str, elem_dtype: torch.dtype, kernel: str
) -> tuple[Tensor, Tensor]:
    """x (B, R, C) -> qdata (B, C, R), scale (B, C, R // block_size); blocks along R, stored
    transposed so that each block is contiguous (the layout a GEMM reducing over R wants)."""
    spec = make_spec(block_size, scaling_mode, elem_dtype)
    if x.numel() == 0:
        return _fake_dim1(x, block_size, scaling_mode, elem_dtype, kernel)
    return _contiguous(backend(kernel).quantize_dim1(x, spec))


@quantize_dim1.register_fake
def _fake_dim1(x, block_size, scaling_mode, elem_dtype, kernel):
    B, R, C = x.shape
    return (
        _empty_like_rows(x, (B, C, R), elem_dtype),
        _empty_like_rows(x, (B, C, R // block_size), torch.float8_e8m0fnu),
    )


@torch.library.custom_op("mxmoe::quantize_dim0_dim1", mutates_args=())
def quantize_dim0_dim1(
    x: Tensor, block_size: int, scaling_mode: str, elem_dtype: torch.dtype, kernel: str
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """x (R, C) read once -> dim0 (R, C), (R, C//bs) and dim1 (C, R), (C, R//bs)."""
    spec = make_spec(block_size, scaling_mode, elem_dtype)
    if x.numel() == 0:
        return _fake_dim0_dim1(x, block_size, scaling_mode, elem_dtype, kernel)
    return _contiguous(backend(kernel).quantize_dim0_dim1(x, spec))


@quantize_dim0_dim1.register_fake
def _fake_dim0_dim1(x, block_size, scaling_mode, elem_dtype, kernel):
    R, C = x.shape
    q0, s0 = _fake_dim0(x, block_size, scaling_mode, elem_dtype, kernel)
    q1, s1 = _fake_dim1(x.unsqueeze(0), block_size, scaling_mode, elem_dtype, kernel)
    return q0, s0, q1[0], s1[0]


def check_dequantize_args(qdata: Tensor, scale: Tensor, block_size: int, out_dtype: torch.dtype) -> None:
    """The one argument check of every dequantize backend: errors name the argument."""
    check_block_size(block_size)
    check_elem_dtype(qdata.dtype)
    if out_dtype not in OUTPUT_DTYPES:
        raise TypeError(f"out_dtype={out_dtype} is not supported; expected one of {list(OUTPUT_DTYPES)}")
    if scale.dtype not in (torch.float8_e8m0fnu, torch.uint8):
        raise TypeError(f"scale has dtype {scale.dtype}; expected torch.float8_e8m0fnu (or its uint8 view)")
    if qdata.ndim != 2 or qdata.shape[1] % block_size:
        raise ValueError(
            f"qdata must be 2D (R, C) with C divisible by block_size={block_size}, got {tuple(qdata.shape)}"
        )
    want = (qdata.shape[0], qdata.shape[1] // block_size)
    if tuple(scale.shape) != want:
        raise ValueError(
            f"scale has shape {tuple(scale.shape)}; expected {want} for qdata {tuple(qdata.shape)}"
        )
    if scale.device != qdata.device:
        raise ValueError(f"scale is on {scale.device} but qdata on {qdata.device}; expected one device")


@torch.library.custom_op("mxmoe::dequantize", mutates_args=())
def dequantize(
    qdata: Tensor, scale: Tensor, block_size: int, out_dtype: torch.dtype, kernel: str
) -> Tensor:
    """qdata (R, C), scale (R, C // block_size) e8m0 -> (R, C) out_dtype."""
    check_dequantize_args(qdata, scale, block_size, out_dtype)
    if qdata.numel() == 0:
        return torch.empty(qdata.shape, dtype=out_dtype, device=qdata.device)
    return _contiguous(backend(kernel).dequantize(qdata, scale, block_size, out_dtype))


@dequantize.register_fake
def _fake_dequantize(qdata, scale, block_size, out_dtype, kernel):
    return torch.empty(qdata.shape, dtype=out_dtype, device=qdata.device)
