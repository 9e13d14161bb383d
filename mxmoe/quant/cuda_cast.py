"""The `cuda` cast backend: CUDA C++ kernels (csrc/mx_cast.cu) compiled on first use.

Same interface and bit-for-bit the same results as `mxmoe.quant.torch_cast` (docs/mx-format.md):
inputs are bf16 or fp32 CUDA tensors, quantized along their *last* dim in blocks of
`spec.block_size`; scales come back as `torch.float8_e8m0fnu`. Block size 32 takes the fast
kernels (16-byte vector accesses, shared-memory transposes); other powers of two take generic
kernels (correct, slower).

The extension (csrc/binding.cpp + csrc/mx_cast.cu) is built once per process with
`torch.utils.cpp_extension.load` for the current GPU's architecture (sm_90 on Hopper) and cached
under TORCH_EXTENSIONS_DIR (default ~/.cache/torch_extensions), so later processes reuse the build.

Kernel variants. Every cast has several bit-identical kernel implementations (csrc/mx_cast.h lists
them); `DEFAULT_VARIANTS` picks one per cast. The environment variable MXMOE_CUDA_CAST_VARIANT
overrides it, either for every cast ("2") or per cast ("dim0=1,dim1=2,dim0_dim1=1,dequant=1"; casts
not named keep their default), read at each call. A `variant=` argument overrides both.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from types import ModuleType

import torch

from mxmoe.formats import ELEM_FORMATS, MODE_IDS, CastSpec, ScalingMode, check_block_size
from mxmoe.quant.kernels import dim0_outputs

_CSRC = Path(__file__).resolve().parent / "csrc"
_SOURCES = (_CSRC / "binding.cpp", _CSRC / "mx_cast.cu")
# Codes of csrc/mx_cast.h.
_ELEM_CODES = {torch.float8_e4m3fn: 0, torch.float8_e5m2: 1}
# The format constants compiled into the kernels (struct Elem in mx_cast.cu): (emax, mbits, max).
_KERNEL_ELEM_CONSTANTS = {torch.float8_e4m3fn: (8, 3, 448.0), torch.float8_e5m2: (15, 2, 57344.0)}

# Number of variants per cast (csrc/mx_cast.h: MX_DIM0_VARIANTS, MX_DIM1_VARIANTS, MX_DEQUANT_VARIANTS).
NUM_VARIANTS = {"dim0": 6, "dim1": 9, "dim0_dim1": 9, "dequant": 7}
# Default variant per cast: edit after a sweep (scripts/gpu/sweep_cuda_cast.sh). "dim1" also covers
# expert weights quantized along axis=-2, "dim0" along axis=-1.
DEFAULT_VARIANTS = {"dim0": 4, "dim1": 6, "dim0_dim1": 6, "dequant": 6}
VARIANT_ENV = "MXMOE_CUDA_CAST_VARIANT"

_lock = threading.Lock()
_ext: ModuleType | None = None
_build_error: RuntimeError | None = None


def _check_constants() -> None:
    for dtype, (emax, mbits, vmax) in _KERNEL_ELEM_CONSTANTS.items():
        f = ELEM_FORMATS[dtype]
        if (f.emax, f.mbits, f.max_normal) != (emax, mbits, vmax):
            raise RuntimeError(
                f"mxmoe.formats.ELEM_FORMATS[{dtype}] = (emax={f.emax}, mbits={f.mbits}, "
                f"max={f.max_normal}) disagrees with the constants compiled into csrc/mx_cast.cu "
                f"{(emax, mbits, vmax)}"
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


def load_extension() -> ModuleType:
    """Build (first call in a process) or load the compiled extension; RuntimeError if impossible."""
    global _ext, _build_error
    if _ext is not None:
        return _ext
    with _lock:
        if _ext is not None:
            return _ext
        if _build_error is not None:  # do not retry a failed build in this process
            raise _build_error
        if not torch.cuda.is_available():
            raise RuntimeError("kernel='cuda' needs a CUDA GPU and torch built with CUDA")
        _check_constants()
        arch = _arch_flag()
        from torch.utils import cpp_extension

        name = "mxmoe_cuda_cast_" + arch.rsplit("=", 1)[1]
        logging.getLogger("mxmoe").info("loading CUDA cast extension %s (built on first use, ~1 min)", name)
        try:
            _ext = cpp_extension.load(
                name=name,
                sources=[str(p) for p in _SOURCES],
                extra_cflags=["-O3"],
                # No fast-math / -ftz: the kernels rely on IEEE fp32 subnormals.
                extra_cuda_cflags=["-O3", arch, "-lineinfo"],
                verbose=False,
            )
        except Exception as err:  # compiler missing, compile error, link error, ...
            _build_error = RuntimeError(
                f"kernel='cuda': building the CUDA extension {name} from "
                f"{[str(p) for p in _SOURCES]} with flags {arch} failed: {type(err).__name__}: {err}"
            )
            raise _build_error from err
        return _ext


def _parse_variant_env(text: str) -> dict[str, int]:
    """MXMOE_CUDA_CAST_VARIANT text -> {cast: variant} (all casts for a bare integer)."""
    text = text.strip()
    if not text:
        return {}
    try:
        if "=" not in text:
            return dict.fromkeys(NUM_VARIANTS, int(text))
        out = {}
        for item in text.split(","):
            if not item.strip():
                continue
            name, value = (part.strip() for part in item.split("=", 1))
            if name not in NUM_VARIANTS:
                raise ValueError(f"unknown cast {name!r}")
            out[name] = int(value)
        return out
    except ValueError as err:
        raise ValueError(
            f"{VARIANT_ENV}={text!r} is not valid ({err}); expected an integer or "
            f"'cast=int,...' with casts from {list(NUM_VARIANTS)}"
        ) from None


def resolve_variant(cast: str, variant: int | None = None) -> int:
    """The kernel variant used for `cast` ('dim0', 'dim1', 'dim0_dim1', 'dequant'): `variant` if
    given, else MXMOE_CUDA_CAST_VARIANT, else DEFAULT_VARIANTS; ValueError if out of range."""
    if cast not in NUM_VARIANTS:
        raise ValueError(f"cast={cast!r}; expected one of {list(NUM_VARIANTS)}")
    if variant is None:
        variant = _parse_variant_env(os.environ.get(VARIANT_ENV, "")).get(cast, DEFAULT_VARIANTS[cast])
    if isinstance(variant, bool) or not isinstance(variant, int):
        raise TypeError(f"variant must be an int, got {type(variant).__name__}")
    if not 0 <= variant < NUM_VARIANTS[cast]:
        raise ValueError(f"variant={variant} for cast {cast!r}; expected 0 .. {NUM_VARIANTS[cast] - 1}")
    return variant


def _check_x(x: torch.Tensor, ndim: int, what: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.device.type != "cuda":
        raise RuntimeError(f"kernel='cuda' needs a CUDA tensor (got a {x.device.type} tensor)")
    if x.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"x has dtype {x.dtype}; expected one of ['torch.bfloat16', 'torch.float32']")
    if x.ndim != ndim:
        raise ValueError(f"{what} wants a {ndim}D x, got shape {tuple(x.shape)}")
    return x.contiguous()


def _check_divisible(name: str, value: int, block_size: int) -> None:
    if value % block_size:
        raise ValueError(f"{name}={value} is not divisible by block_size={block_size}")


def _spec_args(spec: CastSpec, x: torch.Tensor) -> tuple:
    """(block_size, mode, elem, T127, T126, c, stream) as the binding takes them."""
    return (
        spec.block_size,
        MODE_IDS[spec.mode],
        _ELEM_CODES[spec.elem.dtype],
        spec.rceil_t127,
        spec.rceil_t126,
        spec.rceil_c,
        torch.cuda.current_stream(x.device).cuda_stream,
    )


def quantize_dim0(
    x: torch.Tensor, spec: CastSpec, variant: int | None = None, out=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x: (R, C) bf16/fp32 CUDA -> qdata (R, C) elem dtype, scale (R, C // bs) float8_e8m0fnu.

    Blocks of bs consecutive elements along C; both outputs contiguous on x's device (or written
    into `out`, a preallocated (q, s): see kernels.dim0_outputs). `variant`: kernel variant (see
    resolve_variant)."""
    v = resolve_variant("dim0", variant)
    x = _check_x(x, 2, "quantize_dim0")
    R, C = x.shape
    _check_divisible("x.shape[-1]", C, spec.block_size)
    q, s = dim0_outputs(x, spec, out)
    if x.numel():
        ext = load_extension()
        with torch.cuda.device(x.device):
            ext.quantize_dim0(x, q.view(torch.uint8), s.view(torch.uint8), *_spec_args(spec, x), v)
    return q, s


def quantize_dim1(
    x: torch.Tensor, spec: CastSpec, variant: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x: (B, R, C) bf16/fp32 CUDA, blocks along R -> qdata (B, C, R), scale (B, C, R // bs)
    float8_e8m0fnu, contiguous: stored transposed so that every block is contiguous.
    `variant`: kernel variant (see resolve_variant)."""
    v = resolve_variant("dim1", variant)
    x = _check_x(x, 3, "quantize_dim1")
    B, R, C = x.shape
    bs = spec.block_size
    _check_divisible("x.shape[-2]", R, bs)
    q = torch.empty((B, C, R), dtype=spec.elem.dtype, device=x.device)
    s = torch.empty((B, C, R // bs), dtype=torch.uint8, device=x.device)
    if x.numel():
        ext = load_extension()
        with torch.cuda.device(x.device):
            ext.quantize_dim1(x, q.view(torch.uint8), s, *_spec_args(spec, x), v)
    return q, s.view(torch.float8_e8m0fnu)


def quantize_dim0_dim1(
    x: torch.Tensor, spec: CastSpec, variant: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x: (R, C) bf16/fp32 CUDA, read once -> q0 (R, C), s0 (R, C // bs) along C and
    q1 (C, R), s1 (C, R // bs) along R (stored transposed); all contiguous, scales float8_e8m0fnu.
    `variant`: kernel variant (see resolve_variant)."""
    v = resolve_variant("dim0_dim1", variant)
    x = _check_x(x, 2, "quantize_dim0_dim1")
    R, C = x.shape
    bs = spec.block_size
    _check_divisible("x.shape[0]", R, bs)
    _check_divisible("x.shape[1]", C, bs)
    q0 = torch.empty((R, C), dtype=spec.elem.dtype, device=x.device)
    s0 = torch.empty((R, C // bs), dtype=torch.uint8, device=x.device)
    q1 = torch.empty((C, R), dtype=spec.elem.dtype, device=x.device)
    s1 = torch.empty((C, R // bs), dtype=torch.uint8, device=x.device)
    if x.numel():
        ext = load_extension()
        with torch.cuda.device(x.device):
            ext.quantize_dim0_dim1(
                x, q0.view(torch.uint8), s0, q1.view(torch.uint8), s1, *_spec_args(spec, x), v
            )
    return q0, s0.view(torch.float8_e8m0fnu), q1, s1.view(torch.float8_e8m0fnu)


def dequantize(
    q: torch.Tensor,
    s: torch.Tensor,
    block_size: int,
    out_dtype: torch.dtype,
    variant: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: (R, C) float8_e4m3fn/e5m2 CUDA, s: (R, C // bs) float8_e8m0fnu (or uint8) -> (R, C) out_dtype
    (bf16 or fp32), contiguous. Value q * 2^(s-127) exact in fp32, one RNE rounding to out_dtype;
    NaN (scale 0xFF or element NaN) is written as the canonical quiet NaN.
    `variant`: kernel variant (see resolve_variant). out: optional contiguous (R, C) out_dtype tensor
    on q's device to write into (e.g. rows of a larger output)."""
    v = resolve_variant("dequant", variant)
    if not isinstance(q, torch.Tensor) or not isinstance(s, torch.Tensor):
        raise TypeError("q and s must be torch.Tensors")
    if q.device.type != "cuda" or s.device != q.device:
        raise RuntimeError(f"kernel='cuda' needs q and s on one CUDA device (got {q.device} and {s.device})")
    if q.dtype not in _ELEM_CODES:
        raise TypeError(f"q has dtype {q.dtype}; expected one of {[str(d) for d in _ELEM_CODES]}")
    if s.dtype not in (torch.float8_e8m0fnu, torch.uint8):
        raise TypeError(f"s has dtype {s.dtype}; expected torch.float8_e8m0fnu")
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"out_dtype={out_dtype}; expected one of ['torch.bfloat16', 'torch.float32']")
    if q.ndim != 2:
        raise ValueError(f"dequantize wants a 2D q, got shape {tuple(q.shape)}")
    check_block_size(block_size)
    R, C = q.shape
    _check_divisible("q.shape[-1]", C, block_size)
    if tuple(s.shape) != (R, C // block_size):
        raise ValueError(
            f"s has shape {tuple(s.shape)}; expected {(R, C // block_size)} for block_size={block_size}"
        )
    q = q.contiguous()
    s = s.contiguous()
    if out is None:
        out = torch.empty((R, C), dtype=out_dtype, device=q.device)
    elif not out.is_contiguous() or (out.dtype, out.shape, out.device) != (out_dtype, (R, C), q.device):
        raise ValueError(
            f"out is a {out.dtype} tensor of shape {tuple(out.shape)} on {out.device} (contiguous: "
            f"{out.is_contiguous()}); expected a contiguous {out_dtype} ({R}, {C}) tensor on {q.device}"
        )
    if q.numel():
        ext = load_extension()
        with torch.cuda.device(q.device):
            ext.dequantize(
                q.view(torch.uint8),
                s.view(torch.uint8),
                out,
                block_size,
                _ELEM_CODES[q.dtype],
                torch.cuda.current_stream(q.device).cuda_stream,
                v,
            )
    return out
