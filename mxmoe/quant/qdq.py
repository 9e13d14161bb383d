"""Fused quantize-dequantize (qdq): bf16/fp32 -> MX-rounded values in bf16/fp32, one pass.

`qdq(x, axis, recipe=r, out_dtype=d)` equals `to_mx(x, axis, recipe=r).dequantize(d)` bit for bit
(same values, same logical shape and the same storage layout; NaN where NaN, its payload not
specified, as for `dequantize`), without writing the fp8 elements and scales and reading them back.
The emulated GEMM of `mxmoe.ops` feeds its operands this way.

Layouts (x viewed as (B, R, C), contiguous):
  dim0 (blocks along the last dim C): out (B, R, C), the input's layout.
  dim1 (blocks along dim -2, R): out stored (B, C, R) contiguous and returned as its transposed
      view, i.e. exactly the storage `to_mx(x, axis=-2).dequantize()` returns. The GEMM results
      depend on the operand layout (bf16 CPU GEMMs differ bitwise between a row-major operand and
      a transposed one), so this is what keeps the emulated GEMMs bit-identical to the
      quantize-then-dequantize path.
  dim0+dim1 from one read: both of the above; or the dim0 values plus the dim1 cast in MX
      (elements (C, R) and e8m0 scales (C, R // bs), exactly `to_mx(x, axis=-2)`'s storage).
  dim1 in rows layout (`layout="rows"`, 2D x (T, C)): out (T, C) in x's own row-major layout (what
      the training ops feed their weight-gradient GEMMs: torch._grouped_mm takes a K-grouped
      operand this way with any group sizes). T needs no padding: the last block is short, equal to
      the zero-padded cast's (zeros do not change a block's amax). With `offs` (E,) int32
      cumulative group ends (as torch._grouped_mm), the blocks start at each group's first row
      (group e = rows offs[e-1]:offs[e], its last block short): equal to padding every group to a
      multiple of the block size, casting, dequantizing and gathering the real rows back, without
      the copies. Rows at or after offs[-1] belong to no group and are zero in every output (dim0
      included), as in that padded form. The boundaries are computed on the device from offs (no
      host sync).

Backends: "torch" (the reference: torch_cast's quantize followed by its dequantize, CPU or GPU;
padding and gathering for the rows layout) and "triton" (on CPU under TRITON_INTERPRET=1): the
rows-layout kernel for dim0 and for the rows layout, the tile-transposing kernel for the dim1
modes stored transposed. A recipe's "cuda" cast kernel maps to the Triton qdq (there is no CUDA qdq
kernel). The ops are `torch.library` custom ops with fake implementations (torch.compile
fullgraph); eager calls run the body directly. Under torch.compile the Triton kernel on CUDA is
decomposed into its launches for inductor (`_functional_decomp`, docs/training-ops.md).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor
from torch._subclasses.functional_tensor import FunctionalTensorMode

from mxmoe.formats import OUTPUT_DTYPES, CastSpec, check_input_dtype
from mxmoe.quant.backends import cdiv, next_pow2, triton_interpret
from mxmoe.quant.checks import spec_of
from mxmoe.quant.groups import group_padding, in_groups, pad_groups
from mxmoe.recipe import DEFAULT_RECIPE, MXRecipe

QDQ_KERNELS = ("torch", "triton")
LAYOUTS = ("transposed", "rows")
DIM1_NONE, DIM1_QDQ, DIM1_MX, DIM1_ROWS = 0, 1, 2, 3
"""What the dim1 half of `mxmoe::qdq` writes: nothing, dequantized values stored transposed, the
MX cast, or dequantized values in x's layout (group-aware with offs)."""


def qdq_kernel(kernel: str, device: torch.device) -> str:
    """The qdq backend for a recipe's cast kernel choice on `device`: "torch" for "torch" and for
    "auto" off CUDA, "triton" otherwise (CUDA, or the interpreter for an explicit "triton")."""
    if kernel == "torch" or (kernel == "auto" and device.type != "cuda"):
        return "torch"
    if kernel not in ("auto", "triton", "cuda"):
        raise ValueError(
            f"kernel={kernel!r} is not a cast kernel; expected 'auto', 'torch', 'triton' or 'cuda'"
        )
    if device.type == "cuda" or (kernel == "triton" and device.type == "cpu" and triton_interpret()):
        return "triton"
    raise RuntimeError(
        f"kernel={kernel!r}: the qdq kernel needs a CUDA tensor (got a {device.type} tensor), or "
        "TRITON_INTERPRET=1 for kernel='triton' on CPU"
    )


# ----------------------------------------------------------------------------------------------
# torch backend (reference)
# ----------------------------------------------------------------------------------------------


def _torch_qdq(
    x: Tensor, spec: CastSpec, out_dtype: torch.dtype, dim0: bool, dim1: int, offs: Tensor | None
) -> list[Tensor]:
    """x (B, R, C) contiguous -> the outputs listed in `qdq_op`, via torch_cast quantize+dequantize."""
    from mxmoe.quant import torch_cast

    B, R, C = x.shape
    bs = spec.block_size
    outs: list[Tensor] = []
    if dim0:
        q, s = torch_cast.quantize_dim0(x.reshape(B * R, C), spec)
        y0 = torch_cast.dequantize(q, s, bs, out_dtype).view(B, R, C)
        if offs is not None:  # rows in no group are zero
            zero = torch.zeros((), dtype=out_dtype, device=x.device)
            y0 = torch.where(in_groups(offs, R), y0[0], zero).unsqueeze(0)
        outs.append(y0)
    if dim1 == DIM1_ROWS:  # 2D: pad (each group, or the end) to whole blocks, cast, gather back
        x2 = x[0]
        if offs is None:
            pos, xp = None, torch.nn.functional.pad(x2, (0, 0, 0, -R % bs))
        else:
            pos, _, cap = group_padding(offs, R, bs)
            xp = pad_groups(x2, offs, pos, cap)
        q, s = torch_cast.quantize_dim0(xp.t().contiguous(), spec)
        y1 = torch_cast.dequantize(q, s, bs, out_dtype).t()
        outs.append((y1[:R] if pos is None else y1.index_select(0, pos)).unsqueeze(0))
    elif dim1:
        xt = x.transpose(1, 2).contiguous().view(B * C, R)  # (B, C, R): blocks along R contiguous
        q, s = torch_cast.quantize_dim0(xt, spec)
        if dim1 == DIM1_QDQ:
            outs.append(torch_cast.dequantize(q, s, bs, out_dtype).view(B, C, R))
        else:
            outs += [q.view(B, C, R), s.view(B, C, R // bs)]
    return outs


# ----------------------------------------------------------------------------------------------
# Triton backend
# ----------------------------------------------------------------------------------------------

_TILE = 64  # rows and columns per program (elements 64 x 64: 16 per thread at 8 warps)
_MAX_BS = 128  # the tile holds whole blocks both ways: (bs, bs) at least
# Rows-layout kernel: one dim1 block (bs rows) x _ROWS_WARPS * 64 columns per tile, 64 elements
# (bf16) per thread; each program does up to _ROWS_ITERS column tiles (amortizing the group
# lookup; one value: one compiled variant per format), e.g. 2056 x 7 programs for 65536 x 7168 in
# 8 groups, 512 x 4 for 16384 x 4096.
_ROWS_WARPS = 4
_ROWS_ITERS = 4
_MAX_GROUPS = 4096  # offs entries the rows kernel reads per program (in powers of two from 128)


def _launcher(kernel, traced: bool):
    """`kernel`, or `wrap_triton(kernel)` while AOTAutograd decomposes the op for inductor, which
    then launches the kernel from its generated code."""
    if not traced:
        return kernel
    from torch.library import wrap_triton

    return wrap_triton(kernel)


def _rows_tile(bs: int, elem_size: int) -> dict:
    """(NSL, W, RS, NB) of the rows kernel: a warp's 32 lanes cover RS rows x NB blocks of bs
    columns with 16-byte vectors (8 bf16 / 4 fp32 elements per lane); NSL = bs / RS slices per
    thread."""
    vec = 16 // elem_size
    lanes_k = max(1, min(32, bs // vec))
    nb = max(1, min(32 // lanes_k, 64 // bs))  # a warp's lanes cover at least 64 columns
    rs = max(1, min(bs, 32 // (lanes_k * nb)))
    return dict(NSL=bs // rs, W=_ROWS_WARPS, RS=rs, NB=nb)


@functools.cache
def _rows_launch(spec: CastSpec, in_bf16: bool, out_bf16: bool, dim0: bool, dim1: bool, grouped: bool,
                 soft: bool) -> tuple[dict, int]:
    """The rows kernel's compile-time arguments for one configuration and its columns per tile
    (built once: a launch then costs Triton's own argument handling only)."""
    from mxmoe.quant.triton_cast import _spec_args

    bs = spec.block_size
    tile = _rows_tile(bs, 2 if in_bf16 else 4)
    consts = dict(BS=bs, N_ITER=_ROWS_ITERS, GROUPED=grouped, IN_BF16=in_bf16, OUT_BF16=out_bf16,
                  DIM0=dim0, DIM1=dim1, num_warps=_ROWS_WARPS, **tile, **_spec_args(spec, soft))
    return consts, tile["W"] * tile["NB"] * bs


def _triton_qdq_rows(x: Tensor, spec: CastSpec, out_dtype: torch.dtype, dim0: bool, dim1: bool,
                     offs: Tensor | None, outs, traced: bool = False) -> None:
    """The rows-layout kernel on x (T, C): y0 and/or y1 (T, C) in `outs`. traced: launched through
    `torch.library.wrap_triton` (the op's decomposition for inductor, `_functional_decomp`)."""
    from mxmoe.quant.triton_qdq import qdq_rows_kernel

    T, C = x.shape
    bs = spec.block_size
    if x.numel() == 0:
        return
    in_bf16, out_bf16 = x.dtype == torch.bfloat16, out_dtype == torch.bfloat16
    consts, bct = _rows_launch(spec, in_bf16, out_bf16, dim0, dim1, offs is not None,
                               x.device.type != "cuda" or triton_interpret())
    E = 0 if offs is None else offs.shape[0]
    # blocks: sum of ceil(n_e / bs) <= floor((offs[-1] + (bs-1) E) / bs), plus ceil(tail / bs) for
    # the rows after the last group: <= cdiv(T + (bs-1) E, bs) (the padded size of mxmoe.quant.groups)
    row_blocks = cdiv(T + (bs - 1) * E, bs)
    progs_c = cdiv(cdiv(C, bct), _ROWS_ITERS)
    bits = torch.int16 if out_bf16 else torch.int32
    it = iter(outs)
    y0 = next(it).view(bits) if dim0 else x
    y1 = next(it).view(bits) if dim1 else x
    _launcher(qdq_rows_kernel, traced)[(row_blocks, progs_c)](
        x.view(torch.int16) if in_bf16 else x.view(torch.int32), y0, y1,
        x if offs is None else offs, T, C, E,
        EP=max(128, next_pow2(int(E))) if E else 128,
        # above the largest offset a program forms (masked too); a bool also for symbolic shapes
        I64=bool(row_blocks * bs * C + bct >= 2**31),
        **consts,
    )


def _triton_qdq(x: Tensor, spec: CastSpec, out_dtype: torch.dtype, dim0: bool, dim1: int, outs,
                traced: bool = False):
    B, R, C = x.shape
    bs = spec.block_size
    if x.numel() == 0:
        return
    br = max(bs, min(_TILE, next_pow2(int(R))))
    bc = max(bs, min(_TILE, next_pow2(int(C))))
    grid = (cdiv(R, br), cdiv(C, bc), B)
    if grid[1] > 65535 or B > 65535:
        raise ValueError(f"x of shape {tuple(x.shape)} is too large for the qdq kernel's grid")
    bits = torch.int16 if out_dtype == torch.bfloat16 else torch.int32
    it = iter(outs)
    y0 = next(it).view(bits) if dim0 else x
    if dim1 == DIM1_QDQ:
        y1, s1 = next(it).view(bits), x
    elif dim1 == DIM1_MX:
        y1, s1 = next(it).view(torch.uint8), next(it).view(torch.uint8)
    else:
        y1 = s1 = x
    from mxmoe.quant.triton_cast import _spec_args
    from mxmoe.quant.triton_qdq import qdq_triton_kernel

    _launcher(qdq_triton_kernel, traced)[grid](
        x.view(torch.int16) if x.dtype == torch.bfloat16 else x.view(torch.int32), y0, y1, s1, R, C,
        BS=bs, BR=br, BC=bc, IN_BF16=x.dtype == torch.bfloat16, OUT_BF16=out_dtype == torch.bfloat16,
        DIM0=dim0, DIM1=dim1, num_warps=8,
        # software rounding under the interpreter, whose fp32 -> fp8 conversion misrounds
        **_spec_args(spec, x.device.type != "cuda" or triton_interpret()),
    )


# ----------------------------------------------------------------------------------------------
# The custom op
# ----------------------------------------------------------------------------------------------


def _empty_outputs(x: Tensor, elem_dtype, out_dtype, block_size: int, dim0: bool, dim1: int) -> list[Tensor]:
    outs = []
    if dim0:
        outs.append(torch.empty(x.shape, dtype=out_dtype, device=x.device))
    if dim1 == DIM1_QDQ or dim1 == DIM1_MX:
        B, R, C = x.shape
        if dim1 == DIM1_QDQ:
            outs.append(torch.empty((B, C, R), dtype=out_dtype, device=x.device))
        else:
            outs.append(torch.empty((B, C, R), dtype=elem_dtype, device=x.device))
            outs.append(torch.empty((B, C, R // block_size), dtype=torch.float8_e8m0fnu, device=x.device))
    elif dim1 == DIM1_ROWS:
        outs.append(torch.empty(x.shape, dtype=out_dtype, device=x.device))
    return outs


@torch.library.custom_op("mxmoe::qdq", mutates_args=())
def qdq_op(
    x: Tensor,
    block_size: int,
    scaling_mode: str,
    elem_dtype: torch.dtype,
    out_dtype: torch.dtype,
    dim0: bool,
    dim1: int,
    kernel: str,
    offs: Tensor | None = None,
) -> list[Tensor]:
    """x (B, R, C) bf16/fp32 contiguous, C % block_size == 0 (and R % block_size == 0 when dim1 is
    1 or 2; B == 1 when dim1 is 3 or offs is given). When dim1 is 0 or 3 x may also be 2D (R, C)
    (the public 2D calls pass it so, saving the reshapes): the row-major outputs are then 2D too.

    Returns, in order: if dim0, y0 (B, R, C) out_dtype = MX-rounded along C; if dim1 == 1, y1
    (B, C, R) out_dtype = MX-rounded along R, stored transposed; if dim1 == 2, q1 (B, C, R)
    elem_dtype and s1 (B, C, R // block_size) float8_e8m0fnu = the MX cast along R (to_mx's
    storage); if dim1 == 3, y1 (B, R, C) out_dtype = MX-rounded along R in x's layout, blocks
    starting at every group start when offs is given. offs: None, or (E,) int32 cumulative group
    ends on x's device (dim1 0 or 3); rows at or after offs[-1] are zero in every output. All
    contiguous. kernel: "torch" | "triton" (concrete, see `qdq_kernel`).
    """
    return _qdq_impl(x, block_size, scaling_mode, elem_dtype, out_dtype, dim0, dim1, kernel, offs)


def _qdq_impl(
    x, block_size, scaling_mode, elem_dtype, out_dtype, dim0, dim1, kernel, offs=None, *, traced=False
) -> list[Tensor]:
    """qdq_op's body, called directly in eager mode (a custom op call costs tens of microseconds of
    Python); arguments already checked. traced: the Triton launches go through wrap_triton
    (`_functional_decomp`)."""
    spec = spec_of(block_size, scaling_mode, elem_dtype)
    if kernel == "torch":
        if x.numel() == 0:
            return _empty_outputs(x, elem_dtype, out_dtype, block_size, dim0, dim1)
        if x.ndim == 2:
            return [t.contiguous().view(x.shape)
                    for t in _torch_qdq(x.unsqueeze(0), spec, out_dtype, dim0, dim1, offs)]
        return [t.contiguous() for t in _torch_qdq(x, spec, out_dtype, dim0, dim1, offs)]
    if kernel != "triton":
        raise ValueError(f"kernel={kernel!r} is not a qdq kernel; expected one of {list(QDQ_KERNELS)}")
    outs = _empty_outputs(x, elem_dtype, out_dtype, block_size, dim0, dim1)
    if dim1 in (DIM1_NONE, DIM1_ROWS):  # every row-major output: the rows kernel on (B * R, C)
        if x.ndim == 2:
            _triton_qdq_rows(x, spec, out_dtype, dim0, dim1 == DIM1_ROWS, offs, outs, traced)
        else:
            _triton_qdq_rows(x.view(-1, x.shape[-1]), spec, out_dtype, dim0, dim1 == DIM1_ROWS, offs,
                             [t.view(-1, x.shape[-1]) for t in outs], traced)
    else:
        _triton_qdq(x, spec, out_dtype, dim0, dim1, outs, traced)
    return outs


@qdq_op.register_fake
def _(x, block_size, scaling_mode, elem_dtype, out_dtype, dim0, dim1, kernel, offs=None):
    return _empty_outputs(x, elem_dtype, out_dtype, block_size, dim0, dim1)


def _op_args(x, block_size, scaling_mode, elem_dtype, out_dtype, dim0, dim1, kernel, offs=None) -> tuple:
    return x, block_size, scaling_mode, elem_dtype, out_dtype, dim0, dim1, kernel, offs


def _functional_decomp(mode, op, types, args=(), kwargs=None):
    """How AOTAutograd (torch.compile's functionalization) sees `mxmoe::qdq`: for the Triton kernel
    on CUDA tensors, as its body with the launches wrapped by `torch.library.wrap_triton` (what
    `torch.library.triton_op` does), so that inductor launches the kernel from its generated code
    instead of calling back into this op's Python for every launch; anything else (the torch
    kernel, CPU tensors, the Triton interpreter, torch.export) stays the opaque op with its fake
    implementation."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor

    full = _op_args(*args, **(kwargs or {}))
    x, kernel = full[0], full[7]
    decompose = (
        kernel == "triton"
        and x.is_cuda
        and not triton_interpret()  # interpreted kernels cannot be wrapped (they run on the data)
        and getattr(torch._functorch.config, "decompose_custom_triton_ops", True)  # False: torch.export
        and all(issubclass(t, (FakeTensor, FunctionalTensor)) or t is Tensor for t in types)
    )
    if not decompose:
        return mode.__torch_dispatch__(op, types, args, kwargs or {})
    with mode:
        return _qdq_impl(*full, traced=True)


qdq_op.register_torch_dispatch(FunctionalTensorMode, _functional_decomp)


def _qdq(*args) -> list[Tensor]:
    """qdq_op while torch.compile traces (or autograd records x); its body directly otherwise
    (inside a profiler range named "mxmoe::qdq" when the profiler is on)."""
    x = args[0]
    if torch.compiler.is_compiling() or (x.requires_grad and torch.is_grad_enabled()):
        return qdq_op(*args)
    if torch.autograd._profiler_enabled():
        with torch.profiler.record_function("mxmoe::qdq"):
            return _qdq_impl(*args)
    return _qdq_impl(*args)


# ----------------------------------------------------------------------------------------------
# Python API
# ----------------------------------------------------------------------------------------------


def _check(x: Tensor, recipe: MXRecipe, out_dtype: torch.dtype, axes: tuple[int, ...]) -> None:
    """The one argument check of a public qdq call: x as the caller gave it, axes (-1 and/or -2)
    that must be whole blocks."""
    if not isinstance(recipe, MXRecipe):
        raise TypeError(f"recipe must be an mxmoe.MXRecipe, got {type(recipe).__name__}")
    check_input_dtype("x", x)
    if out_dtype not in OUTPUT_DTYPES:
        raise TypeError(f"out_dtype={out_dtype} is not supported; expected one of {list(OUTPUT_DTYPES)}")
    for ax in axes:
        if x.shape[ax] % recipe.block_size:
            raise ValueError(
                f"x.shape[{ax}]={x.shape[ax]} (x {tuple(x.shape)}) is not divisible by "
                f"block_size={recipe.block_size}"
            )


def _check_rows(x: Tensor, layout: str, offs: Tensor | None, recipe: MXRecipe, kernel: str) -> bool:
    """Checks `layout` and `offs`; whether the dim1 result is in rows layout."""
    if not isinstance(recipe, MXRecipe):
        raise TypeError(f"recipe must be an mxmoe.MXRecipe, got {type(recipe).__name__}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}; expected one of {list(LAYOUTS)}")
    if (layout == "rows" or offs is not None) and x.ndim != 2:
        raise ValueError(f"x must be 2D (T, C) for layout='rows' or offs, got shape {tuple(x.shape)}")
    if kernel == "triton" and recipe.block_size > _MAX_BS:
        raise ValueError(
            f"block_size={recipe.block_size}: the Triton qdq kernel supports block sizes up to {_MAX_BS}"
        )
    if offs is not None:
        if not isinstance(offs, Tensor) or offs.ndim != 1 or offs.dtype != torch.int32:
            got = f"{offs.dtype} of shape {tuple(offs.shape)}" if isinstance(offs, Tensor) else repr(offs)
            raise TypeError(
                "offs must be a 1D torch.int32 tensor of cumulative group ends (as torch._grouped_mm), "
                f"got {got}"
            )
        if not 1 <= offs.shape[0] <= _MAX_GROUPS:
            raise ValueError(f"offs has {offs.shape[0]} groups; expected 1 to {_MAX_GROUPS}")
        if offs.device != x.device:
            raise ValueError(f"offs is on {offs.device} but x on {x.device}; they must share a device")
    return layout == "rows"


def _as3d(x: Tensor) -> Tensor:
    if x.ndim < 2:
        raise ValueError(f"x must have at least 2 dims for qdq, got shape {tuple(x.shape)}")
    return x.contiguous().view(-1, x.shape[-2], x.shape[-1])


def qdq(
    x: Tensor,
    axis: int = -1,
    *,
    recipe: MXRecipe = DEFAULT_RECIPE,
    out_dtype: torch.dtype | None = None,
    offs: Tensor | None = None,
    layout: str = "transposed",
) -> Tensor:
    """`to_mx(x, axis, recipe=recipe).dequantize(out_dtype)` in one pass, bit for bit.

    x: bf16/fp32, ndim >= 2, any strides (made contiguous); axis -1 (blocks along the last dim,
    kernel recipe.dim0_kernel) or -2 (blocks along dim -2, kernel recipe.dim1_kernel);
    x.shape[-1] % recipe.block_size == 0. out_dtype: bf16 or fp32 (default x.dtype).
    Returns x's shape in out_dtype: axis -1 row-major contiguous; axis -2 with layout="transposed"
    (x.shape[-2] % block_size == 0) stored with the last two dims swapped (a transposed view of a
    contiguous tensor), as the dequantized dim1 cast is; with layout="rows" (2D x (T, C), any T)
    row-major contiguous, the last block short (the zero-padded cast's values).
    offs: None, or (E,) int32 cumulative group ends on x's device (2D x; axis -1, or axis -2 with
    layout="rows"): blocks along T start at every group start; rows at or after offs[-1] are zero
    (module docstring).
    """
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if axis not in (-1, -2, x.ndim - 1, x.ndim - 2):
        raise ValueError(f"axis={axis!r}; expected -1 or -2 (blocks along one of the last two dims)")
    dim1 = axis in (-2, x.ndim - 2)
    kernel = qdq_kernel(getattr(recipe, "dim1_kernel" if dim1 else "dim0_kernel", "torch"), x.device)
    rows = _check_rows(x, layout, offs, recipe, kernel)
    if dim1 and offs is not None and not rows:
        raise ValueError("offs with axis=-2 needs layout='rows' (group blocks in x's own layout)")
    _check(x, recipe, out_dtype, (-1,) if rows or not dim1 else (-2,))
    flat = x.ndim == 2 and (rows or not dim1)  # row-major 2D: the op takes and returns it as is
    x3 = x.contiguous() if flat else _as3d(x)
    offs = None if offs is None else offs.contiguous()  # the kernel reads offs[e] at offs_ptr + e
    if dim1:
        mode = DIM1_ROWS if rows else DIM1_QDQ
    else:
        mode = DIM1_NONE
    (y,) = _qdq(
        x3, recipe.block_size, recipe.scaling_mode, recipe.elem_dtype, out_dtype, not dim1, mode, kernel,
        offs,
    )
    if dim1 and not rows:
        return y.view(*x.shape[:-2], x.shape[-1], x.shape[-2]).transpose(-2, -1)
    return y if flat else y.view(x.shape)


def qdq_dim0_dim1(
    x: Tensor,
    *,
    recipe: MXRecipe = DEFAULT_RECIPE,
    out_dtype: torch.dtype | None = None,
    dim1_mx: bool = False,
    offs: Tensor | None = None,
    layout: str = "transposed",
) -> tuple[Tensor, Tensor] | tuple[Tensor, Tensor, Tensor]:
    """Both directions of a 2D x (R, C), bf16/fp32, C divisible by the block size (and R, unless
    layout="rows"), from one read (kernel recipe.dim1_kernel).

    Returns y0 = qdq(x, -1) ((R, C) contiguous, out_dtype) and y1 = qdq(x, -2, layout=layout, offs=offs):
    layout="transposed": (R, C) logical, stored (C, R) contiguous; layout="rows": (R, C) row-major
    contiguous, any R, group-aware with offs (then rows at or after offs[-1] are zero in y0 too).
    With dim1_mx=True (layout "transposed" only) the dim1 half is instead the MX cast along R as
    (q1 (C, R) elem dtype, s1 (C, R // bs) float8_e8m0fnu), equal to to_mx(x, axis=0)'s
    qdata_blocked and scale_blocked.
    """
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if x.ndim != 2:
        raise ValueError(f"x must be 2D for qdq_dim0_dim1, got shape {tuple(x.shape)}")
    kernel = qdq_kernel(getattr(recipe, "dim1_kernel", "torch"), x.device)
    rows = _check_rows(x, layout, offs, recipe, kernel)
    if offs is not None and not rows:
        raise ValueError("offs needs layout='rows' (group blocks in x's own layout)")
    if dim1_mx and rows:
        raise ValueError("dim1_mx=True gives the MX cast's transposed storage; it needs layout='transposed'")
    _check(x, recipe, out_dtype, (-1,) if rows else (-2, -1))
    offs = None if offs is None else offs.contiguous()  # the kernel reads offs[e] at offs_ptr + e
    if rows:  # 2D in, 2D out (no reshapes)
        y0, y1 = _qdq(x.contiguous(), recipe.block_size, recipe.scaling_mode, recipe.elem_dtype, out_dtype,
                      True, DIM1_ROWS, kernel, offs)
        return y0, y1
    mode = DIM1_MX if dim1_mx else DIM1_QDQ
    outs = _qdq(
        x.contiguous().unsqueeze(0), recipe.block_size, recipe.scaling_mode, recipe.elem_dtype, out_dtype,
        True, mode, kernel, offs,
    )
    y0 = outs[0][0]
    if dim1_mx:
        return y0, outs[1][0], outs[2][0]
    return y0, outs[1][0].t()


__all__ = ["LAYOUTS", "QDQ_KERNELS", "qdq", "qdq_dim0_dim1", "qdq_kernel", "qdq_op"]
