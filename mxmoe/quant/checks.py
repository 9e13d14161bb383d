"""The argument checks of the public cast API, and the output allocation every backend shares.

Checks run once per public call (`to_mx`, `to_mx_dim0_dim1`, `MXTensor.dequantize`, the comm
layer's entry points); everything below them (`mxmoe.quant.call_path`, the custom ops, the backends)
trusts its arguments. Errors name the argument, the value received and what is accepted.
"""

from __future__ import annotations

import functools

import torch

from mxmoe.formats import (
    ELEM_FORMATS,
    INPUT_DTYPES,
    SCALE_DTYPE,
    CastSpec,
    ScalingMode,
    check_block_size,
    check_elem_dtype,
    check_input_dtype,
    check_scaling_mode,
    format_of,
)


def _new_spec(block_size: int, scaling_mode: str, elem_dtype: torch.dtype) -> CastSpec:
    return CastSpec(block_size, ScalingMode(scaling_mode), ELEM_FORMATS[elem_dtype])


@functools.cache
def _spec(block_size: int, scaling_mode: str, elem_dtype: torch.dtype) -> CastSpec:
    """The format's own CastSpec (`MXFormat.spec`): one object per format, which the kernels'
    caches keyed by a spec find by identity."""
    return format_of(elem_dtype, block_size, ScalingMode(scaling_mode)).spec


def spec_of(block_size: int, scaling_mode: str, elem_dtype: torch.dtype) -> CastSpec:
    """The CastSpec of already-checked arguments (cached: no work per call; while torch.compile
    traces, made afresh: dynamo traces the function, not a cache wrapper)."""
    if torch.compiler.is_compiling():
        return _new_spec(block_size, scaling_mode, elem_dtype)
    return _spec(block_size, scaling_mode, elem_dtype)


@functools.lru_cache(maxsize=None, typed=True)
def _checked_spec(block_size: int, scaling_mode: str | ScalingMode, elem_dtype: torch.dtype) -> CastSpec:
    block_size = check_block_size(block_size)
    mode = check_scaling_mode(scaling_mode).value
    check_elem_dtype(elem_dtype)
    return spec_of(block_size, mode, elem_dtype)


def checked_spec(block_size: int, scaling_mode: str | ScalingMode, elem_dtype: torch.dtype) -> CastSpec:
    """The CastSpec of the public API's format arguments, checked (a bad one raises, naming it).
    Valid combinations are remembered, by value and type (32.0 or True is checked, never taken for
    32 or 1): a repeated call costs one cache lookup instead of the checks. (While torch.compile
    traces, the checks run uncached: dynamo traces them, not the cache wrapper.)"""
    if torch.compiler.is_compiling():
        return _checked_spec.__wrapped__(block_size, scaling_mode, elem_dtype)
    try:
        return _checked_spec(block_size, scaling_mode, elem_dtype)
    except TypeError:  # an unhashable argument (or a wrong elem_dtype): the checks name it
        return _checked_spec.__wrapped__(block_size, scaling_mode, elem_dtype)


def check_no_grad(x: torch.Tensor) -> None:
    """Casts are not differentiable: refuse a tensor autograd would track, before backward fails."""
    if x.requires_grad and torch.is_grad_enabled():
        raise RuntimeError(
            "to_mx got a tensor that requires grad with grad mode on; an MX cast has no gradient. "
            "For training use mxmoe.nn.MXLinear, mxmoe.ops.mx_mm or mxmoe.ops.mx_grouped_mm (they "
            "quantize inside and return high-precision gradients), or cast x.detach() (or under "
            "torch.no_grad()) if no gradient is wanted."
        )


def check_x(x: torch.Tensor, block_size: int, axis: int) -> int:
    """x is a bf16/fp32 tensor whose `axis` (one of the last two dims) is divisible by block_size;
    returns the non-negative axis."""
    # the common case decided without a call: a bf16/fp32 tensor, an int axis among the last two dims
    # whose size is whole blocks, no gradient asked for; anything else takes the checks below, which
    # name what is wrong
    if isinstance(x, torch.Tensor) and x.dtype in INPUT_DTYPES and type(axis) is int and not x.requires_grad:
        nd = x.ndim
        ax = axis + nd if axis < 0 else axis
        if 0 <= ax < nd and ax >= nd - 2 and not x.shape[ax] % block_size:
            return ax
    check_input_dtype("x", x)
    nd = x.ndim
    if nd < 1:
        raise ValueError("x must have at least one dimension")
    if isinstance(axis, bool) or not isinstance(axis, int):
        raise ValueError(f"axis={axis!r} ({type(axis).__name__}): expected an int, one of the last two dims")
    if not -nd <= axis < nd:
        raise ValueError(f"axis={axis!r} is out of range for x of shape {tuple(x.shape)}")
    ax = axis % nd
    if ax < nd - 2:
        raise ValueError(
            f"axis={axis} of a {nd}D tensor is not supported: blocks run along one of the last "
            "two dims (axis=-1 or axis=-2)"
        )
    if x.shape[ax] % block_size:
        raise ValueError(f"x.shape[{axis}]={x.shape[ax]} is not divisible by block_size={block_size}")
    if x.requires_grad:
        check_no_grad(x)
    return ax


def check_dim0_out(x: torch.Tensor, spec: CastSpec, out) -> tuple[torch.Tensor, torch.Tensor]:
    """`out` for a dim0 cast of x (R, C): a pair (q, s), contiguous, on x's device, q (R, C) of
    spec's element dtype or uint8, s (R, C // block_size) e8m0 or uint8 (e.g. slices of a
    communication buffer). Returns them viewed as (element dtype, SCALE_DTYPE)."""
    if x.dtype not in INPUT_DTYPES or x.ndim != 2 or not x.is_contiguous():
        raise ValueError(f"x must be a contiguous 2D bf16/fp32 tensor, got {x.dtype} {tuple(x.shape)}")
    R, C = x.shape
    if C % spec.block_size:
        raise ValueError(f"x.shape[-1]={C} is not divisible by block_size={spec.block_size}")
    if not (isinstance(out, tuple | list) and len(out) == 2):
        raise TypeError("out must be a pair (q, s) of tensors")
    shapes = ((R, C), (R, C // spec.block_size))
    dtypes = (spec.elem.dtype, SCALE_DTYPE)
    views = []
    for name, t, shape, dtype in zip(("out[0]", "out[1]"), out, shapes, dtypes, strict=True):
        if not isinstance(t, torch.Tensor) or t.dtype not in (dtype, torch.uint8):
            raise TypeError(f"{name} must be a {dtype} (or uint8) tensor, got {getattr(t, 'dtype', type(t))}")
        if tuple(t.shape) != shape or not t.is_contiguous() or t.device != x.device:
            raise ValueError(
                f"{name} has shape {tuple(t.shape)} on {t.device} (contiguous: {t.is_contiguous()}); "
                f"expected a contiguous {shape} tensor on {x.device}"
            )
        views.append(t.view(dtype))
    return views[0], views[1]


def dim0_outputs(x: torch.Tensor, spec: CastSpec, out) -> tuple[torch.Tensor, torch.Tensor]:
    """The (q, s) a dim0 cast of x (..., C) writes: `out` (x 2D, already checked by check_dim0_out)
    viewed as (element dtype, SCALE_DTYPE), or new contiguous tensors of x's shape and
    (..., C // block_size)."""
    if out is not None:
        return out[0].view(spec.elem.dtype), out[1].view(SCALE_DTYPE)
    *lead, C = x.shape
    # empty_like and sizes as separate ints: host time a µs below a torch.Size or tuple argument each
    return (
        torch.empty_like(x, dtype=spec.elem.dtype, memory_format=torch.contiguous_format),
        torch.empty(*lead, C // spec.block_size, dtype=SCALE_DTYPE, device=x.device),
    )
