"""One call path from checked arguments to a cast backend: direct in eager mode, through the
`mxmoe::*` custom ops while torch.compile traces.

Every function here trusts its arguments (the public API in `mxmoe.quant.mx_tensor` checks them
once): `kernel` is concrete ("torch" | "triton" | "cuda", already resolved for the device), `spec`
a `mxmoe.formats.CastSpec`, inputs contiguous bf16/fp32 with the blocked dims divisible by the
block size. Outputs are contiguous; scales float8_e8m0fnu.

Why two paths: a `torch.library.custom_op` call costs tens of microseconds of Python per call in
eager mode, which dominates the cast of a small or medium tensor on a GPU. Eager calls therefore go
straight to the backend function; under torch.compile the custom ops (with their fake
implementations) keep the graph whole. The CUDA backend's operators are C++ operators with fake
implementations, so they are called directly in both modes once the extension is loaded.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mxmoe.formats import CastSpec
from mxmoe.quant import cuda_cast, custom_ops
from mxmoe.quant.backends import cast_fn


def _traced(kernel: str) -> bool:
    """True when this call must go through the custom op: torch.compile is tracing and the backend
    is not the (traceable) C++ operator set."""
    if not torch.compiler.is_compiling():
        return False
    return kernel != "cuda" or not cuda_cast.ops_loaded


def _fn(kernel: str, cast: str):
    """The backend function; while tracing, cuda_cast's own (no cached lookup for dynamo to trace)."""
    if kernel == "cuda" and torch.compiler.is_compiling():
        return getattr(cuda_cast, _NAMES[cast])
    return cast_fn(kernel, cast)


_NAMES = {"dim0": "quantize_dim0", "dim1": "quantize_dim1", "dim0_dim1": "quantize_dim0_dim1",
          "dequant": "dequantize"}


def _run(kernel: str, cast: str, *args, **kwargs):
    """Call the backend; under the profiler, inside a range named like the custom op
    ("mxmoe::quantize_dim0", ...), so that profiles show the casts whichever path ran them."""
    fn = _fn(kernel, cast)
    if not torch.compiler.is_compiling() and torch.autograd._profiler_enabled():
        with torch.profiler.record_function("mxmoe::" + _NAMES[cast]):
            return fn(*args, **kwargs)
    return fn(*args, **kwargs)


def quantize_dim0(x: Tensor, spec: CastSpec, kernel: str, *, out=None) -> tuple[Tensor, Tensor]:
    """x (R, C) -> qdata (R, C) elem dtype, scale (R, C // bs); blocks along C. out: a (q, s) pair
    checked by checks.check_dim0_out (eager only)."""
    if out is None and _traced(kernel):
        return custom_ops.quantize_dim0(x, spec.block_size, spec.mode.value, spec.elem.dtype, kernel)
    if x.numel() == 0:
        if out is None:
            return custom_ops.fake_dim0(x, spec.block_size, spec.elem.dtype)
        return out[0].view(spec.elem.dtype), out[1].view(torch.float8_e8m0fnu)
    return _run(kernel, "dim0", x, spec, out=out)


def quantize_dim1(x: Tensor, spec: CastSpec, kernel: str) -> tuple[Tensor, Tensor]:
    """x (B, R, C) -> qdata (B, C, R), scale (B, C, R // bs); blocks along R, stored transposed."""
    if _traced(kernel):
        return custom_ops.quantize_dim1(x, spec.block_size, spec.mode.value, spec.elem.dtype, kernel)
    if x.numel() == 0:
        return custom_ops.fake_dim1(x, spec.block_size, spec.elem.dtype)
    return _run(kernel, "dim1", x, spec)


def quantize_dim0_dim1(x: Tensor, spec: CastSpec, kernel: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """x (R, C) read once -> q0 (R, C), s0 (R, C // bs), q1 (C, R), s1 (C, R // bs)."""
    if _traced(kernel):
        return custom_ops.quantize_dim0_dim1(x, spec.block_size, spec.mode.value, spec.elem.dtype, kernel)
    if x.numel() == 0:
        return custom_ops.fake_dim0_dim1(x, spec.block_size, spec.elem.dtype)
    return _run(kernel, "dim0_dim1", x, spec)


def dequantize(q: Tensor, s: Tensor, block_size: int, out_dtype: torch.dtype, kernel: str) -> Tensor:
    """q (R, C) elem dtype, s (R, C // bs) e8m0 -> (R, C) out_dtype."""
    if _traced(kernel):
        return custom_ops.dequantize(q, s, block_size, out_dtype, kernel)
    if q.numel() == 0:
        return torch.empty(q.shape, dtype=out_dtype, device=q.device)
    return _run(kernel, "dequant", q, s, block_size, out_dtype)
