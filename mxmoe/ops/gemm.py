"""The GEMM on MX operands: one function, `mx_gemm`, with a backend choice (the recipe's
`gemm_backend`).

Backends:
  "emulated": dequantize both operands to `compute_dtype` (bf16 or fp32) and run a dense or grouped
      high-precision GEMM (fp32 accumulation). Exact up to the GEMM's fp32 summation: the
      dequantized values are the MX values themselves (see MXRecipe.gemm_dtype for the bf16
      limits). The training ops (`mx_mm`, `mx_grouped_mm`) feed it through `gemm` with operands
      made by the fused quantize-dequantize (`mxmoe.quant.qdq`), the same values without the fp8
      round trip.
  "native": torch's block-scaled GEMMs on Blackwell (compute capability 10.x), whose tensor cores
      read e8m0 block scales: torch._scaled_mm (dense) and torch._scaled_grouped_mm (grouped),
      e4m3 operands, block 32, E8M0 scales (`SCALE_DTYPE`) in the swizzled layout
      (`mxmoe.quant.scale_layout`), bf16 output (the op's only one) before mx_gemm's final cast.
      A clear error where it cannot run (`native_unavailable`, `_native_refuses`).
  "auto" (the recipe default): "native" where it can run, else "emulated" with one log line saying
      why (`resolve_gemm_backend`); on CPU and sm_90 that is "emulated", as before.
Other backends: add a function with the same signature to `_BACKENDS`; the ops give such a
backend MXTensors.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import Tensor

from mxmoe.formats import INPUT_DTYPES
from mxmoe.ops.gemm_backend import NATIVE_BLOCK, NATIVE_ELEM, log_once, resolve_gemm_backend
from mxmoe.quant import scale_layout as sl
from mxmoe.quant.groups import check_offsets
from mxmoe.quant.mx_tensor import MXTensor
from mxmoe.recipe import MXRecipe, as_recipe


@torch.library.custom_op("mxmoe::grouped_mm", mutates_args=())
def grouped_mm(a: Tensor, b: Tensor, offs: Tensor) -> Tensor:
    """Grouped GEMM of bf16/fp32 tensors (not MX) with fp32 accumulation, opaque to torch.compile:
    torch._grouped_mm's contract on every device and dtype.

    2D x 3D: a (T, K), b (E, K, N), offs (E,) int32 cumulative row ends -> (T, N); rows of group e
        are a[offs[e-1]:offs[e]] @ b[e]; rows at or after offs[-1] are zero.
    2D x 2D: a (M, T), b (T, N), offs over T -> (E, M, N), out[e] = a[:, group e] @ b[group e, :];
        empty groups give zeros.
    bf16 on CUDA runs torch._grouped_mm (no host sync). Its operands' last two dims must each be
    row-major or column-major, the other stride a multiple of 16 bytes (torch 2.11's check): 2D x
    3D takes b (E, K, N) either way (mx_grouped_mm passes the forward's as a transposed view of the
    row-major (E, N, K) weight cast, the dgrad's row-major). 2D x 2D takes any group sizes (empty
    included) when both operands are T-major (a column-major, b row-major: what mx_grouped_mm's
    qdq path passes, dy1ᵀ and the tokens along M); with T contiguous in either operand
    torch._grouped_mm needs every group boundary a multiple of 8 (the MX path's padded groups are
    multiples of 32). Anything else: an exact loop over groups (syncs for offs).
    """
    return _grouped_mm_impl(a, b, offs)


def on_torch_grouped_mm(a: Tensor, b: Tensor) -> bool:
    """Whether a grouped GEMM of a and b runs torch._grouped_mm (CUDA, both bf16), not the loop."""
    return a.is_cuda and a.dtype == torch.bfloat16 and b.dtype == torch.bfloat16


def _grouped_mm_impl(a: Tensor, b: Tensor, offs: Tensor) -> Tensor:
    """grouped_mm's body, called directly in eager mode (`_grouped`)."""
    if on_torch_grouped_mm(a, b):
        out = torch._grouped_mm(a, b, offs=offs)
        if b.ndim == 3:
            from mxmoe.ops.tail_rows import zero_rows_after_trusted

            # rows past the last group are left unwritten: zero them, with no host sync and no
            # pass over the other rows (out and offs are as it needs: no checks)
            zero_rows_after_trusted(out, offs)
        return out
    ends = offs.tolist()
    if b.ndim == 3:
        out = a.new_zeros(a.shape[0], b.shape[-1])
    else:
        out = a.new_zeros(len(ends), a.shape[0], b.shape[-1])
    start = 0
    for e, end in enumerate(ends):
        if end > start:
            if b.ndim == 3:
                torch.mm(a[start:end], b[e], out=out[start:end])
            else:
                torch.mm(a[:, start:end], b[start:end], out=out[e])
        start = end
    return out


@grouped_mm.register_fake
def _(a: Tensor, b: Tensor, offs: Tensor) -> Tensor:
    if b.ndim == 3:
        return a.new_empty(a.shape[0], b.shape[-1])
    return a.new_empty(offs.shape[0], a.shape[0], b.shape[-1])


def _grouped(a: Tensor, b: Tensor, offs: Tensor) -> Tensor:
    """grouped_mm's body directly, the op itself where autograd would record it or where
    torch.compile traces the exact loop (its host read of offs stays out of the graph). A custom op
    call costs tens of µs of Python dispatch, in eager mode and from a compiled graph alike;
    traced, the CUDA bf16 body is torch._grouped_mm and the C++ zero_rows_after, which the graph
    calls directly. Inside a profiler range named "mxmoe::grouped_mm" when the profiler is on."""
    if (torch.is_grad_enabled() and (a.requires_grad or b.requires_grad)) or a.is_meta:
        return grouped_mm(a, b, offs)  # (on meta: its fake, shapes only)
    if torch.compiler.is_compiling():
        if on_torch_grouped_mm(a, b):
            return _grouped_mm_impl(a, b, offs)
        return grouped_mm(a, b, offs)
    if torch.autograd._profiler_enabled():
        with torch.profiler.record_function("mxmoe::grouped_mm"):
            return _grouped_mm_impl(a, b, offs)
    return _grouped_mm_impl(a, b, offs)


def _check_operands(a: MXTensor, b: MXTensor, offs: Tensor | None) -> None:
    if not isinstance(a, MXTensor) or not isinstance(b, MXTensor):
        raise TypeError(f"mx_gemm takes MXTensors, got {type(a).__name__} and {type(b).__name__}")
    if a.ndim != 2 or a.axis != 1:
        raise ValueError(f"a must be a 2D MXTensor blocked along its last dim, got {a}")
    if b.ndim == 3:
        if offs is None:
            raise ValueError("b is 3D (E, K, N): grouped GEMM needs offs")
        if b.axis != 1:
            raise ValueError(f"3D b (E, K, N) must be blocked along K (axis=1), got {b}")
    elif b.ndim != 2 or b.axis != 0:
        raise ValueError(f"2D b (K, N) must be blocked along K (axis=0), got {b}")
    if a.shape[-1] != b.shape[-2]:
        raise ValueError(f"reduction dims differ: a {tuple(a.shape)}, b {tuple(b.shape)}")
    if b.device != a.device:
        raise ValueError(f"mx_gemm: a is on {a.device} but b on {b.device}; they must share a device")
    if offs is None:
        return
    if not isinstance(offs, Tensor) or offs.ndim != 1 or offs.dtype != torch.int32 or offs.device != a.device:
        got = offs if not isinstance(offs, Tensor) else f"{offs.dtype} {tuple(offs.shape)} on {offs.device}"
        raise TypeError(f"offs must be a 1D torch.int32 tensor of group ends on {a.device}, got {got}")
    if b.ndim == 3 and offs.shape[0] != b.shape[0]:
        raise ValueError(f"offs has {offs.shape[0]} groups but b {tuple(b.shape)} has E={b.shape[0]}")
    if offs.is_cpu and not torch.compiler.is_compiling():  # on the host: no sync
        if b.ndim == 3:
            check_offsets(offs, a.shape[0], "a")
            return
        check_offsets(offs, b.shape[0], "b")  # with a 2D b the groups run over K, b's rows
        if any(e % a.block_size for e in offs.tolist()):
            raise ValueError(
                f"offs={offs.tolist()}: with a 2D b the groups run over K, every end a multiple of "
                f"block_size={a.block_size} (a block must not straddle two groups)"
            )


def _emulated(
    a: MXTensor, b: MXTensor, offs: Tensor | None, compute_dtype: torch.dtype, recipe: MXRecipe
) -> Tensor:
    a_deq = a.dequantize(compute_dtype, recipe=recipe)
    b_deq = b.dequantize(compute_dtype, recipe=recipe)
    if offs is None:
        return a_deq @ b_deq
    return _grouped(a_deq, b_deq, offs)


def _native_refuses(a: MXTensor, b: MXTensor, out_n: int) -> str | None:
    """Why torch's MX GEMMs refuse these operands (None: they take them): e4m3, block 32, and
    strides / output rows 16-byte aligned (K a multiple of 16, N of 8 for the bf16 output)."""
    for name, t in (("a", a), ("b", b)):
        if t.elem_dtype != NATIVE_ELEM or t.block_size != NATIVE_BLOCK:
            return f"gemm_backend='native' takes e4m3 operands in blocks of {NATIVE_BLOCK}; {name} is {t}"
    K = a.shape[-1]
    if K % 16 or out_n % 8:
        return f"gemm_backend='native' needs K % 16 == 0 and N % 8 == 0; got K={K}, N={out_n}"
    return None


def _m_scales(t: MXTensor, offs: Tensor | None) -> Tensor:
    """The swizzled scales of a 2D operand blocked along its last dim (tokens along the rows,
    swizzled per group of offs when given): its own if it carries them."""
    if t.scale_swizzled is not None:
        return t.scale_swizzled
    s = t.scale_blocked
    return sl.to_swizzled(s) if offs is None else sl.to_swizzled_m_groups(s, offs)


def _swizzled(t: MXTensor) -> Tensor:
    """The swizzled scales of a weight operand (each matrix on its own): its own if it carries them."""
    return t.scale_swizzled if t.scale_swizzled is not None else sl.to_swizzled(t.scale_blocked)


def _native(
    a: MXTensor, b: MXTensor, offs: Tensor | None, compute_dtype: torch.dtype, recipe: MXRecipe
) -> Tensor:
    """torch's block-scaled GEMMs (bf16 result). Operands as the ops make them, handed over as
    torch's ops take them (what torchao's MXFP8 grouped GEMM passes, tests/ops/test_native_gemm.py):
      dense    a (M, K) row-major, b (K, N) column-major (storage (N, K)); scales swizzled, flat.
      2D x 3D  a (T, K) row-major with its scales swizzled per group of rows (offs); b (E, K, N)
               column-major per expert (storage (E, N, K)), scales swizzled per expert (E, -1).
      2D x 2D  (wgrad) a (M, T) row-major, b (T, K) column-major (storage (K, T)), both blocked
               along T; scales swizzled per group of T (offs // 32: every group end a multiple of
               32, as the ops' group-padded copies have them); out (E, M, K)."""
    del compute_dtype, recipe
    bf16 = torch.bfloat16
    if offs is None:
        s_a = _m_scales(a, None).reshape(-1)
        s_b = _swizzled(b).reshape(-1)
        return torch._scaled_mm(a.qdata_blocked, b.qdata, s_a, s_b, out_dtype=bf16)
    if b.ndim == 3:
        s_a, s_b = _m_scales(a, offs), _swizzled(b).reshape(b.shape[0], -1)
        out = torch._scaled_grouped_mm(a.qdata_blocked, b.qdata, s_a, s_b, offs=offs, out_dtype=bf16)
        # rows past the last group are left unwritten by the op: zero them (no host sync)
        if out.is_cuda:
            from mxmoe.ops.tail_rows import zero_rows_after_trusted

            return zero_rows_after_trusted(out, offs)
        rows = torch.arange(out.shape[0], device=out.device)[:, None]
        return torch.where(rows < offs[-1].to(torch.int64), out, out.new_zeros(()))
    # 2D x 2D: a's storage (M, T) blocked along T, b's storage (K, T) blocked along T
    k_offs = offs // NATIVE_BLOCK
    s_a = sl.to_swizzled_k_groups(a.scale_blocked, k_offs)
    s_b = sl.to_swizzled_k_groups(b.scale_blocked, k_offs)
    return torch._scaled_grouped_mm(a.qdata_blocked, b.qdata, s_a, s_b, offs=offs, out_dtype=bf16)


_BACKENDS = {"emulated": _emulated, "native": _native}

def autocast_input(a: Tensor) -> Tensor:
    """The activation `a` in the autocast dtype when autocast is on for its device type, as torch.mm
    and nn.Linear take it there (so the MX ops return, save and differentiate activations of that
    dtype, as bf16 training does); unchanged otherwise. Weights are not cast: they are quantized
    straight from their own dtype (the fp32 master weights)."""
    dt = autocast_target(a)
    return a if dt is None else a.to(dt)


def autocast_on(device_type: str) -> bool:
    """Whether autocast is on for `device_type` (never on meta, for which torch.is_autocast_enabled
    raises: the MX ops run on meta tensors as nn.Linear does)."""
    return device_type != "meta" and torch.is_autocast_enabled(device_type)


def autocast_target(a: Tensor) -> torch.dtype | None:
    """The dtype `autocast_input(a)` casts `a` to; None when it returns `a` unchanged. TypeError
    for an autocast dtype the MX casts do not take (float16), naming autocast (the caller's tensors
    never had that dtype)."""
    dev = a.device.type
    if autocast_on(dev) and a.is_floating_point():
        dt = torch.get_autocast_dtype(dev)
        if a.dtype != dt:
            if dt not in INPUT_DTYPES:
                raise TypeError(
                    f"torch.autocast(dtype={dt}) is on for {dev}: MX ops take bfloat16 or float32 "
                    f"operands (got a {a.dtype} activation autocast would make {dt}); autocast with "
                    "dtype=torch.bfloat16"
                )
            return dt
    return None


def no_autocast(device: torch.device, eager: bool = False):
    """A context in which autocast is off for `device`'s type: the MX ops choose their GEMMs' dtypes
    themselves (the recipe's gemm_dtype) and must not have them recast. A no-op context when
    autocast is already off. eager: as for `autocast_off`."""
    if not autocast_on(device.type):
        return contextlib.nullcontext()
    return autocast_off(device.type, eager)


def autocast_off(device_type: str, eager: bool = False):
    """`torch.autocast(device_type, enabled=False)` for a caller that found autocast on. In eager
    mode torch's C++ guard that AOTAutograd's compiled graphs run under (torch._C._DisableAutocast:
    autocast off for every device type, no Python in its enter and exit, where torch.autocast's
    run some 20 Python calls); traced, torch.autocast (what dynamo traces). eager: the caller knows
    that torch.compile is not tracing (`OpKernels.direct`)."""
    if not eager and torch.compiler.is_compiling():
        return torch.autocast(device_type, enabled=False)
    return torch._C._DisableAutocast()



def apply_function(fn: type[torch.autograd.Function], *args, eager: bool = False):
    """`fn.apply(*args)`; in eager mode without functorch transforms, the C++ apply itself: the
    Python of `torch.autograd.Function.apply` only binds default arguments for a `setup_context`
    (the ops' Functions have none) and unwraps functorch's dead wrappers (none without
    transforms), µs per call. torch.compile traces `fn.apply` as usual. Under a torch.func
    transform (which such a Function cannot run under) a RuntimeError names the op. eager: the
    caller knows that torch.compile is not tracing (its kernels are `OpKernels.direct`)."""
    if not eager and torch.compiler.is_compiling():
        return fn.apply(*args)
    if torch._C._are_functorch_transforms_active():
        op = getattr(fn.backward, "mx_op", fn.__name__)
        raise RuntimeError(
            f"{op} does not run under torch.func transforms (grad, vmap, jvp, jacrev, ...): call it "
            "outside them (its gradient: torch.autograd.grad or .backward(), first order only)"
        )
    return super(torch.autograd.Function, fn).apply(*args)


def first_order(op: str):
    """Decorator of an MX autograd Function's backward, whose gradients have no derivative (they go
    through MX casts): a backward under create_graph=True (grad mode on in the backward) is a
    RuntimeError naming `op`, instead of an error from a cast inside at the second differentiation,
    or a gradient without the history it has (dy of none: dx came back not requiring grad, and a
    second derivative left its part out silently). (torch's once_differentiable errs only where
    the second differentiation reaches the op's gradient, not one asked of the op's inputs.)"""

    def decorate(backward):
        @functools.wraps(backward)
        def first_order_backward(ctx, *grads):
            if torch.is_grad_enabled() and not torch.compiler.is_compiling():
                raise RuntimeError(
                    f"{op} has no double backward (create_graph=True): its gradients go through MX casts, "
                    "which have no derivative; differentiate it once, without create_graph"
                )
            return backward(ctx, *grads)

        first_order_backward.mx_op = op
        return first_order_backward

    return decorate


def check_dtype(name: str, dtype: torch.dtype) -> None:
    """An operand of an MX op (as its casts take it: after autocast) is bf16 or fp32; the one
    dtype check of the call (the casts below trust it)."""
    if dtype not in INPUT_DTYPES:
        what = _OPERANDS.get(name, "")
        raise TypeError(
            f"{name} has dtype {dtype}; expected one of {[str(d) for d in INPUT_DTYPES]} ({what}the MX "
            "casts read bf16 or fp32: cast it, or run under torch.autocast with dtype=torch.bfloat16)"
        )


_OPERANDS = {
    "a": "a: the activations, the input x of an MXLinear or of MX experts; ",
    "b": "b: the weight; ",
    "b_t": "b_t: the experts' weights; ",
}
"""What each operand name of the MX ops is, in a module's terms (check_dtype's errors)."""


def gemm(
    a: Tensor, b: Tensor, offs: Tensor | None, out_dtype: torch.dtype, direct: bool = False
) -> Tensor:
    """a @ b on bf16/fp32 tensors (not MX), dense or grouped by offs (same shapes and offs as
    `mx_gemm`, any strides), fp32 accumulation; result in `out_dtype`. The emulated backend's GEMM
    on dequantized operands (of the compute dtype), and the wgrad_with_hp recipe's on unquantized
    ones. direct: the caller knows that nothing traces, profiles or differentiates this call and
    the operands are not meta (`OpKernels.direct`): the grouped GEMM's body runs without asking."""
    # torch.mm for the dense 2D GEMM: what `a @ b` runs there, without matmul's dispatch layer
    if offs is None:
        out = torch.mm(a, b)
    else:
        out = _grouped_mm_impl(a, b, offs) if direct else _grouped(a, b, offs)
    # no `.to()` when the dtype already matches: torch 2.11's dynamo gives an autograd.Function
    # whose output is such a no-op `.to()` of an intermediate a zero gradient under torch.compile.
    # Removable once mxmoe's oldest torch traces it right (tests/ops/test_mx_ops.py, compiled, pass
    # with a plain `.to(out_dtype)`).
    return out if out.dtype == out_dtype else out.to(out_dtype)


def mx_gemm(
    a: MXTensor,
    b: MXTensor,
    offs: Tensor | None = None,
    recipe: MXRecipe | None = None,
    *,
    out_dtype: torch.dtype | None = None,
) -> Tensor:
    """a @ b on MX operands, each blocked along the reduction dim.

    a: MXTensor, logical (M, K), blocked along K (axis=1).
    b: MXTensor, logical (K, N) blocked along K (axis=0); or (E, K, N) blocked along K (axis=1).
    offs: None (dense), or (E,) int32 cumulative group ends: with 3D b, over the rows of a
        (MoE forward/dgrad, -> (M, N)); with 2D b, over K (MoE wgrad, -> (E, M, N)).
    recipe: the MXRecipe (default DEFAULT_RECIPE): its gemm_backend, gemm_dtype (the emulated
        GEMM's operand dtype: default bf16 on CUDA, fp32 elsewhere) and dim0_kernel (dequantize).
    Returns a contiguous tensor of `out_dtype` (default: a's orig_dtype).
    """
    recipe = as_recipe(recipe)
    if recipe.gemm_backend not in _BACKENDS and recipe.gemm_backend != "auto":
        raise ValueError(
            f"gemm_backend={recipe.gemm_backend!r} is not a GEMM backend; expected 'auto' or one of "
            f"{list(_BACKENDS)}"
        )
    _check_operands(a, b, offs)
    backend = resolve_gemm_backend(recipe, a.device)
    if backend == "native":
        refused = _native_refuses(a, b, b.shape[-1])
        if refused is not None:
            if recipe.gemm_backend == "native":
                raise ValueError(refused)
            log_once(f"gemm_backend='auto' runs the emulated GEMM for this call: {refused}")
            backend = "emulated"
    out = _BACKENDS[backend](a, b, offs, recipe.compute_dtype(a.device), recipe)
    dtype = a.orig_dtype if out_dtype is None else out_dtype
    return out if out.dtype == dtype else out.to(dtype)


_MOVED = {
    "grouped_mm_hp": "mxmoe.ops.gemm.grouped_mm (the custom op mxmoe::grouped_mm)",
    "hp_gemm": "mxmoe.ops.gemm.gemm",
    "op_plan": "mxmoe.ops.gemm_backend.op_kernels",
    "OpPlan": "mxmoe.ops.gemm_backend.OpKernels",
    "native_unavailable": "mxmoe.ops.gemm_backend.native_unavailable",
    "uses_qdq": "mxmoe.ops.gemm_backend.uses_qdq",
    "QDQ_BACKENDS": "mxmoe.ops.gemm_backend.QDQ_BACKENDS",
}


def __getattr__(name: str):
    if name in _MOVED:
        raise AttributeError(f"mxmoe.ops.gemm.{name} is now {_MOVED[name]}")
    raise AttributeError(f"module 'mxmoe.ops.gemm' has no attribute {name!r}")
