"""Which GEMM backend an MX op runs, resolved from its recipe: `resolve_gemm_backend` (the recipe's
`gemm_backend`, "auto" made concrete per device: a lookup in `GEMM_BACKENDS`, a
`mxmoe.registry.Registry` as the cast kernels' and the transports'), `native_unavailable` (whether torch's
block-scaled GEMMs run on a device, probed once) and `op_kernels` (everything a call of an MX op
needs of its recipe on a device: the GEMM backend, whether it takes qdq'd operands, the compute
dtype and the qdq kernels, resolved once per (recipe, device type)).

The GEMMs themselves are in `mxmoe.ops.gemm`.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch

from mxmoe.formats import SCALE_DTYPE, MXFormat, get_format
from mxmoe.quant import backends
from mxmoe.recipe import MXRecipe
from mxmoe.registry import Backend, Registry

log = logging.getLogger(__name__)

NATIVE_BLOCK = 32
NATIVE_ELEM = torch.float8_e4m3fn


def _probe_native(device: torch.device) -> None:
    """One tiny dense and one tiny grouped MX GEMM on `device` (raises what torch raises)."""
    e8 = SCALE_DTYPE
    one = torch.full((), 127, dtype=torch.uint8, device=device)  # e8m0 byte 127 = 2^0
    a = torch.zeros(128, 32, dtype=NATIVE_ELEM, device=device)
    s_a = one.expand(128, 4).contiguous().view(e8)  # (128 rows, 1 scale column padded to 4)
    b = torch.zeros(32, 32, dtype=NATIVE_ELEM, device=device).t()  # (K, N) column-major
    s_b = one.expand(128, 4).contiguous().view(e8)
    torch._scaled_mm(a, b, s_a.reshape(-1), s_b.reshape(-1), out_dtype=torch.bfloat16)
    offs = torch.tensor([128], dtype=torch.int32, device=device)
    s_ag = one.expand(256, 4).contiguous().view(e8)  # 128 rows + 128 per group
    b3 = torch.zeros(1, 32, 32, dtype=NATIVE_ELEM, device=device).transpose(-2, -1)
    s_b3 = one.expand(1, 512).contiguous().view(e8)
    torch._scaled_grouped_mm(a, b3, s_ag, s_b3, offs=offs, out_dtype=torch.bfloat16)
    torch.cuda.synchronize(device)


def native_unavailable(device: torch.device) -> str | None:
    """Why gemm_backend="native" cannot run on `device` (None: it can): it needs a CUDA device of
    compute capability 10.x and a torch build whose torch._scaled_mm and torch._scaled_grouped_mm
    take e4m3 operands with E8M0 scales (CUDA >= 12.8, built with the MX grouped GEMM).
    The first answer per device is kept (`mxmoe.quant.backends.clear_resolved` forgets it); on a
    10.x device it runs one tiny MX GEMM of each kind to find out (not while torch.compile traces:
    there an unprobed 10.x device counts as able)."""
    # (remember keeps nothing made while torch.compile traces, where no probe runs)
    return backends.remember(
        ("native_gemm", device.type, device.index),
        lambda: _native_reason(device, probe=not torch.compiler.is_compiling()),
    )


def _native_reason(device: torch.device, probe: bool = True) -> str | None:
    need = "gemm_backend='native' needs a CUDA device of compute capability 10.x (sm_100, Blackwell)"
    if device.type != "cuda" or not torch.cuda.is_available():
        return f"{need}; got a {device.type} device"
    major, minor = torch.cuda.get_device_capability(device)
    if major != 10:
        return f"{need}; {device} has compute capability {major}.{minor}"
    build = f"torch {torch.__version__} (CUDA {torch.version.cuda})"
    if not hasattr(torch, "_scaled_grouped_mm"):  # (mxmoe.formats needs torch's E8M0 dtype)
        return f"gemm_backend='native' needs torch._scaled_grouped_mm with e8m0 scales; {build} has none"
    if not probe:
        return None
    try:
        _probe_native(device)
    except RuntimeError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return (
            f"gemm_backend='native' needs a torch build whose torch._scaled_mm and "
            f"torch._scaled_grouped_mm run MXFP8 (e4m3, {SCALE_DTYPE} scales; CUDA >= 12.8); {build} "
            f"on {device} refused: {first}"
        )
    return None


def _format_refuses(fmt: MXFormat) -> str | None:
    """Why the native GEMMs cannot take operands of format `fmt` (None: they can)."""
    if fmt.elem_dtype != NATIVE_ELEM or fmt.block_size != NATIVE_BLOCK:
        return (
            f"gemm_backend='native' takes e4m3 operands in blocks of {NATIVE_BLOCK} (MXFP8); the recipe "
            f"has elem_dtype={fmt.elem_dtype}, block_size={fmt.block_size}"
        )
    return None


def _native_why(device: torch.device, fmt: str) -> str | None:
    return native_unavailable(device) or _format_refuses(get_format(fmt))


GEMM_BACKENDS = Registry("GEMM backend")
"""The GEMMs on MX operands by name, at a context (device, the operands' registered format name):
"native" (torch's block-scaled GEMMs; "auto" takes it where it runs) and "emulated" (exact
dequantized operands, a high-precision GEMM; everywhere). Answers are kept in the one cache
(`mxmoe.registry.RESOLVED`; `mxmoe.quant.backends.clear_resolved` forgets them)."""
GEMM_BACKENDS.register(
    Backend("native", __name__, why_unavailable=_native_why, auto_rank=lambda device, fmt: 0)
)
GEMM_BACKENDS.register(
    Backend("emulated", __name__, why_unavailable=lambda device, fmt: None, auto_rank=lambda device, fmt: 1)
)


def resolve_gemm_backend(recipe: MXRecipe, device: torch.device) -> str:
    """The concrete GEMM backend of `recipe` on `device`: its gemm_backend, with "auto" the available
    backend of lowest rank in `GEMM_BACKENDS` ("native" where `native_unavailable` and the recipe's
    format allow it, else "emulated", logged once per device and reason). "native" where it cannot
    run: RuntimeError (ValueError for the recipe's format) naming the requirement."""
    name, fmt = recipe.gemm_backend, recipe.fmt.name
    if name == "native":  # named: the requirement it misses, as an error
        reason = native_unavailable(device)
        if reason is not None:
            raise RuntimeError(reason)
        refused = _format_refuses(recipe.fmt)
        if refused is not None:
            raise ValueError(refused)
    out = GEMM_BACKENDS.resolve(name, device, fmt, option="gemm_backend")
    if name == "auto" and out != "native" and ("fallback", device, fmt) not in _logged:
        if not torch.compiler.is_compiling():
            _logged.add(("fallback", device, fmt))
        why = GEMM_BACKENDS.why_unavailable("native", device, fmt)
        log_once(f"gemm_backend='auto' runs the emulated GEMM on {device.type}: {why}")
    return out


_logged: set = set()


def log_once(msg: str) -> None:
    if not torch.compiler.is_compiling() and msg not in _logged:
        _logged.add(msg)
        log.info(msg)



QDQ_BACKENDS = frozenset({"emulated"})
"""Backends that are a high-precision GEMM of dequantized operands: the training ops give them
fused quantize-dequantize values (`gemm`) instead of MXTensors."""


class OpKernels(NamedTuple):
    """What a call of an MX op needs of its recipe on a device, resolved once per (recipe, device
    type) (`op_kernels`) instead of in every cast of the call."""

    backend: str
    """The concrete GEMM backend (`resolve_gemm_backend`)."""
    qdq: bool
    """The GEMMs take qdq'd high-precision operands (`uses_qdq`)."""
    compute: torch.dtype
    """The emulated GEMM's operand dtype (`MXRecipe.compute_dtype`)."""
    k0: str | None
    """The qdq kernel of dim0 calls without offs (`backends.cast_kernel`, "qdq_dim0"); None off the
    qdq path."""
    k1: str | None
    """The qdq kernel of dim1 and dim0+dim1 calls, with or without offs (`backends.cast_kernel`,
    "qdq_dim1"); None off the qdq path."""
    direct: bool = False
    """The op's qdq casts and high-precision GEMMs call their bodies straight away, asking nothing per
    call: set by `op_kernels` (and kept by `backward_kernels`) in plain eager mode, where nothing
    traces (torch.compile), records (the profiler) or differentiates them (autograd: inside an
    autograd Function, or a call with nothing that requires grad), on tensors that are not meta.
    False: each cast and GEMM chooses between its body and its custom op itself."""


def _make_kernels(recipe: MXRecipe, device: torch.device, backend: str, qdq: bool, direct: bool) -> OpKernels:
    compute = recipe.compute_dtype(device)
    if not qdq:
        return OpKernels(backend, qdq, compute, None, None, direct)
    k0, k1 = (backends.cast_kernel(recipe, device, c) for c in ("qdq_dim0", "qdq_dim1"))
    return OpKernels(backend, qdq, compute, k0, k1, direct)


def _both_kernels(recipe: MXRecipe, device: torch.device) -> tuple:
    """(recipe, general OpKernels, direct OpKernels): the direct ones are the general ones on meta."""
    backend = resolve_gemm_backend(recipe, device)
    general = _make_kernels(recipe, device, backend, backend in QDQ_BACKENDS, False)
    return recipe, general, general if device.type == "meta" else general._replace(direct=True)


def op_kernels(recipe: MXRecipe, device: torch.device) -> OpKernels:
    """The OpKernels of `recipe` on `device`'s type for one call of an MX op (its forward, or all of
    it without a graph to record), `direct` where the call runs in plain eager mode (see
    OpKernels.direct; a backward asks again, `backward_kernels`): a dict lookup after the first call
    (kept with the cast kernels' resolved answers, `mxmoe.quant.backends.clear_resolved` forgets it
    too); built afresh, not direct, while torch.compile traces. Raises as the recipe's qdq calls
    would (`backends.cast_kernel`)."""
    if torch.compiler.is_compiling():
        backend = resolve_gemm_backend(recipe, device)
        return _make_kernels(recipe, device, backend, backend in QDQ_BACKENDS, False)
    # keyed by the recipe's id (hashing a recipe hashes its 7 fields, µs per call; the entry holds
    # the recipe, so that id is not reused while the entry lives), the device (the GEMM backend is
    # resolved per device, kept beside this entry: `clear_resolved` forgets both) and QDQ_BACKENDS
    # (tests switch the path per call): a hit asks nothing else
    held, general, direct = backends.remember(
        ("op_kernels", id(recipe), device, QDQ_BACKENDS), lambda: _both_kernels(recipe, device)
    )
    if held is not recipe:
        _, general, direct = _both_kernels(recipe, device)
    return general if torch.autograd._profiler_enabled() else direct


def backward_kernels(kernels: OpKernels) -> OpKernels:
    """The OpKernels of an MX op's backward given its forward's: direct ones stay direct only where
    the backward runs in plain eager mode too (not traced by compiled autograd, not profiled)."""
    if kernels.direct and (torch.compiler.is_compiling() or torch.autograd._profiler_enabled()):
        return kernels._replace(direct=False)
    return kernels


def uses_qdq(recipe: MXRecipe, device: torch.device) -> bool:
    """Whether the ops feed `recipe`'s GEMM backend on `device` qdq'd high-precision operands."""
    return resolve_gemm_backend(recipe, device) in QDQ_BACKENDS
