"""One way to pick a cast kernel: the backends, their availability, and `auto`.

A backend is a module exposing `quantize_dim0`, `quantize_dim1`, `quantize_dim0_dim1` and
`dequantize` with the signatures of `mxmoe.quant.torch_cast`.
"""

from __future__ import annotations

import functools
import importlib
import os
import shutil
from types import ModuleType

import torch

KERNELS = ("torch", "triton", "cuda")
CASTS = ("dim0", "dim1", "dim0_dim1", "dequant")
# Preference of `kernel="auto"` on a CUDA device, fastest first, per cast (H200 table in
# docs/benchmarks.md: Triton's dim0 cast reaches 101-104 % of copy bandwidth, CUDA's 90 %; CUDA leads
# the dim1 (92 % vs 78-84 %), fused (69-72 % vs 53-70 %) and dequantize casts).
AUTO_ORDER_CUDA: dict[str, tuple[str, ...]] = {
    "dim0": ("triton", "cuda", "torch"),
    "dim1": ("cuda", "triton", "torch"),
    "dim0_dim1": ("cuda", "triton", "torch"),
    "dequant": ("cuda", "triton", "torch"),
}

_MODULES = {
    "torch": "mxmoe.quant.torch_cast",
    "triton": "mxmoe.quant.triton_cast",
    "cuda": "mxmoe.quant.cuda_cast",
}


def triton_interpret() -> bool:
    """True when Triton runs its kernels on CPU tensors through its interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _has_cuda_toolkit() -> bool:
    from torch.utils.cpp_extension import CUDA_HOME

    return CUDA_HOME is not None or shutil.which("nvcc") is not None


def why_unavailable(kernel: str, device: torch.device) -> str | None:
    """None if `kernel` can run on tensors on `device` here, else the reason."""
    if kernel not in KERNELS:
        return f"unknown kernel {kernel!r}; expected one of {list(KERNELS) + ['auto']}"
    if kernel == "torch":
        return None
    if kernel == "triton":
        if not _has_triton():
            return "kernel='triton' needs the triton package, which is not installed"
        if device.type == "cuda":
            return None
        if device.type == "cpu" and triton_interpret():
            return None
        return (
            f"kernel='triton' needs a CUDA tensor (got a {device.type} tensor), or TRITON_INTERPRET=1 "
            "to run the kernels on CPU through the Triton interpreter"
        )
    # cuda
    if device.type != "cuda":
        return f"kernel='cuda' needs a CUDA tensor (got a {device.type} tensor)"
    if not torch.cuda.is_available():
        return "kernel='cuda' needs a CUDA GPU and torch built with CUDA"
    if not _has_cuda_toolkit():
        return "kernel='cuda' builds its extension on first use and needs nvcc (set CUDA_HOME)"
    return None


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def available_kernels(device: torch.device | str | None = None) -> list[str]:
    """Cast kernels that can run on tensors of `device` (default: the GPU if any, else CPU)."""
    device = default_device() if device is None else torch.device(device)
    return [k for k in KERNELS if why_unavailable(k, device) is None]


def _cuda_extension_ready() -> bool:
    """For `auto`: build (first use) or load the CUDA extension; False, so that `auto` falls back to
    the next backend, if that fails. While torch.compile traces, only the recorded outcome is read."""
    from mxmoe.quant import cuda_cast

    if torch.compiler.is_compiling():
        return cuda_cast.build_failed() is False
    try:
        cuda_cast.load_extension()
    except RuntimeError:
        return False
    return True


def resolve_kernel(kernel: str, device: torch.device, cast: str = "dim1") -> str:
    """Map `auto` to the fastest available backend for `cast` (one of CASTS; the default, dim1's
    order, suits code that runs several casts with one kernel) and check that `kernel` can run on
    `device`."""
    if not isinstance(kernel, str):
        raise TypeError(f"kernel must be a str, got {type(kernel).__name__}")
    if cast not in AUTO_ORDER_CUDA:
        raise ValueError(f"cast={cast!r}; expected one of {list(CASTS)}")
    if kernel == "auto":
        if device.type != "cuda":
            return "torch"
        for k in AUTO_ORDER_CUDA[cast]:
            if why_unavailable(k, device) is None and (k != "cuda" or _cuda_extension_ready()):
                return k
        return "torch"
    reason = why_unavailable(kernel, device)
    if reason is not None:
        raise ValueError(reason) if kernel not in KERNELS else RuntimeError(reason)
    return kernel


def backend(kernel: str) -> ModuleType:
    """The module implementing a concrete kernel name (imports it on first use)."""
    return importlib.import_module(_MODULES[kernel])


def dim0_outputs(
    x: torch.Tensor, spec, out: tuple[torch.Tensor, torch.Tensor] | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The (qdata, scale) a dim0 cast of x (R, C) writes: new tensors, or `out` checked and viewed.

    out: (q, s) preallocated, contiguous, on x's device: q (R, C) of spec.elem.dtype or uint8,
    s (R, C // block_size) float8_e8m0fnu or uint8 (e.g. slices of a communication buffer).
    Returns q as spec.elem.dtype and s as float8_e8m0fnu (views of `out` when given)."""
    R, C = x.shape
    shapes = ((R, C), (R, C // spec.block_size))
    if out is None:
        return (
            torch.empty(shapes[0], dtype=spec.elem.dtype, device=x.device),
            torch.empty(shapes[1], dtype=torch.float8_e8m0fnu, device=x.device),
        )
    if not (isinstance(out, tuple | list) and len(out) == 2):
        raise TypeError("out must be a pair (q, s) of tensors")
    views = []
    dtypes = (spec.elem.dtype, torch.float8_e8m0fnu)
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
