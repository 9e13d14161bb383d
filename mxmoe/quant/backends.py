"""The cast backends ("torch", "triton", "cuda"), where each can run, and the one place a kernel is
chosen: `cast_kernel(recipe, device, cast)`, which every consumer calls (the casts, the
quantize-dequantize calls, the MX ops' `op_kernels`, the MXFP8 exchange, the torchtitan dispatcher)
with the recipe whose `dim0_kernel` / `dim1_kernel` name the choice.

Choosing. Each backend declares, in its own module (`torch_cast`, `triton_cast`, `cuda_cast`),
`why_unavailable(device, cast)` (None where it can run a cast on tensors of a device, else why),
`auto_rank(device, cast)` (its rank for "auto", lowest first; None: "auto" never takes it there)
and optionally `ready(device, cast)` (a costlier check: the CUDA extension builds) and `STAND_INS`
(casts it has no kernel for -> the backend that runs them instead). `CAST_BACKENDS`, a
`mxmoe.registry.Registry`, registers the three here, in one place; "auto" is a lookup in it, and
adding a backend is its module and one `register` call. Every answer is resolved once per (kernel,
device, cast) and kept: eager calls resolve and keep it; a call torch.compile traces reads the kept
answer, or where there is none yet takes it from `_resolve_at_trace`, which Dynamo runs as Python at
trace time and records as a constant (`torch.compiler.assume_constant_result`): nothing of the
resolution is traced.

Backend protocol. A backend is a module with these functions (the same arguments in the same
order in every backend; `mxmoe.quant.torch_cast` is the reference):

    quantize_dim0(x, spec, *, out=None) -> (q, s)       x (..., C), blocks along C (out: x 2D)
    quantize_dim1(x, spec) -> (q, s)                    x (..., R, C), ndim >= 2, blocks along R,
                                                        stored (..., C, R)
    quantize_dim0_dim1(x, spec) -> (q0, s0, q1, s1)     x (R, C), both of the above from one read
    dequantize(q, s, block_size, out_dtype, *, out=None) -> y

Backends trust their arguments: x is a non-empty contiguous bf16/fp32 tensor whose blocked dims are
divisible by spec.block_size, `out` was checked by `mxmoe.quant.checks` (the public API checks
everything once per call). Scales are `SCALE_DTYPE` (E8M0); every output is contiguous.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Callable
from types import ModuleType

import torch

from mxmoe.recipe import CAST_KERNELS, MXRecipe
from mxmoe.registry import RESOLVED, Backend, Registry

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
_FUNCTIONS = {"dim0": "quantize_dim0", "dim1": "quantize_dim1", "dim0_dim1": "quantize_dim0_dim1",
              "dequant": "dequantize"}
QDQ_MAX_BLOCK_TRITON = 128
"""Largest block size of the Triton qdq rows kernel (it holds whole blocks both ways in a tile)."""


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


# ----------------------------------------------------------------------------------------------
# The registry: each backend's declarations, read from its module on first use
# ----------------------------------------------------------------------------------------------


def _declared(module: str, name: str, needs: str | None = None, missing=None) -> Callable:
    """(device, cast) -> the answer of declaration `name` of backend module `module`, the module
    imported on first call and the function looked up at each call (tests replace it). needs: a
    package the module imports; where it is missing or does not import, the answer is `missing`."""

    def call(device: torch.device, cast: str):
        if needs is not None:
            if importlib.util.find_spec(needs) is None:
                return missing
            try:
                mod = importlib.import_module(module)
            except ImportError:  # the package is there but does not import: as if it were not
                return missing
        else:
            mod = importlib.import_module(module)
        return getattr(mod, name)(device, cast)

    call.__qualname__ = f"{module}.{name}"
    return call


def _backend(name: str, module: str, needs: str | None = None, ready: bool = False) -> Backend:
    """Cast kernel `name`, implemented and declared in `module` (its why_unavailable, auto_rank and,
    with `ready`, ready). needs: the package the module imports (without it: unavailable, and never
    taken by "auto")."""
    missing = f"kernel={name!r} needs the {needs} package, which is not installed" if needs else None
    return Backend(
        name=name,
        module=module,
        why_unavailable=_declared(module, "why_unavailable", needs, missing),
        auto_rank=_declared(module, "auto_rank", needs, None),
        ready=_declared(module, "ready") if ready else None,
    )


CAST_BACKENDS = Registry("cast kernel")
"""The cast kernels by name: context (device, cast), cast one of CASTS or QDQ_CASTS."""
CAST_BACKENDS.register(_backend("torch", "mxmoe.quant.torch_cast"))
CAST_BACKENDS.register(_backend("triton", "mxmoe.quant.triton_cast", needs="triton"))
CAST_BACKENDS.register(_backend("cuda", "mxmoe.quant.cuda_cast", ready=True))  # ready: its extension builds
assert CAST_BACKENDS.names() == CAST_KERNELS


def why_unavailable(kernel: str, device: torch.device, cast: str = "dim0") -> str | None:
    """None if cast kernel `kernel` can run `cast` on tensors on `device` here, else the reason
    (ValueError naming an unknown kernel)."""
    return CAST_BACKENDS.why_unavailable(kernel, device, cast)


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def available_kernels(device: torch.device | str | None = None) -> list[str]:
    """Cast kernels that can run on tensors of `device` (default: the GPU if any, else CPU)."""
    device = default_device() if device is None else torch.device(device)
    return CAST_BACKENDS.available(device, "dim0")


# (kernel, device, cast) -> concrete kernel (keyed by the torch.device itself: `device.type` costs
# 0.2 µs, hashing the device 0.03): `auto` and the availability checks run once per
# combination (an unavailable kernel raises, so only answers that can run are kept; TRITON_INTERPRET
# is read when a combination is first resolved, as Triton itself reads it once). Answers derived
# from these (the MX ops' `op_kernels`) are kept here too, through `remember`.
_resolved: dict[tuple, object] = RESOLVED  # the one cache (mxmoe.registry); tests may swap it


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
    """Forget the resolved kernel choices (`cast_kernel`, `resolve_kernel`, the registry's), and the
    ops' choices resolved from them (after the environment changed, e.g. in tests)."""
    _resolved.clear()
    CAST_BACKENDS.clear()


def _device(device_type: str, index: int | None) -> torch.device:
    return torch.device(device_type) if index is None else torch.device(device_type, index)


@torch.compiler.assume_constant_result
def _resolve_at_trace(kernel: str, device_type: str, index: int | None, cast: str, field: str | None) -> str:
    """`_resolve` while torch.compile traces: Dynamo runs this at trace time and keeps its answer as
    a constant of the graph (its arguments are constants: the device as its type and index)."""
    return _resolve(kernel, _device(device_type, index), cast, field)


def _resolve(kernel: str, device: torch.device, cast: str, field: str | None) -> str:
    """The concrete kernel for `kernel` ("auto" or a name) running `cast` on `device` (field: the
    recipe field that named it, for errors; None: a building block's kernel argument). Kept per
    (kernel, device, cast)."""
    key = (kernel, device, cast)
    hit = _resolved.get(key)
    if hit is not None:
        return hit
    if not isinstance(kernel, str):
        raise TypeError(f"kernel must be a str, got {type(kernel).__name__}")
    if not isinstance(device, torch.device):  # (a str failed inside a backend's availability check)
        raise TypeError(
            f"device={device!r} ({type(device).__name__}): expected a torch.device, e.g. "
            f"torch.device({device!r})"
        )
    if cast not in RECIPE_FIELD:
        raise ValueError(f"cast={cast!r}; expected one of {list(CASTS) + list(QDQ_CASTS)}")
    option = f"recipe {field}" if field else "kernel"
    if kernel != "auto":
        CAST_BACKENDS.get(kernel, option)  # ValueError naming an unknown kernel
    out = CAST_BACKENDS.resolve(kernel, device, cast, option=option)
    module = CAST_BACKENDS.load(out)
    out = getattr(module, "STAND_INS", {}).get(cast, out)  # a cast it has no kernel for
    if out == "cuda" and cast in QDQ_CASTS and not torch.compiler.is_compiling():
        module.load_extension()  # the qdq dispatch takes the operator as loaded; raises if it cannot build
    if not torch.compiler.is_compiling():  # a traced answer may rest on a build not yet tried
        _resolved[key] = out
    return out


def resolve_kernel(kernel: str, device: torch.device, cast: str = "dim1") -> str:
    """`cast_kernel`'s step on a kernel name: map "auto" to the fastest available backend for `cast`
    (one of CASTS or QDQ_CASTS; the default, dim1, suits code that runs several casts with one
    kernel) and check that `kernel` can run on `device`. For the building blocks below the recipe
    (the exchange's kernels, mxmoe.comm.kernels / symm) that are handed a name `cast_kernel` chose.
    Cached: repeated calls cost a dict lookup."""
    # While tracing, the kept answers are not read: Dynamo would guard on the dict, which the
    # trace-time resolution may fill (torch 2.11: "Guard failed on the same frame it was created").
    # Removable once mxmoe's oldest torch no longer fails that guard (tests/quant/test_cast_compile.py).
    if torch.compiler.is_compiling():
        return _resolve_at_trace(kernel, device.type, device.index, cast, None)
    hit = _resolved.get((kernel, device, cast))
    if hit is not None:
        return hit
    return _resolve(kernel, device, cast, None)


# ----------------------------------------------------------------------------------------------
# The one kernel choice, fed by the recipe: the casts' and the quantize-dequantize calls'
# ----------------------------------------------------------------------------------------------


def cast_kernel(recipe: MXRecipe, device: torch.device, cast: str) -> str:
    """The concrete kernel ("torch" | "triton" | "cuda") that runs `cast` for `recipe` on tensors of
    `device`: the one kernel choice of mxmoe. The recipe field RECIPE_FIELD[cast] names it ("auto"
    or a kernel).

    cast, one of CASTS: an MX cast or dequantize; one of QDQ_CASTS: a quantize-dequantize call.
    "auto" is the available backend of lowest `auto_rank` (`CAST_BACKENDS`): on CUDA the C++
    operators where the extension builds, else Triton, else torch; off CUDA torch (the Triton
    interpreter only when named). A named kernel that cannot run on `device` raises (RuntimeError
    naming the recipe field and why). A backend's STAND_INS replace it for casts it has no kernel
    for ("qdq_dim0_offs": no C++ operator; Triton's). The Triton qdq kernel takes block sizes up to
    QDQ_MAX_BLOCK_TRITON (ValueError beyond). A dict lookup after the first call per (kernel,
    device, cast); while torch.compile traces, the first answer is made at trace time, a constant
    of the graph."""
    kernel = recipe.dim1_kernel if cast in _DIM1_CASTS else recipe.dim0_kernel
    # while tracing, not the kept answers: see resolve_kernel
    out = None if torch.compiler.is_compiling() else _resolved.get((kernel, device, cast))
    if out is None:
        field = RECIPE_FIELD.get(cast)
        if field is None:
            raise ValueError(f"cast={cast!r}; expected one of {list(CASTS) + list(QDQ_CASTS)}")
        if torch.compiler.is_compiling():
            out = _resolve_at_trace(kernel, device.type, device.index, cast, field)
        else:
            out = _resolve(kernel, device, cast, field)
    if out == "triton" and cast in QDQ_CASTS and recipe.block_size > QDQ_MAX_BLOCK_TRITON:
        raise ValueError(
            f"block_size={recipe.block_size}: the Triton qdq kernel supports block sizes up to "
            f"{QDQ_MAX_BLOCK_TRITON} (the recipe's {RECIPE_FIELD[cast]}={kernel!r} takes it on {device.type})"
        )
    return out


_LOADED: dict[tuple[str, str], Callable] = {}
"""(kernel, cast) -> the backend's function, looked up once (a dict, not functools.cache: what a
traced call reads)."""


def backend(kernel: str) -> ModuleType:
    """The module implementing a concrete kernel name (imported on first use)."""
    return CAST_BACKENDS.load(kernel)


def cast_fn(kernel: str, cast: str) -> Callable:
    """Backend `kernel`'s function for `cast` (one of CASTS), looked up once."""
    fn = _LOADED.get((kernel, cast))
    if fn is None:
        fn = _LOADED[(kernel, cast)] = getattr(backend(kernel), _FUNCTIONS[cast])
    return fn
