"""One call path from checked arguments to a cast backend: direct in eager mode, through the
`mxmoe::*` custom ops while torch.compile traces.

Every function here trusts its arguments (the public API in `mxmoe.quant.mx_tensor` checks them
once): `kernel` is concrete ("torch" | "triton" | "cuda", already resolved for the device), `spec`
a `mxmoe.formats.CastSpec`, inputs contiguous bf16/fp32 with the blocked dims divisible by the
block size. Outputs are contiguous; scales `SCALE_DTYPE` (E8M0).

Why two paths: a `torch.library.custom_op` call costs tens of microseconds of Python per call in
eager mode, which dominates the cast of a small or medium tensor on a GPU. Eager calls therefore go
straight to the backend function; under torch.compile the custom ops (with their fake
implementations) keep the graph whole. The CUDA backend's operators are C++ operators with fake
implementations, so they are called directly in both modes once the extension is loaded.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mxmoe.formats import SCALE_DTYPE, CastSpec, format_name
from mxmoe.quant import cuda_cast, custom_ops
from mxmoe.quant.backends import cast_fn


def _format_name(spec: CastSpec) -> str:
    """The name of `spec`'s format, what the custom ops take (while tracing only): spelled from its
    fields, without the registry (`get_format` finds the format by it, registering one that is not
    yet; a registration traced here would fail dynamo's guards on the registry)."""
    return format_name(spec.elem.dtype, spec.block_size, spec.mode)


def _custom(kernel: str) -> bool:
    """While torch.compile traces: True when the call must go through the custom op (the backend is
    not the traceable C++ operator set)."""
    return kernel != "cuda" or not cuda_cast.ops_loaded


_NAMES = {"dim0": "quantize_dim0", "dim1": "quantize_dim1", "dim0_dim1": "quantize_dim0_dim1",
          "dequant": "dequantize"}


def _run(kernel: str, cast: str, compiling: bool, *args, **kwargs):
    """Call the backend while tracing (cuda_cast's own function: no cached lookup for dynamo) or
    under the profiler (inside a range named like the custom op, "mxmoe::quantize_dim0", ..., so
    that profiles show the casts whichever path ran them)."""
    if compiling:
        fn = getattr(cuda_cast, _NAMES[cast]) if kernel == "cuda" else cast_fn(kernel, cast)
        return fn(*args, **kwargs)
    with torch.profiler.record_function("mxmoe::" + _NAMES[cast]):
        return cast_fn(kernel, cast)(*args, **kwargs)


# Each function asks torch.compiler.is_compiling() once, and a plain eager call goes straight to the
# backend function (looked up once, `cast_fn`): eager calls pay for as few Python calls as possible,
# a tenth of a µs or more each.


def quantize_dim0(x: Tensor, spec: CastSpec, kernel: str, *, out=None) -> tuple[Tensor, Tensor]:
    """x (..., C) -> qdata x's shape elem dtype, scale (..., C // bs); blocks along C. out (x 2D
    only): a (q, s) pair checked by checks.check_dim0_out (eager only)."""
    compiling = torch.compiler.is_compiling()
    if compiling and out is None and _custom(kernel):
        return custom_ops.quantize_dim0(x, _format_name(spec), kernel)
    if x.numel() == 0:
        if out is None:
            return custom_ops.fake_dim0(x, spec.block_size, spec.elem.dtype)
        return out[0].view(spec.elem.dtype), out[1].view(SCALE_DTYPE)
    if compiling or torch.autograd._profiler_enabled():
        return _run(kernel, "dim0", compiling, x, spec, out=out)
    return cast_fn(kernel, "dim0")(x, spec, out=out)


def quantize_dim1(x: Tensor, spec: CastSpec, kernel: str) -> tuple[Tensor, Tensor]:
    """x (..., R, C), ndim >= 2 -> qdata (..., C, R), scale (..., C, R // bs); blocks along R,
    stored transposed (each matrix x[..., :, :] on its own)."""
    compiling = torch.compiler.is_compiling()
    if compiling and _custom(kernel):
        return custom_ops.quantize_dim1(x, _format_name(spec), kernel)
    if x.numel() == 0:
        return custom_ops.fake_dim1(x, spec.block_size, spec.elem.dtype)
    if compiling or torch.autograd._profiler_enabled():
        return _run(kernel, "dim1", compiling, x, spec)
    return cast_fn(kernel, "dim1")(x, spec)


def quantize_dim0_dim1(x: Tensor, spec: CastSpec, kernel: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """x (R, C) read once -> q0 (R, C), s0 (R, C // bs), q1 (C, R), s1 (C, R // bs)."""
    compiling = torch.compiler.is_compiling()
    if compiling and _custom(kernel):
        return custom_ops.quantize_dim0_dim1(x, _format_name(spec), kernel)
    if x.numel() == 0:
        return custom_ops.fake_dim0_dim1(x, spec.block_size, spec.elem.dtype)
    if compiling or torch.autograd._profiler_enabled():
        return _run(kernel, "dim0_dim1", compiling, x, spec)
    return cast_fn(kernel, "dim0_dim1")(x, spec)


def dequantize(q: Tensor, s: Tensor, block_size: int, out_dtype: torch.dtype, kernel: str) -> Tensor:
    """q (R, C) elem dtype, s (R, C // bs) e8m0 -> (R, C) out_dtype."""
    compiling = torch.compiler.is_compiling()
    if compiling and _custom(kernel):
        return custom_ops.dequantize(q, s, block_size, out_dtype, kernel)
    if q.numel() == 0:
        return torch.empty(q.shape, dtype=out_dtype, device=q.device)
    if compiling or torch.autograd._profiler_enabled():
        return _run(kernel, "dequant", compiling, q, s, block_size, out_dtype)
    return cast_fn(kernel, "dequant")(q, s, block_size, out_dtype)
