"""The cast backends ("torch", "triton", "cuda"), where each can run, and the one place a kernel is
chosen: `cast_kernel(recipe, device, cast)`, which every consumer calls (the casts, the
quantize-dequantize calls, the MX ops' kernel choices (`mxmoe.ops.gemm_backend.op_kernels`), the MXFP8 exchange, the torchtitan dispatcher) with
the recipe whose `dim0_kernel` / `dim1_kernel` name the choice. Answers derived from it (the MX ops'
`op_kernels`) are kept beside its own through `remember`.

Backend protocol. A backend is a module with these functions (the same arguments in the same
order in every backend; `mxmoe.quant.torch_cast` is the reference):

    quantize_dim0(x, spec, *, out=None) -> (q, s)       x (..., C), blocks along C (out: x 2D)
    quantize_dim1(x, spec) -> (q, s)                    x (..., R, C), ndim >= 2, blocks along R,
                                                        stored (..., C, R)
    quantize_dim0_dim1(x, spec) -> (q0, s0, q1, s1)     x (R, C), both of the above from one read
    dequantize(q, s, block_size, out_dtype, *, out=None) -> y

Backends trust their arguments: x is a non-empty contiguous bf16/fp32 tensor whose blocked dims are
divisible by spec.block_size, `out` was checked by `mxmoe.quant.checks` (the public API checks
everything once per call). Scales are float8_e8m0fnu; every output is contiguous.
"""

from __future__ import annotations

import functools
import importlib
import os
import shutil
from collections.abc import Callable
from types import ModuleType

import torch

from mxmoe.recipe import CAST_KERNELS, MXRecipe

KERNELS = CAST_KERNELS  # the one tuple of cast kernel names (mxmoe.recipe)
CASTS = ("dim0", "dim1", "dim0_dim1", "dequant")
"""The MX casts (to_mx along the last dim, along dim -2, both at once; dequantize)."""
QDQ_CASTS = ("qdq_dim0", "qdq_dim0_offs", "qdq_dim1")
"""The quantize-dequantize calls (mxmoe.quant.qdq): dim0 without groups, dim0 alone with groups
(offs; no C++ operator covers it), and dim1 / dim0+dim1 / the SwiGLU-fused ones with or without."""
RECIPE_FIELD = {
    "dim0": "dim0_kernel", "dequant": "dim0_kernel",
    "qdq_dim0": "dim0_kernel", "qdq_dim0_offs": "dim0_kernel",
    "dim1": "dim1_kernel", "dim0_dim1": "dim1_kernel", "qdq_dim1": "dim1_kernel",
}
"""The recipe field that names each cast's kernel (MXRecipe.dim0_kernel / dim1_kernel)."""
_DIM1_CASTS = frozenset(c for c, f in RECIPE_FIELD.items() if f == "dim1_kernel")
# Preference of "auto" on a CUDA device, fastest first, per cast (docs/benchmarks.md).
# CUDA everywhere: it leads the dim1, fused and dequantize kernels, and its C++ operators cost a
# fraction of Triton's launch path in host time per call; Triton's dim0 kernel is faster on the GPU,
# which only pays for tensors far above a typical activation.
AUTO_ORDER_CUDA: dict[str, tuple[str, ...]] = {
    "dim0": ("cuda", "triton", "torch"),
    "dim1": ("cuda", "triton", "torch"),
    "dim0_dim1": ("cuda", "triton", "torch"),
    "dequant": ("cuda", "triton", "torch"),
}
_FUNCTIONS = {"dim0": "quantize_dim0", "dim1": "quantize_dim1", "dim0_dim1": "quantize_dim0_dim1",
              "dequant": "dequantize"}


def triton_interpret() -> bool:
    """True when Triton runs its kernels on CPU tensors through its interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) of ints, for launch grids computed on the host. (triton 3.6's `triton.cdiv` and
    `triton.next_power_of_2` are constexpr functions: a few µs of Python per host call each.)"""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n, for n >= 1 (`triton.next_power_of_2`'s value there)."""
    return 1 << (n - 1).bit_length()


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


# (kernel, device, cast) -> concrete kernel (keyed by the torch.device itself: `device.type` costs
# 0.2 µs, hashing the device 0.03): `auto` and the availability checks run once per
# combination (an unavailable kernel raises, so only answers that can run are kept; TRITON_INTERPRET
# is read when a combination is first resolved, as Triton itself reads it once). Answers derived
# from these (the MX ops' `op_kernels`) are kept here too, through `remember`.
_resolved: dict[tuple, object] = {}


_MISSING = object()


def remember(key: tuple, make: Callable[[], object]) -> object:
    """`make()` (any value, None included), kept under `key` (a tuple whose first item names its
    kind, e.g. "op_kernels") beside the kernel choices it derives from, so that `clear_resolved`
    forgets both. Not kept while torch.compile traces (the answer may rest on a build not yet
    tried)."""
    cache = _resolved  # looked up per call: tests swap the dict
    hit = cache.get(key, _MISSING)
    if hit is not _MISSING:
        return hit
    out = make()
    if not torch.compiler.is_compiling():
        cache[key] = out
    return out


def clear_resolved() -> None:
    """Forget the cached kernel choices (`cast_kernel`, `resolve_kernel`), and the ops' kernel choices resolved
    from them (after the environment changed, e.g. in tests)."""
    _resolved.clear()


def resolve_kernel(kernel: str, device: torch.device, cast: str = "dim1") -> str:
    """`cast_kernel`'s step on a kernel name: map "auto" to the fastest available backend for `cast`
    (one of CASTS; the default, dim1's order, suits code that runs several casts with one kernel)
    and check that `kernel` can run on `device`. For the building blocks below the recipe (the
    exchange's kernels, mxmoe.comm.kernels / symm) that are handed a name `cast_kernel` chose.
    Cached: repeated calls cost a dict lookup."""
    key = (kernel, device, cast)
    hit = _resolved.get(key)
    if hit is not None:
        return hit
    if not isinstance(kernel, str):
        raise TypeError(f"kernel must be a str, got {type(kernel).__name__}")
    if cast not in AUTO_ORDER_CUDA:
        raise ValueError(f"cast={cast!r}; expected one of {list(CASTS)}")
    if kernel == "auto":
        out = "torch"
        if device.type == "cuda":
            for k in AUTO_ORDER_CUDA[cast]:
                if why_unavailable(k, device) is None and (k != "cuda" or _cuda_extension_ready()):
                    out = k
                    break
    else:
        reason = why_unavailable(kernel, device)
        if reason is not None:
            raise ValueError(reason) if kernel not in KERNELS else RuntimeError(reason)
        out = kernel
    if not torch.compiler.is_compiling():  # a traced answer may rest on a build not yet tried
        _resolved[key] = out
    return out


# ----------------------------------------------------------------------------------------------
# The one kernel choice, fed by the recipe: the casts' and the quantize-dequantize calls'
# ----------------------------------------------------------------------------------------------

QDQ_MAX_BLOCK_TRITON = 128
"""Largest block size of the Triton qdq rows kernel (it holds whole blocks both ways in a tile)."""


def cast_kernel(recipe: MXRecipe, device: torch.device, cast: str) -> str:
    """The concrete kernel ("torch" | "triton" | "cuda") that runs `cast` for `recipe` on tensors of
    `device`: the one kernel choice of mxmoe. The recipe field RECIPE_FIELD[cast] names it ("auto"
    or a kernel).

    cast, one of CASTS: an MX cast or dequantize. "auto" is "torch" off CUDA and on CUDA the first
    available kernel of AUTO_ORDER_CUDA[cast] (the CUDA extension where it builds); a named kernel
    that cannot run on `device` raises (RuntimeError naming the field and why). A dict lookup after
    the first call per (kernel, device, cast).
    cast, one of QDQ_CASTS: a quantize-dequantize call. "torch" for "torch" and for "auto" off CUDA;
    on CUDA "cuda" for "cuda" and "auto" where a C++ operator covers the call (all but
    "qdq_dim0_offs"; "auto" falls back to "triton" if the extension does not build, as the casts'
    "auto"), else "triton"; on CPU "triton" only for an explicit "triton" under TRITON_INTERPRET=1.
    The Triton qdq kernel takes block sizes up to QDQ_MAX_BLOCK_TRITON (ValueError beyond)."""
    # the casts' answers are cached (the qdq calls' are not: the ops keep them in their op_kernels)
    kernel = recipe.dim1_kernel if cast in _DIM1_CASTS else recipe.dim0_kernel
    hit = _resolved.get((kernel, device, cast))
    if hit is not None:
        return hit
    field = RECIPE_FIELD.get(cast)
    if field is None:
        raise ValueError(f"cast={cast!r}; expected one of {list(CASTS) + list(QDQ_CASTS)}")
    if cast in QDQ_CASTS:
        out = _qdq_kernel(kernel, device, cast != "qdq_dim0_offs", field)
        if out == "triton" and recipe.block_size > QDQ_MAX_BLOCK_TRITON:
            raise ValueError(
                f"block_size={recipe.block_size}: the Triton qdq kernel supports block sizes up to "
                f"{QDQ_MAX_BLOCK_TRITON} (the recipe's {field}={kernel!r} takes it on {device.type})"
            )
        return out
    try:
        return resolve_kernel(kernel, device, cast)
    except RuntimeError as e:  # name the recipe field that asked for it
        raise RuntimeError(f"recipe {field}={kernel!r}: {e}") from None


def _qdq_kernel(kernel: str, device: torch.device, cuda_op: bool, field: str) -> str:
    """`cast_kernel` of a qdq call (cuda_op: a C++ operator covers it)."""
    if kernel == "torch" or (kernel == "auto" and device.type != "cuda"):
        return "torch"
    if cuda_op and kernel in ("cuda", "auto") and device.type == "cuda":
        # resolve_kernel: cached per (kernel, device); "auto" builds / loads the extension once
        try:
            if resolve_kernel(kernel, device, "dim0") != "cuda":
                return "triton"
        except RuntimeError as e:  # name the recipe field that asked for it
            raise RuntimeError(f"recipe {field}={kernel!r}: {e}") from None
        if not torch.compiler.is_compiling():
            from mxmoe.quant import cuda_cast

            cuda_cast.load_extension()  # a flag test once loaded; raises if "cuda" cannot build
        return "cuda"
    if device.type == "cuda" or (kernel == "triton" and device.type == "cpu" and triton_interpret()):
        return "triton"
    raise RuntimeError(
        f"recipe {field}={kernel!r}: the qdq kernel needs a CUDA tensor (got a {device.type} tensor), or "
        "TRITON_INTERPRET=1 for 'triton' on CPU"
    )


_MODULES = {
    "torch": "mxmoe.quant.torch_cast",
    "triton": "mxmoe.quant.triton_cast",
    "cuda": "mxmoe.quant.cuda_cast",
}


@functools.cache
def backend(kernel: str) -> ModuleType:
    """The module implementing a concrete kernel name (imported on first use)."""
    return importlib.import_module(_MODULES[kernel])


@functools.cache
def cast_fn(kernel: str, cast: str) -> Callable:
    """Backend `kernel`'s function for `cast` (one of CASTS), looked up once."""
    return getattr(backend(kernel), _FUNCTIONS[cast])
