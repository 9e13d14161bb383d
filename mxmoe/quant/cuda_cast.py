"""The `cuda` cast backend: CUDA C++ kernels (csrc/*.cu) registered as torch operators.

Same protocol and bit-for-bit the same results as `mxmoe.quant.torch_cast` (docs/mx-format.md):
inputs are bf16 or fp32 CUDA tensors, quantized along their *last* dim in blocks of
`spec.block_size`; scales come back as `SCALE_DTYPE` (E8M0). Block size 32 with 16-byte aligned
data takes the fast kernels; everything else takes generic kernels (correct, slower).

The extension (csrc/binding.cpp and the kernels' three translation units, csrc/mx_cast.cu, mx_qdq.cu and
mx_swiglu_qdq.cu, which the build compiles at once) is built once per process with
`torch.utils.cpp_extension.load` for the current GPU's architecture (sm_90 on Hopper) and cached
under TORCH_EXTENSIONS_DIR (default ~/.cache/torch_extensions), so later processes reuse the build.
Loading it registers the operators `torch.ops.mxmoe_cuda.*` (argument checks, output allocation,
device guard and stream in C++; see binding.cpp), with fake implementations registered here so that
`torch.compile(fullgraph=True)` traces through them. The functions below call them directly.
Besides the casts the extension holds `zero_rows_after` (the rows after the last expert group of a
grouped GEMM's output set to zero; `mxmoe.ops.tail_rows`), a C++ operator for its lower host cost.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import torch
from torch import Tensor

from mxmoe.formats import ELEM_FORMATS, MODE_IDS, SCALE_DTYPE, CastSpec, ScalingMode, f32_bits

_CSRC = Path(__file__).resolve().parent / "csrc"
# the kernels in three units that the build compiles at once (ninja; nvcc on one CPU core: 17 s for the
# longest, 43 s for the three as one unit)
_SOURCES = tuple(_CSRC / f for f in ("binding.cpp", "mx_cast.cu", "mx_qdq.cu", "mx_swiglu_qdq.cu"))

_lock = threading.Lock()
ops_loaded = False
"""True once torch.ops.mxmoe_cuda exists in this process (then traceable: fakes registered)."""
_build_error: RuntimeError | None = None


# The backend's declarations (`mxmoe.quant.backends.CAST_BACKENDS`)

STAND_INS = {"qdq_dim0_offs": "triton"}
"""Casts no C++ operator covers -> the backend that runs them instead (a dim0 qdq with groups:
Triton's rows kernel)."""
_toolkit: list[bool] = []  # found or not, once


def _has_cuda_toolkit() -> bool:
    if not _toolkit:
        import shutil

        from torch.utils.cpp_extension import CUDA_HOME

        _toolkit.append(CUDA_HOME is not None or shutil.which("nvcc") is not None)
    return _toolkit[0]


def why_unavailable(device: torch.device, cast: str) -> str | None:
    """None on CUDA tensors where torch has CUDA and nvcc builds the extension."""
    if device.type != "cuda":
        return f"kernel='cuda' needs a CUDA tensor (got a {device.type} tensor)"
    if not torch.cuda.is_available():
        return "kernel='cuda' needs a CUDA GPU and torch built with CUDA"
    if not _has_cuda_toolkit():
        return "kernel='cuda' builds its extension on first use and needs nvcc (set CUDA_HOME)"
    return None


def auto_rank(device: torch.device, cast: str) -> int:
    """"auto"'s first choice where it runs: the fastest dim1, fused and dequantize kernels, and C++
    operators whose host cost per call is a fraction of a Triton launch's (docs/benchmarks.md)."""
    return 0


def ready(device: torch.device, cast: str) -> bool:
    """For "auto": the extension builds (first use) or loads; False, so that "auto" takes the next
    backend, if not. While torch.compile traces, only a recorded outcome is read."""
    if torch.compiler.is_compiling():
        return _build_error is None
    try:
        load_extension()
    except RuntimeError:
        return False
    return True


def _check_constants() -> None:
    """The format constants compiled into the kernels equal mxmoe.formats' (one definition)."""
    for dtype, f in ELEM_FORMATS.items():
        spec = CastSpec(32, ScalingMode.RCEIL, f)
        want = [f.emax, f.mbits, f32_bits(f.max_normal), f32_bits(spec.rceil_c)]
        want += [spec.rceil_t127, spec.rceil_t126]
        got = list(torch.ops.mxmoe_cuda.format_constants(dtype))
        if got != want:
            raise RuntimeError(
                f"the constants compiled into csrc/binding.cpp for {dtype} {got} disagree with "
                f"mxmoe.formats {want} (emax, mbits, max bits, RCEIL c bits, T127, T126)"
            )
    kernel_modes = {ScalingMode.FLOOR: 0, ScalingMode.RCEIL: 1, ScalingMode.CEIL: 2, ScalingMode.EVEN: 3}
    if MODE_IDS != kernel_modes:
        raise RuntimeError(f"mxmoe.formats.MODE_IDS {MODE_IDS} disagrees with csrc/mx_cast.h")


def _arch_flag() -> str:
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (8, 9):
        raise RuntimeError(
            f"kernel='cuda' needs a GPU with compute capability >= 8.9 (fp8 conversions); "
            f"this one is sm_{major}{minor}"
        )
    return f"-gencode=arch=compute_{major}{minor},code=sm_{major}{minor}"


def build_failed() -> bool:
    """True once a build attempt in this process has failed (then `load_extension` raises)."""
    return _build_error is not None


def load_extension() -> None:
    """Build (first call in a process) or load the compiled extension, registering
    torch.ops.mxmoe_cuda; RuntimeError if impossible."""
    global ops_loaded, _build_error
    if ops_loaded:
        return
    with _lock:
        if ops_loaded:
            return
        if _build_error is not None:  # do not retry a failed build in this process
            raise _build_error
        if not torch.cuda.is_available():
            raise RuntimeError("kernel='cuda' needs a CUDA GPU and torch built with CUDA")
        arch = _arch_flag()
        from torch.utils import cpp_extension

        name = "mxmoe_cuda_ops_" + arch.rsplit("=", 1)[1]
        logging.getLogger("mxmoe").info("loading CUDA cast extension %s (built on first use, ~20 s)", name)
        try:
            cpp_extension.load(
                name=name,
                sources=[str(p) for p in _SOURCES],
                extra_cflags=["-O3"],
                # No fast-math / -ftz: the kernels rely on IEEE fp32 subnormals.
                extra_cuda_cflags=["-O3", arch, "-lineinfo"],
                is_python_module=False,  # the operators register themselves (TORCH_LIBRARY)
                verbose=False,
            )
            _check_constants()
        except Exception as err:  # compiler missing, compile error, link error, wrong constants
            _build_error = RuntimeError(
                f"kernel='cuda': building the CUDA extension {name} from "
                f"{[str(p) for p in _SOURCES]} with flags {arch} failed: {type(err).__name__}: {err}"
            )
            raise _build_error from err
        _register_fakes()
        ops_loaded = True


def _register_fakes() -> None:
    """Shapes and dtypes of the C++ operators for torch.compile (FakeTensor tracing)."""
    lib = "mxmoe_cuda::"

    def dim0(x, block_size, mode, elem_dtype):
        *lead, C = x.shape
        s = x.new_empty((*lead, C // block_size), dtype=SCALE_DTYPE)
        return x.new_empty(x.shape, dtype=elem_dtype), s

    def dim1(x, block_size, mode, elem_dtype):
        *lead, R, C = x.shape
        return (x.new_empty((*lead, C, R), dtype=elem_dtype),
                x.new_empty((*lead, C, R // block_size), dtype=SCALE_DTYPE))

    def dim0_dim1(x, block_size, mode, elem_dtype):
        return (*dim0(x, block_size, mode, elem_dtype), *dim1(x, block_size, mode, elem_dtype))

    def deq(q, s, block_size, out_dtype):
        return q.new_empty(q.shape, dtype=out_dtype)

    def qdq0(x, block_size, mode, elem_dtype, out_dtype):
        return x.new_empty(x.shape, dtype=out_dtype)

    def qdq1(x, block_size, mode, elem_dtype, out_dtype, offs=None):
        return x.new_empty(x.shape, dtype=out_dtype)

    def qdq01(x, block_size, mode, elem_dtype, out_dtype, offs=None):
        return x.new_empty(x.shape, dtype=out_dtype), x.new_empty(x.shape, dtype=out_dtype)

    def swiglu01(g, u, block_size, mode, elem_dtype, out_dtype, offs=None):
        return g.new_empty(g.shape, dtype=out_dtype), g.new_empty(g.shape, dtype=out_dtype)

    def swiglu_bwd01(dh, g, u, block_size, mode, elem_dtype, out_dtype, offs=None):
        return tuple(dh.new_empty(dh.shape, dtype=out_dtype) for _ in range(4))

    def mutating(*args):
        return None

    for op, fn in (("quantize_dim0", dim0), ("quantize_dim1", dim1), ("quantize_dim0_dim1", dim0_dim1),
                   ("dequantize", deq), ("qdq_dim0", qdq0), ("qdq_dim1", qdq1), ("qdq_dim0_dim1", qdq01),
                   ("swiglu_qdq_dim0_dim1", swiglu01), ("swiglu_bwd_qdq_dim0_dim1", swiglu_bwd01),
                   ("quantize_dim0_out", mutating),
                   ("dequantize_out", mutating), ("qdq_dim0_out", mutating), ("zero_rows_after", mutating)):
        torch.library.register_fake(lib + op, fn)


def quantize_dim0(x: Tensor, spec: CastSpec, *, out=None) -> tuple[Tensor, Tensor]:
    """x: (..., C) bf16/fp32 CUDA, ndim >= 1 -> qdata x's shape elem dtype, scale (..., C // bs)
    e8m0.

    Blocks of bs consecutive elements along C; both outputs contiguous on x's device (or, x 2D,
    written into `out`, a preallocated (q, s) checked by checks.check_dim0_out, e.g. a peer's
    buffer). (The operators are called through their OpOverload `.default`: one Python call less
    than through the overload packet.)"""
    if not ops_loaded:  # (the check inline: a call less per cast)
        load_extension()
    if out is None:
        return torch.ops.mxmoe_cuda.quantize_dim0.default(x, spec.block_size, MODE_IDS[spec.mode],
                                                          spec.elem.dtype)
    q, s = out[0].view(spec.elem.dtype), out[1].view(SCALE_DTYPE)
    torch.ops.mxmoe_cuda.quantize_dim0_out(x, spec.block_size, MODE_IDS[spec.mode], q, s)
    return q, s


def quantize_dim1(x: Tensor, spec: CastSpec) -> tuple[Tensor, Tensor]:
    """x: (..., R, C) bf16/fp32 CUDA, ndim >= 2, blocks along R -> qdata (..., C, R), scale
    (..., C, R // bs) e8m0, contiguous: every matrix x[..., :, :] stored transposed so
    that every block is contiguous."""
    if not ops_loaded:  # (the check inline: a call less per cast)
        load_extension()
    return torch.ops.mxmoe_cuda.quantize_dim1.default(x, spec.block_size, MODE_IDS[spec.mode],
                                                      spec.elem.dtype)


def quantize_dim0_dim1(x: Tensor, spec: CastSpec) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """x: (R, C) bf16/fp32 CUDA, read once -> q0 (R, C), s0 (R, C // bs) along C and
    q1 (C, R), s1 (C, R // bs) along R (stored transposed); all contiguous, scales e8m0."""
    if not ops_loaded:  # (the check inline: a call less per cast)
        load_extension()
    return torch.ops.mxmoe_cuda.quantize_dim0_dim1.default(x, spec.block_size, MODE_IDS[spec.mode],
                                                           spec.elem.dtype)


def dequantize(
    q: Tensor, s: Tensor, block_size: int, out_dtype: torch.dtype, *, out: Tensor | None = None
) -> Tensor:
    """q: (R, C) float8_e4m3fn/e5m2 CUDA, s: (R, C // bs) e8m0 (or uint8) -> (R, C) out_dtype
    (bf16 or fp32), contiguous. Value q * 2^(s-127) exact in fp32, one RNE rounding to out_dtype;
    NaN (scale 0xFF or element NaN) is written as the canonical quiet NaN. out: optional contiguous
    (R, C) out_dtype tensor on q's device to write into (e.g. rows of a larger output)."""
    if not ops_loaded:  # (the check inline: a call less per cast)
        load_extension()
    if out is None:
        return torch.ops.mxmoe_cuda.dequantize.default(q, s, block_size, out_dtype)
    torch.ops.mxmoe_cuda.dequantize_out(q, s, block_size, out)
    return out


def qdq_dim0(
    x: Tensor, spec: CastSpec, out_dtype: torch.dtype, *, out: Tensor | None = None
) -> Tensor:
    """x: (..., C) bf16/fp32 CUDA, contiguous, C % bs == 0 -> x's shape, out_dtype (bf16 or fp32),
    contiguous: the values of `dequantize(*quantize_dim0(x, spec), bs, out_dtype)` bit for bit
    (blocks of bs along C), in one read of x and one write, without the fp8 elements and scales.
    out: optional contiguous tensor of x's shape and out_dtype on x's device to write into."""
    load_extension()
    mode = MODE_IDS[spec.mode]
    if out is None:
        return torch.ops.mxmoe_cuda.qdq_dim0(x, spec.block_size, mode, spec.elem.dtype, out_dtype)
    torch.ops.mxmoe_cuda.qdq_dim0_out(x, spec.block_size, mode, spec.elem.dtype, out)
    return out


def qdq_dim1(x: Tensor, spec: CastSpec, out_dtype: torch.dtype, offs: Tensor | None = None) -> Tensor:
    """x: (..., R, C) bf16/fp32 CUDA, contiguous, ndim >= 2, any R -> x's shape, out_dtype (bf16 or
    fp32), contiguous: blocks of bs rows from the first row of each matrix x[..., :, :], the last
    one short; the values of casting each matrix zero-padded to whole blocks along R
    (`quantize_dim1`), dequantizing and taking x's positions, bit for bit, in one read of x.
    offs: None, or (E,) int32 cumulative group ends on x's device (x 2D): the blocks start at every
    group's first row, rows at or after offs[-1] are zero (`mxmoe.quant.qdq`'s groups)."""
    load_extension()
    return torch.ops.mxmoe_cuda.qdq_dim1(x, spec.block_size, MODE_IDS[spec.mode], spec.elem.dtype, out_dtype,
                                         offs)


def qdq_dim0_dim1(
    x: Tensor, spec: CastSpec, out_dtype: torch.dtype, offs: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """x: (..., R, C) bf16/fp32 CUDA, contiguous, ndim >= 2, C % bs == 0 -> (y0, y1), each of x's
    shape, out_dtype, contiguous: y0 = `qdq_dim0(x)` and y1 = `qdq_dim1(x, offs=offs)` from one read
    of x (block 32 with 16-byte aligned pointers; else the kernels in turn); with offs the rows at
    or after offs[-1] are zero in y0 too."""
    load_extension()
    return torch.ops.mxmoe_cuda.qdq_dim0_dim1(x, spec.block_size, MODE_IDS[spec.mode], spec.elem.dtype,
                                              out_dtype, offs)


def swiglu_qdq_dim0_dim1(
    g: Tensor, u: Tensor, spec: CastSpec, out_dtype: torch.dtype, offs: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """g, u: (..., R, C) bf16/fp32 CUDA, one shape and dtype, contiguous, ndim >= 2, C % bs == 0 ->
    (y0, y1) = `qdq_dim0_dim1(h, spec, out_dtype, offs)` of h = silu(g) * u formed as eager PyTorch's
    `F.silu(g) * u` (csrc/mx_qdq_kernels.cuh's SwiGLU prologue), each of g's shape, out_dtype, contiguous,
    in one read of g and u without writing h (block 32 with 16-byte aligned pointers; else h is
    formed by ATen's silu and mul and cast by the qdq_dim0_dim1 launcher)."""
    load_extension()
    op = torch.ops.mxmoe_cuda.swiglu_qdq_dim0_dim1
    return op(g, u, spec.block_size, MODE_IDS[spec.mode], spec.elem.dtype, out_dtype, offs)


def swiglu_bwd_qdq_dim0_dim1(
    dh: Tensor, g: Tensor, u: Tensor, spec: CastSpec, out_dtype: torch.dtype, offs: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """dh, g, u: (..., R, C) bf16/fp32 CUDA, one shape and dtype, contiguous, ndim >= 2, C % bs == 0 ->
    (dg0, dg1, du0, du1) = `qdq_dim0_dim1(dg, ...)` + `qdq_dim0_dim1(du, ...)` of the SwiGLU backward
    dg = silu_backward(dh * u, g), du = dh * silu(g) formed as eager PyTorch forms them
    (csrc/mx_qdq_kernels.cuh's swiglu_bwd_vec), each of dh's shape, out_dtype, contiguous, in one
    read of dh, g and u without writing dg and du (block 32 with 16-byte aligned pointers; else ATen
    forms dg and du and the qdq_dim0_dim1 launcher casts them)."""
    load_extension()
    op = torch.ops.mxmoe_cuda.swiglu_bwd_qdq_dim0_dim1
    return op(dh, g, u, spec.block_size, MODE_IDS[spec.mode], spec.elem.dtype, out_dtype, offs)


def zero_rows_after(out: Tensor, offs: Tensor) -> Tensor:
    """Rows offs[-1] .. T - 1 of out set to zero in place (the others untouched); returns out.

    out: (T, N) bf16/fp32 CUDA, unit column stride, any row stride (torch._grouped_mm's output,
    its row stride padded). offs: (E,) int32 cumulative group ends on out's device, any stride,
    offs[-1] <= T; offs[-1] is read on the device (no host sync). Checked in C++. (Once per
    grouped forward and dgrad GEMM: the load check inline and the OpOverload `.default`, two Python
    calls less.)"""
    if not ops_loaded:
        load_extension()
    torch.ops.mxmoe_cuda.zero_rows_after.default(out, offs)
    return out
