"""Fused quantize-dequantize (qdq): bf16/fp32 -> MX-rounded values in bf16/fp32, one pass.

`qdq(x, axis, recipe=r, out_dtype=d)` has the values of `to_mx(x, axis, recipe=r).dequantize(d)`
bit for bit (NaN where NaN, its payload not specified, as for `dequantize`), without writing the
fp8 elements and scales and reading them back, and always in x's own row-major layout: the
emulated GEMM of `mxmoe.ops` feeds its operands this way.

Layouts (x viewed as (B, R, C), contiguous; every output (B, R, C) row-major contiguous):
  dim0 (blocks along the last dim C).
  dim1 (blocks along dim -2, R, of each of the B matrices, never across two): R needs no padding:
      the last block of each matrix is short, equal to the zero-padded cast's (zeros do not change
      a block's amax). The training ops feed it to their GEMMs as it is: the weights (N, K) or
      (E, N, K) along N are the dgrad's second operand in this layout, and the tokens and dy along
      M the wgrad's K-grouped operands (torch._grouped_mm takes them this way with any group
      sizes).
  dim0+dim1 from one read (2D x).
  Groups (2D x (T, C) only): with `offs` (E,) int32 cumulative group ends (as torch._grouped_mm),
      the dim1 blocks start at each group's first row (group e = rows offs[e-1]:offs[e], its last
      block short): equal to padding every group to a multiple of the block size, casting,
      dequantizing and gathering the real rows back, without the copies. Rows at or after
      offs[-1] belong to no group and are zero in every output (dim0 included), as in that padded
      form. The boundaries are computed on the device from offs (no host sync).

Backends: "torch" (the reference, `torch_cast.qdq_rows`: torch_cast's quantize followed by its
dequantize on the padded form, CPU or GPU), "triton" (the rows kernel of `triton_qdq`, launched by
its `qdq_rows`; on CPU under TRITON_INTERPRET=1) and
"cuda" (the C++ operators `mxmoe_cuda::qdq_dim0`, `qdq_dim1` and `qdq_dim0_dim1` of the CUDA cast
extension, csrc/mx_qdq.cu: the casts' and the dequantize kernel's device functions in one kernel,
one read of x and one write per output; dim1 and dim0+dim1 also with groups).
Which one runs (`mxmoe.quant.backends.cast_kernel`, where every kernel choice is made, with the
casts "qdq_dim0", "qdq_dim0_offs" and "qdq_dim1"):
  - dim0 calls follow the recipe's dim0_kernel, dim1 and dim0+dim1 calls its dim1_kernel: "cuda"
    takes the C++ operator, and so does "auto" on CUDA when the extension builds (else the Triton
    kernel);
  - except dim0 alone with offs (its rows after the groups zeroed): the Triton rows kernel for
    "cuda" and "auto" on CUDA (`mxmoe_cuda::qdq_dim0` has no groups).
The op is a `torch.library` custom op with a fake implementation (torch.compile fullgraph); eager
calls run its body directly. Under torch.compile the Triton kernel on CUDA is decomposed into its
launches for inductor, and the "cuda" kernel into the C++ operator, which inductor calls directly
(`_register_functional_decomp`, docs/training-ops.md).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch._subclasses.functional_tensor import FunctionalTensorMode

from mxmoe.formats import INPUT_DTYPES, MODE_IDS, OUTPUT_DTYPES, MXFormat, check_input_dtype, get_format
from mxmoe.quant import cuda_cast, torch_cast
from mxmoe.quant.backends import cast_kernel, triton_interpret
from mxmoe.quant.groups import check_offsets
from mxmoe.recipe import CAST_KERNELS, DEFAULT_RECIPE, MXRecipe

QDQ_KERNELS = CAST_KERNELS  # every cast kernel has its qdq


_MAX_GROUPS = 4096  # offs entries the Triton rows kernel reads per program (in powers of two from 128)


# ----------------------------------------------------------------------------------------------
# The custom op
# ----------------------------------------------------------------------------------------------


def _empty_outputs(x: Tensor, out_dtype: torch.dtype, dim0: bool, dim1: bool) -> list[Tensor]:
    # empty_like: host time a µs below torch.empty(x.shape, ...), whose torch.Size argument parses
    # slowly; no comprehension (a Python call of its own per cast)
    fmt = torch.contiguous_format
    if dim0 and dim1:
        return [torch.empty_like(x, dtype=out_dtype, memory_format=fmt),
                torch.empty_like(x, dtype=out_dtype, memory_format=fmt)]
    return [torch.empty_like(x, dtype=out_dtype, memory_format=fmt)] if dim0 or dim1 else []


@torch.library.custom_op("mxmoe::qdq", mutates_args=())
def qdq_op(
    x: Tensor,
    fmt: str,
    out_dtype: torch.dtype,
    dim0: bool,
    dim1: bool,
    kernel: str,
    offs: Tensor | None = None,
) -> list[Tensor]:
    """x (B, R, C) bf16/fp32 contiguous, C % block_size == 0, any R; B == 1 when offs is given. x may
    also be 2D (R, C), the same as (1, R, C) (the public 2D calls pass it so, saving the reshapes):
    the outputs are then 2D too. fmt: a registered format's name (`mxmoe.formats.FORMATS`), whose
    block size, scale rule and element dtype the values take.

    Returns, in order, each of x's shape, out_dtype, row-major contiguous: if dim0, y0 = MX-rounded
    along C; if dim1, y1 = MX-rounded along R, blocks starting at each matrix's first row (the last
    one short), or at every group start when offs is given. offs: None, or (E,) int32 cumulative
    group ends on x's device; rows at or after offs[-1] are zero in every output. kernel: "torch" |
    "triton" | "cuda" (concrete, from `cast_kernel`; "cuda": not dim0 alone with offs, extension
    loaded; x may then have any ndim >= 2 without offs, the dim1 blocks starting at each matrix
    x[..., :, :]'s first row).
    """
    return _qdq_impl(x, get_format(fmt), out_dtype, dim0, dim1, kernel, offs)


def _qdq_impl(
    x, fmt: MXFormat, out_dtype, dim0, dim1, kernel, offs=None, *, traced=False
) -> list[Tensor]:
    """qdq_op's body, called directly in eager mode (a custom op call costs tens of microseconds of
    Python) with the format itself (the op passes its name); arguments already checked. traced: the
    Triton launches go through wrap_triton (`_register_functional_decomp`)."""
    if kernel == "cuda":  # the C++ operators take the format as scalars (csrc/binding.cpp)
        bs, mode, elem = fmt.block_size, MODE_IDS[fmt.scaling_mode], fmt.elem_dtype
        if dim0 and dim1:
            return list(torch.ops.mxmoe_cuda.qdq_dim0_dim1.default(x, bs, mode, elem, out_dtype, offs))
        if dim1:
            return [torch.ops.mxmoe_cuda.qdq_dim1.default(x, bs, mode, elem, out_dtype, offs)]
        if offs is not None:
            raise ValueError("the cuda qdq kernel has no grouped dim0 alone (offs); it takes 'triton'")
        return [torch.ops.mxmoe_cuda.qdq_dim0.default(x, bs, mode, elem, out_dtype)]
    spec = fmt.spec
    if kernel == "torch":
        if x.numel() == 0:
            return _empty_outputs(x, out_dtype, dim0, dim1)
        if x.ndim == 2:
            return [t.contiguous().view(x.shape)
                    for t in torch_cast.qdq_rows(x.unsqueeze(0), spec, out_dtype, dim0, dim1, offs)]
        return [t.contiguous() for t in torch_cast.qdq_rows(x, spec, out_dtype, dim0, dim1, offs)]
    if kernel != "triton":
        raise ValueError(f"kernel={kernel!r} is not a qdq kernel; expected one of {list(QDQ_KERNELS)}")
    global _qdq_rows
    if _qdq_rows is None:  # (an import statement per call: half a µs of host time)
        from mxmoe.quant.triton_qdq import qdq_rows as _qdq_rows  # (imports triton: on first use)
    outs = _empty_outputs(x, out_dtype, dim0, dim1)
    _qdq_rows(x, spec, out_dtype, dim0, dim1, offs, outs, traced)
    return outs


_qdq_rows = None  # mxmoe.quant.triton_qdq.qdq_rows once imported


@qdq_op.register_fake
def _(x, fmt, out_dtype, dim0, dim1, kernel, offs=None):
    return _empty_outputs(x, out_dtype, dim0, dim1)


def _op_args(x, fmt, out_dtype, dim0, dim1, kernel, offs=None) -> tuple:
    return x, get_format(fmt), out_dtype, dim0, dim1, kernel, offs


def _register_functional_decomp(op, op_args, impl, kernel_at: int) -> None:
    """How AOTAutograd (torch.compile's functionalization) sees a qdq custom op `op` (`mxmoe::qdq`,
    `mxmoe::swiglu_qdq`, `mxmoe::swiglu_bwd_qdq`: the first argument the tensor read, argument
    `kernel_at` the kernel; `op_args` binds a call's arguments in order, the format's name replaced
    by the registered format, as `impl` takes them): for the Triton kernel
    on CUDA tensors, as its body with the launches wrapped by `torch.library.wrap_triton` (what
    `torch.library.triton_op` does), so that inductor launches the kernel from its generated code
    instead of calling back into this op's Python for every launch; for the cuda kernel, as its
    body, a C++ operator (`mxmoe_cuda::qdq_dim0`, `qdq_dim1` or `qdq_dim0_dim1`, registered ops
    with fake implementations), which inductor calls directly; anything else (the torch kernel, CPU
    tensors, the Triton interpreter, torch.export) stays the opaque op with its fake
    implementation. `impl(*args, traced=True)` is the op's body."""

    def decomp(mode, op_, types, args=(), kwargs=None):
        full = op_args(*args, **(kwargs or {}))
        if not _decomposes(full[0], full[kernel_at], types):
            return mode.__torch_dispatch__(op_, types, args, kwargs or {})
        with mode:
            return impl(*full, traced=True)

    op.register_torch_dispatch(FunctionalTensorMode, decomp)


_register_functional_decomp(qdq_op, _op_args, _qdq_impl, 5)


def _no_gradient(ctx, *grads):
    """Backward through a qdq of a tensor that needs a gradient (the forward runs: a value without
    one is fine): an error saying so, instead of torch's "no autograd formula was registered"."""
    raise RuntimeError(
        "backward through mxmoe.quant.qdq: an MX quantize-dequantize has no gradient. For training "
        "use mxmoe.nn.MXLinear, mxmoe.ops.mx_mm or mxmoe.ops.mx_grouped_mm (they return high-precision "
        "gradients), or qdq(x.detach()) if no gradient is wanted"
    )


qdq_op.register_autograd(_no_gradient, setup_context=lambda ctx, inputs, output: None)


def _qdq(x: Tensor, fmt: MXFormat, *rest) -> list[Tensor]:
    """qdq_op (taking fmt's name) while torch.compile traces (or autograd records x); its body
    directly otherwise (inside a profiler range named "mxmoe::qdq" when the profiler is on)."""
    if torch.compiler.is_compiling() or (x.requires_grad and torch.is_grad_enabled()):
        return qdq_op(x, fmt.name, *rest)
    if torch.autograd._profiler_enabled():
        with torch.profiler.record_function("mxmoe::qdq"):
            return _qdq_impl(x, fmt, *rest)
    return _qdq_impl(x, fmt, *rest)


# ----------------------------------------------------------------------------------------------
# SwiGLU + dim0+dim1 qdq (the experts' w2 input)
# ----------------------------------------------------------------------------------------------


@torch.library.custom_op("mxmoe::swiglu_qdq", mutates_args=())
def swiglu_qdq_op(
    g: Tensor,
    u: Tensor,
    fmt: str,
    out_dtype: torch.dtype,
    kernel: str,
    offs: Tensor | None = None,
) -> list[Tensor]:
    """g, u: (R, C) (or (B, R, C) without offs) bf16/fp32, one shape and dtype, contiguous,
    C % block_size == 0. Returns [y0, y1] = qdq_op(h, ..., dim0=True, dim1=True, kernel, offs) of
    h = F.silu(g) * u as eager PyTorch computes it on g's device (the definition: the "torch" and
    "triton" kernels form h so, "cuda" forms it in registers, mxmoe_cuda::swiglu_qdq_dim0_dim1),
    each of g's shape, out_dtype, row-major contiguous; offs as for `qdq_op`."""
    return _swiglu_qdq_impl(g, u, get_format(fmt), out_dtype, kernel, offs)


def _swiglu_qdq_impl(g, u, fmt: MXFormat, out_dtype, kernel, offs=None, *, traced=False) -> list[Tensor]:
    """swiglu_qdq_op's body (eager calls run it directly with the format, as `_qdq_impl`); traced:
    as `_qdq_impl`."""
    if kernel == "cuda":
        op = torch.ops.mxmoe_cuda.swiglu_qdq_dim0_dim1.default
        return list(op(g, u, fmt.block_size, MODE_IDS[fmt.scaling_mode], fmt.elem_dtype, out_dtype, offs))
    # the reference (and the Triton qdq, which has no SwiGLU prologue): h as the unfused code forms it
    h = torch.nn.functional.silu(g) * u
    args = (h, fmt, out_dtype, True, True, kernel, offs)
    return _qdq_impl(*args, traced=True) if traced else _qdq_impl(*args)  # (as `_qdq` calls it)


@swiglu_qdq_op.register_fake
def _(g, u, fmt, out_dtype, kernel, offs=None):
    return _empty_outputs(g, out_dtype, True, True)


def _swiglu_op_args(g, u, fmt, out_dtype, kernel, offs=None) -> tuple:
    return g, u, get_format(fmt), out_dtype, kernel, offs


def _decomposes(x: Tensor, kernel: str, types) -> bool:
    """Whether `mxmoe::qdq` or a fused op (`mxmoe::swiglu_qdq`, `mxmoe::swiglu_bwd_qdq`) on x
    decomposes into its body for AOTAutograd (see `_register_functional_decomp`); loads the extension for
    "cuda" (registers torch.ops.mxmoe_cuda; a flag test once loaded)."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor

    decompose = (
        kernel in ("triton", "cuda")
        and x.is_cuda
        and (kernel == "cuda" or not triton_interpret())  # interpreted kernels cannot be wrapped
        and getattr(torch._functorch.config, "decompose_custom_triton_ops", True)  # False: torch.export
        and all(issubclass(t, (FakeTensor, FunctionalTensor)) or t is Tensor for t in types)
    )
    if decompose and kernel == "cuda":
        cuda_cast.load_extension()
    return decompose


def _eager_or_op(
    op, impl, name: str, tensors: tuple[Tensor, ...], fmt: MXFormat, rest: tuple
) -> list[Tensor]:
    """A trusted call of a fused op on (*tensors, fmt, *rest): through the custom op `op` (taking
    fmt's name) while tracing or when autograd must record it (one of `tensors` requires grad), else
    its body `impl` (taking fmt itself) straight away (inside a profiler range called `name` while
    profiling, so that profiles show it either way)."""
    if torch.compiler.is_compiling() or (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)):
        return op(*tensors, fmt.name, *rest)
    if torch.autograd._profiler_enabled():
        with torch.profiler.record_function(name):
            return impl(*tensors, fmt, *rest)
    return impl(*tensors, fmt, *rest)


# on CUDA tensors the "cuda" kernel decomposes into the C++ operator, the "triton" one into
# F.silu(g) * u (inductor fuses it) and the wrapped rows kernel
_register_functional_decomp(swiglu_qdq_op, _swiglu_op_args, _swiglu_qdq_impl, 4)


def swiglu_qdq_trusted(
    g: Tensor, u: Tensor, recipe: MXRecipe, kernel: str, out_dtype: torch.dtype, offs: Tensor | None = None,
    direct: bool = False,
) -> list[Tensor]:
    """`swiglu_qdq_dim0_dim1` for a caller that checked every argument already (the MX ops): g, u
    2D (T, C) of one dtype (made contiguous), offs None or (E,) int32 contiguous on their device,
    the kernel `cast_kernel(recipe, device, "qdq_dim1")`; direct: the caller knows that nothing
    traces, profiles or differentiates this call (`qdq_trusted`). Returns [y0, y1], each (T, C)
    out_dtype contiguous."""
    g, u = g.contiguous(), u.contiguous()
    if direct:
        return _swiglu_qdq_impl(g, u, recipe.fmt, out_dtype, kernel, offs)
    rest = (out_dtype, kernel, offs)
    return _eager_or_op(swiglu_qdq_op, _swiglu_qdq_impl, "mxmoe::swiglu_qdq", (g, u), recipe.fmt, rest)


def swiglu_qdq_dim0_dim1(
    g: Tensor,
    u: Tensor,
    *,
    recipe: MXRecipe = DEFAULT_RECIPE,
    out_dtype: torch.dtype | None = None,
    offs: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """`qdq_dim0_dim1(F.silu(g) * u, recipe=recipe, out_dtype=out_dtype, offs=offs)` bit for bit,
    where h = F.silu(g) * u is what eager PyTorch computes on g's device (silu in fp32 rounded to
    g's dtype, then the product in fp32 rounded to g's dtype); the "cuda" kernel (recipe.dim1_kernel
    "cuda", or "auto" on CUDA: mxmoe_cuda::swiglu_qdq_dim0_dim1) reads g and u once and never
    writes h; "torch" (and "auto" off CUDA) and "triton" form h with torch, then run their qdq.

    g, u: 2D (R, C) bf16/fp32 of one shape, dtype and device, any strides (made contiguous),
    C divisible by the block size. Returns (y0, y1) as `qdq_dim0_dim1`: each (R, C) out_dtype
    (default g's dtype) row-major contiguous (with offs, rows at or after offs[-1] zero in both).
    """
    check_input_dtype("g", g)
    check_input_dtype("u", u)
    out_dtype = g.dtype if out_dtype is None else out_dtype
    if g.ndim != 2:
        raise ValueError(f"g must be 2D for swiglu_qdq_dim0_dim1, got shape {tuple(g.shape)}")
    if u.shape != g.shape or u.dtype != g.dtype or u.device != g.device:
        raise ValueError(
            f"u ({u.dtype}, shape {tuple(u.shape)}, on {u.device}) must have g's dtype, shape and device "
            f"({g.dtype}, {tuple(g.shape)}, {g.device})"
        )
    _check(g, recipe, out_dtype, offs, "g")
    kernel = cast_kernel(recipe, g.device, "qdq_dim1")
    offs = None if offs is None else offs.contiguous()  # the kernel reads offs[e] at offs_ptr + e
    y0, y1 = swiglu_qdq_trusted(g, u, recipe, kernel, out_dtype, offs)
    return y0, y1


# ----------------------------------------------------------------------------------------------
# SwiGLU backward + dim0+dim1 qdq of dg and du (the experts' w1 / w3 gradients)
# ----------------------------------------------------------------------------------------------


def swiglu_bwd(dh: Tensor, g: Tensor, u: Tensor) -> tuple[Tensor, Tensor]:
    """(dg, du): autograd's gradients of h = F.silu(g) * u given dh, as its MulBackward0 and
    SiluBackward0 form them (eager ops, each rounded to the inputs' dtype): dg =
    silu_backward(dh * u, g), du = dh * F.silu(g). All of one shape, dtype and device."""
    return torch.ops.aten.silu_backward(dh * u, g), dh * torch.nn.functional.silu(g)


@torch.library.custom_op("mxmoe::swiglu_bwd_qdq", mutates_args=())
def swiglu_bwd_qdq_op(
    dh: Tensor,
    g: Tensor,
    u: Tensor,
    fmt: str,
    out_dtype: torch.dtype,
    kernel: str,
    offs: Tensor | None = None,
) -> list[Tensor]:
    """dh, g, u: (R, C) (or (B, R, C) without offs) bf16/fp32, one shape and dtype, contiguous,
    C % block_size == 0. Returns [dg0, dg1, du0, du1] = qdq_op(x, ..., dim0=True, dim1=True, kernel,
    offs) of x = dg and x = du, (dg, du) = `swiglu_bwd(dh, g, u)` as eager PyTorch computes them on
    the inputs' device (the definition: "torch" and "triton" form them so, "cuda" in registers,
    mxmoe_cuda::swiglu_bwd_qdq_dim0_dim1), each of dh's shape, out_dtype, row-major contiguous."""
    return _swiglu_bwd_qdq_impl(dh, g, u, get_format(fmt), out_dtype, kernel, offs)


def _swiglu_bwd_qdq_impl(
    dh, g, u, fmt: MXFormat, out_dtype, kernel, offs=None, *, traced=False
) -> list[Tensor]:
    """swiglu_bwd_qdq_op's body (eager calls run it directly with the format, as `_qdq_impl`);
    traced: as `_qdq_impl`."""
    if kernel == "cuda":
        op = torch.ops.mxmoe_cuda.swiglu_bwd_qdq_dim0_dim1.default
        return list(op(dh, g, u, fmt.block_size, MODE_IDS[fmt.scaling_mode], fmt.elem_dtype, out_dtype, offs))
    outs = []
    for x in swiglu_bwd(dh, g, u):  # the reference (and the Triton qdq): dg, du as the unfused code
        args = (x, fmt, out_dtype, True, True, kernel, offs)
        outs += _qdq_impl(*args, traced=True) if traced else _qdq_impl(*args)
    return outs


@swiglu_bwd_qdq_op.register_fake
def _(dh, g, u, fmt, out_dtype, kernel, offs=None):
    return _empty_outputs(dh, out_dtype, True, True) + _empty_outputs(dh, out_dtype, True, True)


def _swiglu_bwd_op_args(dh, g, u, fmt, out_dtype, kernel, offs=None) -> tuple:
    return dh, g, u, get_format(fmt), out_dtype, kernel, offs


_register_functional_decomp(swiglu_bwd_qdq_op, _swiglu_bwd_op_args, _swiglu_bwd_qdq_impl, 5)


def swiglu_bwd_qdq_trusted(
    dh: Tensor, g: Tensor, u: Tensor, recipe: MXRecipe, kernel: str, out_dtype: torch.dtype,
    offs: Tensor | None = None, direct: bool = False,
) -> list[Tensor]:
    """`swiglu_bwd_qdq_dim0_dim1` for a caller that checked every argument already (the MX ops): dh,
    g, u 2D (T, C) of one dtype (made contiguous), offs None or (E,) int32 contiguous on their
    device, the kernel `cast_kernel(recipe, device, "qdq_dim1")`; direct: as for `qdq_trusted`.
    Returns [dg0, dg1, du0, du1], each (T, C) out_dtype contiguous."""
    dh, g, u = dh.contiguous(), g.contiguous(), u.contiguous()
    if direct:
        return _swiglu_bwd_qdq_impl(dh, g, u, recipe.fmt, out_dtype, kernel, offs)
    rest = (out_dtype, kernel, offs)
    return _eager_or_op(swiglu_bwd_qdq_op, _swiglu_bwd_qdq_impl, "mxmoe::swiglu_bwd_qdq", (dh, g, u),
                        recipe.fmt, rest)


def swiglu_bwd_qdq_dim0_dim1(
    dh: Tensor,
    g: Tensor,
    u: Tensor,
    *,
    recipe: MXRecipe = DEFAULT_RECIPE,
    out_dtype: torch.dtype | None = None,
    offs: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The SwiGLU backward fused with the dim0+dim1 qdq of its outputs: (dg0, dg1) =
    `qdq_dim0_dim1(dg, recipe=recipe, out_dtype=out_dtype, offs=offs)` and (du0, du1) the same of du,
    bit for bit, where (dg, du) = `swiglu_bwd(dh, g, u)` are the gradients of h = F.silu(g) * u as
    eager PyTorch's autograd computes them on the inputs' device (dg = silu_backward(dh * u, g), du =
    dh * F.silu(g), each op rounded to the dtype). The "cuda" kernel (recipe.dim1_kernel "cuda", or
    "auto" on CUDA: mxmoe_cuda::swiglu_bwd_qdq_dim0_dim1) reads dh, g and u once and never writes dg
    or du; "torch" (and "auto" off CUDA) and "triton" form them with torch, then run their qdq.

    dh, g, u: 2D (R, C) bf16/fp32 of one shape, dtype and device, any strides (made contiguous),
    C divisible by the block size. Returns (dg0, dg1, du0, du1): each (R, C) out_dtype (default dh's
    dtype) row-major contiguous; 0 along C, 1 along R (in groups with offs: rows at or after offs[-1]
    zero in all four).
    """
    for name, t in (("dh", dh), ("g", g), ("u", u)):
        check_input_dtype(name, t)
    out_dtype = dh.dtype if out_dtype is None else out_dtype
    if dh.ndim != 2:
        raise ValueError(f"dh must be 2D for swiglu_bwd_qdq_dim0_dim1, got shape {tuple(dh.shape)}")
    for name, t in (("g", g), ("u", u)):
        if t.shape != dh.shape or t.dtype != dh.dtype or t.device != dh.device:
            raise ValueError(
                f"{name} ({t.dtype}, shape {tuple(t.shape)}, on {t.device}) must have dh's dtype, shape and "
                f"device ({dh.dtype}, {tuple(dh.shape)}, {dh.device})"
            )
    _check(dh, recipe, out_dtype, offs, "dh")
    kernel = cast_kernel(recipe, dh.device, "qdq_dim1")
    offs = None if offs is None else offs.contiguous()  # the kernel reads offs[e] at offs_ptr + e
    dg0, dg1, du0, du1 = swiglu_bwd_qdq_trusted(dh, g, u, recipe, kernel, out_dtype, offs)
    return dg0, dg1, du0, du1


# ----------------------------------------------------------------------------------------------
# Python API
# ----------------------------------------------------------------------------------------------


def _check(x: Tensor, recipe: MXRecipe, out_dtype: torch.dtype, offs: Tensor | None, name: str = "x") -> None:
    """The one argument check of a public qdq call (x as the caller gave it, called `name` in the
    messages, a tensor of an input dtype: the caller checked that first, `check_input_dtype`):
    recipe, out_dtype, the last dim whole blocks, offs."""
    if not isinstance(recipe, MXRecipe):
        raise TypeError(f"recipe must be an mxmoe.MXRecipe, got {type(recipe).__name__}")
    if out_dtype not in OUTPUT_DTYPES:
        raise TypeError(f"out_dtype={out_dtype} is not supported; expected one of {list(OUTPUT_DTYPES)}")
    if x.ndim < 2:
        raise ValueError(f"{name} must have at least 2 dims for qdq, got shape {tuple(x.shape)}")
    if x.shape[-1] % recipe.block_size:
        raise ValueError(
            f"{name}.shape[-1]={x.shape[-1]} ({name} {tuple(x.shape)}) is not divisible by "
            f"block_size={recipe.block_size}"
        )
    if offs is None:
        return
    if x.ndim != 2:
        raise ValueError(f"{name} must be 2D (T, C) with offs, got shape {tuple(x.shape)}")
    if not isinstance(offs, Tensor) or offs.ndim != 1 or offs.dtype != torch.int32:
        got = f"{offs.dtype} of shape {tuple(offs.shape)}" if isinstance(offs, Tensor) else repr(offs)
        raise TypeError(
            "offs must be a 1D torch.int32 tensor of cumulative group ends (as torch._grouped_mm), "
            f"got {got}"
        )
    if not 1 <= offs.shape[0] <= _MAX_GROUPS:
        raise ValueError(f"offs has {offs.shape[0]} groups; expected 1 to {_MAX_GROUPS}")
    if offs.device != x.device:
        raise ValueError(f"offs is on {offs.device} but {name} on {x.device}; they must share a device")
    if offs.is_cpu and not torch.compiler.is_compiling():
        check_offsets(offs, x.shape[0], name)  # on the host already: no sync (as mx_grouped_mm)


def qdq_trusted(
    x: Tensor, recipe: MXRecipe, kernel: str, out_dtype: torch.dtype, dim0: bool, dim1: bool,
    offs: Tensor | None = None, direct: bool = False,
) -> list[Tensor]:
    """`qdq` (dim0 or dim1) or `qdq_dim0_dim1` for a caller that checked every argument already
    (the MX ops, once per public call): no checks here, the kernel given (from `cast_kernel`).

    x: bf16/fp32, 2D (R, C) or 3D (B, R, C) (no offs), any strides (made contiguous), C divisible
    by the block size. offs: None, or (E,) int32 contiguous on x's device, 2D x. out_dtype: bf16
    or fp32. direct: the caller knows that nothing traces (torch.compile), profiles or
    differentiates this call and x is not meta (the MX ops' `OpKernels.direct`, decided once per
    forward or backward): the body runs without asking. Returns [y0 if dim0, y1 if dim1], each of
    x's shape, row-major contiguous."""
    x = x.contiguous()
    # `_qdq`'s choice inline (one Python frame less per cast): the op where it must be, else its body
    if not direct and (
        torch.compiler.is_compiling()
        or (x.requires_grad and torch.is_grad_enabled())
        or torch.autograd._profiler_enabled()
    ):
        return _qdq(x, recipe.fmt, out_dtype, dim0, dim1, kernel, offs)
    return _qdq_impl(x, recipe.fmt, out_dtype, dim0, dim1, kernel, offs)


def qdq(
    x: Tensor,
    axis: int = -1,
    *,
    recipe: MXRecipe = DEFAULT_RECIPE,
    out_dtype: torch.dtype | None = None,
    offs: Tensor | None = None,
) -> Tensor:
    """The values of `to_mx(x, axis, recipe=recipe).dequantize(out_dtype)` in one pass, bit for bit,
    in x's own row-major layout.

    x: bf16/fp32, ndim >= 2, any strides (made contiguous), x.shape[-1] % recipe.block_size == 0.
    axis: -1 (blocks along the last dim, kernel recipe.dim0_kernel) or -2 (blocks along dim -2 of
    each matrix x[..., :, :], never across two, kernel recipe.dim1_kernel; x.shape[-2] need not be
    a multiple of the block size: the last block is short, the zero-padded cast's values). "cuda",
    or "auto" on CUDA, runs the C++ operator mxmoe_cuda::qdq_dim0 (no offs) / qdq_dim1, the Triton
    rows kernel for dim0 with offs.
    out_dtype: bf16 or fp32 (default x.dtype). Returns x's shape in out_dtype, row-major contiguous.
    offs: None, or (E,) int32 cumulative group ends on x's device (2D x only): dim1 blocks start at
    every group start; rows at or after offs[-1] are zero (module docstring).
    """
    if not isinstance(x, Tensor) or x.dtype not in INPUT_DTYPES:
        check_input_dtype("x", x)
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if isinstance(axis, bool) or not isinstance(axis, int) or axis not in (-1, -2, x.ndim - 1, x.ndim - 2):
        raise ValueError(f"axis={axis!r}; expected -1 or -2 (blocks along one of the last two dims)")
    dim1 = axis in (-2, x.ndim - 2)
    # `_check` only where it may find something (the same tests; offs always checked)
    if (type(recipe) is not MXRecipe or out_dtype not in OUTPUT_DTYPES or x.ndim < 2
            or x.shape[-1] % recipe.block_size or offs is not None):
        _check(x, recipe, out_dtype, offs)
    # dim0 alone with groups (its rows after them zeroed) is the rows kernel's job
    cast = "qdq_dim1" if dim1 else "qdq_dim0" if offs is None else "qdq_dim0_offs"
    kernel = cast_kernel(recipe, x.device, cast)
    xc = x.contiguous()
    # 2D and 3D go to the op as they are (no reshapes); more dims as (B, R, C)
    xb = xc if x.ndim <= 3 else xc.view(-1, x.shape[-2], x.shape[-1])
    offs = None if offs is None else offs.contiguous()  # the kernel reads offs[e] at offs_ptr + e
    (y,) = _qdq(xb, recipe.fmt, out_dtype, not dim1, dim1, kernel, offs)
    return y if x.ndim <= 3 else y.view(x.shape)


def qdq_dim0_dim1(
    x: Tensor,
    *,
    recipe: MXRecipe = DEFAULT_RECIPE,
    out_dtype: torch.dtype | None = None,
    offs: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Both directions of a 2D x (R, C) or a 3D x (B, R, C) (e.g. expert weights; no offs),
    bf16/fp32, C divisible by the block size, any R, from one read (kernel recipe.dim1_kernel;
    "cuda", or "auto" on CUDA, runs the C++ operator mxmoe_cuda::qdq_dim0_dim1, with or without
    offs).

    Returns y0 = qdq(x, -1, offs=offs) and y1 = qdq(x, -2, offs=offs), each of x's shape, out_dtype,
    row-major contiguous (with offs, rows at or after offs[-1] are zero in both).
    """
    if not isinstance(x, Tensor) or x.dtype not in INPUT_DTYPES:
        check_input_dtype("x", x)
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if x.ndim not in (2, 3) or (x.ndim == 3 and offs is not None):
        raise ValueError(
            f"x must be 2D (R, C), or 3D (B, R, C) without offs, for qdq_dim0_dim1; got shape "
            f"{tuple(x.shape)}{' with offs' if offs is not None else ''}"
        )
    # `_check` only where it may find something (the same tests; offs always checked)
    if (type(recipe) is not MXRecipe or out_dtype not in OUTPUT_DTYPES or x.ndim < 2
            or x.shape[-1] % recipe.block_size or offs is not None):
        _check(x, recipe, out_dtype, offs)
    kernel = cast_kernel(recipe, x.device, "qdq_dim1")
    offs = None if offs is None else offs.contiguous()  # the kernel reads offs[e] at offs_ptr + e
    y0, y1 = _qdq(x.contiguous(), recipe.fmt, out_dtype, True, True, kernel, offs)  # 2D / 3D as they are
    return y0, y1


__all__ = ["QDQ_KERNELS", "qdq", "qdq_trusted", "qdq_dim0_dim1", "qdq_op",
           "swiglu_bwd", "swiglu_bwd_qdq_dim0_dim1", "swiglu_bwd_qdq_op", "swiglu_bwd_qdq_trusted",
           "swiglu_qdq_dim0_dim1", "swiglu_qdq_op", "swiglu_qdq_trusted"]
