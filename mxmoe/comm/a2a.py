"""All-to-alls for expert parallelism: MXFP8 (exact, overlapped) and unquantized (rows in their dtype).

Every function exchanges *rows*: x is (rows_in, ...) ordered by destination rank, `input_splits[p]`
rows go to rank p, and the result is (sum(output_splits), ...) ordered by source rank. Splits are
lists of ints or 1D integer tensors (any device); they may be uneven or zero.

MXFP8 exchanges quantize rows along the last dim with an `MXRecipe` (its elem dtype, block size,
scaling mode and dim0 kernel; default `DEFAULT_RECIPE`: e4m3, blocks of 32, RCEIL) and move the element
bytes plus the E8M0 scale bytes (1 + 1/32 bytes per element instead of 2 for bf16). The result is
bit-for-bit what `reference_mxfp8_a2a` computes (quantize -> all_to_all_single -> dequantize). The
fused kernels (own rows' quantize+dequantize, symmetric memory) serve the default format; other
recipes take the same paths with the generic cast kernels (NCCL/gloo transport).

Transports, chosen by name in one registry (`mxmoe.comm.transport.TRANSPORTS`). On GPUs of one
host (transport "auto" or "symm") one kernel per exchange quantizes each peer's rows straight into
that peer's symmetric-memory buffer, does the own rows meanwhile, and dequantizes each received
tile as soon as its flag says it has landed: `mxmoe.comm.symm` explains it. Otherwise ("nccl", or
"auto" with `chunks` given) the process group moves the bytes, overlapped with the casts:
`mxmoe.comm.nccl` explains how. The format (rows quantized with the recipe): `mxmoe.comm.mx_rows`;
the definition every exchange matches: `mxmoe.comm.reference`. This module: the differentiable
public functions. The same exchanges as custom ops for compiled code: `mxmoe.comm.custom_ops`.

Timeouts: nothing here waits without a bound; a peer that never joins is reported by the process
group's timeout (`init_process_group(timeout=...)`; NCCL's watchdog aborts the collective).
"""

from __future__ import annotations

import torch
from torch import Tensor

from mxmoe.comm.mx_rows import _kernel, _recipe, quantize_rows
from mxmoe.comm.nccl import PIPELINE_MIN_ELEMS, _use_pipeline, all_to_all_rows  # noqa: F401 (importable from here as before)
from mxmoe.comm.reference import reference_mxfp8_a2a
from mxmoe.comm.splits import check_and_plan
from mxmoe.comm.transport import Plan, row_transport
from mxmoe.formats import MXFormat
from mxmoe.ops.gemm import first_order
from mxmoe.quant.mx_tensor import MXTensor, make_grad_anchor, mx_tensor_trusted
from mxmoe.recipe import MXRecipe

__all__ = [  # (with names of mx_rows, nccl and reference, importable from here as before)
    "PIPELINE_MIN_ELEMS", "a2a_combine", "a2a_dispatch_mxfp8", "a2a_unquantized", "all_to_all_rows",
    "quantize_rows", "reference_mxfp8_a2a", "to_mxfp8_a2a_dequant",
]


# --------------------------------------------------------------------------------------------
# The exchanges (transports chosen by name in mxmoe.comm.transport.TRANSPORTS)
# --------------------------------------------------------------------------------------------


def mx_exchange(
    x: Tensor,
    plan: Plan,
    group,
    fmt: MXFormat,
    kernel: str,
    dequant: bool,
    chunks: int | None,
    transport: str = "nccl",
):
    """Quantize x's rows in format `fmt` (cast kernel `kernel`, concrete), exchange per plan, and
    (if dequant) dequantize: y (rows_out, dim) x.dtype, else (q (rows_out, dim) fmt.elem_dtype,
    s (rows_out, dim // fmt.block_size) fmt.scale_dtype). `transport`: "auto" or a registered
    name, the same on every rank (the choice reads facts every rank shares: the device type, the
    group, the format, whether `chunks` was given)."""
    x = x.contiguous()
    t = row_transport(transport, x, group, fmt, chunks, plan.world)
    return t.mx_exchange(x, plan, group, fmt, kernel, dequant, chunks)


def _mx_exchange(
    x: Tensor, plan: Plan, group, r: MXRecipe, dequant: bool, chunks: int | None, transport: str = "nccl"
):
    """`mx_exchange` in r's format with r's dim0_kernel."""
    return mx_exchange(x, plan, group, r.fmt, _kernel(r, x.device), dequant, chunks, transport)


def _exchange_unquantized(x: Tensor, plan: Plan, group, transport: str = "nccl") -> Tensor:
    """x's rows moved per plan in their own dtype."""
    x = x.contiguous()
    return row_transport(transport, x, group, None, None, plan.world).exchange(x, plan, group)


# --------------------------------------------------------------------------------------------
# Autograd functions
# --------------------------------------------------------------------------------------------


class _MXA2A(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, plan, group, r, chunks, transport):
        ctx.args = (plan, group, r, chunks, transport)
        return _mx_exchange(x, plan, group, r, True, chunks, transport)

    @staticmethod
    @first_order("mxmoe.comm.to_mxfp8_a2a_dequant")
    def backward(ctx, grad):
        plan, group, r, chunks, transport = ctx.args
        y = _mx_exchange(grad, plan.reversed(), group, r, True, chunks, transport)
        return y, None, None, None, None, None


class _UnquantizedA2A(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, plan, group):
        ctx.args = (plan, group)
        return _exchange_unquantized(x, plan, group)

    @staticmethod
    def backward(ctx, grad):
        plan, group = ctx.args
        return _exchange_unquantized(grad, plan.reversed(), group), None, None


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, plan, group, r, chunks, transport):
        ctx.args = (plan, group, transport)
        q, s = _mx_exchange(x, plan, group, r, False, chunks, transport)
        anchor = make_grad_anchor((q.shape[0], q.shape[1]), x.dtype, x.device)
        ctx.mark_non_differentiable(q, s)
        return anchor, q, s

    @staticmethod
    def backward(ctx, grad, _gq, _gs):
        plan, group, transport = ctx.args
        return _exchange_unquantized(grad, plan.reversed(), group, transport), None, None, None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, plan, group, r, chunks, transport):
        ctx.args = (plan, group, r, chunks, transport)
        return _exchange_unquantized(x, plan, group, transport)

    @staticmethod
    @first_order("mxmoe.comm.a2a_combine")
    def backward(ctx, grad):
        plan, group, r, chunks, transport = ctx.args
        y = _mx_exchange(grad, plan.reversed(), group, r, True, chunks, transport)
        return y, None, None, None, None, None


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------


def _recipe_and_plan(
    fn: str, x: Tensor, output_splits, input_splits, group, check: bool, chunks: int | None,
    transport: str, recipe: MXRecipe | None,
) -> tuple[MXRecipe, Plan]:
    """The recipe and the checked plan of one MX exchange call `fn` (its arguments, checked once)."""
    r = _recipe(recipe, fn)
    plan = check_and_plan(
        fn, x, output_splits, input_splits, group,
        check=check, chunks=chunks, transport=transport, fmt=r.fmt,
    )
    return r, plan


def to_mxfp8_a2a_dequant(
    x: Tensor,
    output_splits,
    input_splits,
    group=None,
    *,
    check: bool = True,
    chunks: int | None = None,
    transport: str = "auto",
    recipe: MXRecipe | None = None,
) -> Tensor:
    """MXFP8 all-to-all of rows, dequantized on arrival; differentiable (backward: the same MXFP8
    exchange of the gradient, in reverse).

    x: (sum(input_splits), dim) bfloat16 or float32, dim % block_size == 0, rows ordered by destination.
    Returns (sum(output_splits), dim), x.dtype, contiguous, rows ordered by source rank; bit for bit
    `reference_mxfp8_a2a` with the same recipe. check: one small all_gather validating every rank's
    arguments (every rank raises if one is bad). chunks: None = auto (pipelined on CUDA for large
    tensors, else simple), 0 = simple, k >= 1 = pipelined with up to k pieces per pair of ranks (must
    be equal on all ranks). recipe: the `MXRecipe` whose elem_dtype, block_size, scaling_mode and
    dim0_kernel (the cast kernel of the quantize and dequantize; "auto": the fastest available) the
    exchange uses (None: DEFAULT_RECIPE, RCEIL e4m3 blocks of 32, "auto"); give the model's recipe
    so that EP and EP=1 quantize alike. transport: "symm" (quantize straight into the peers' symmetric-memory
    buffers: `mxmoe.comm.symm`; CUDA, NCCL group on one host, default format), "nccl" (the process
    group's all-to-all or the `chunks` pipeline) or "auto" (symm where it can run, the format is the
    default and chunks is None, else nccl); equal on all ranks.
    """
    r, plan = _recipe_and_plan(
        "to_mxfp8_a2a_dequant", x, output_splits, input_splits, group, check, chunks, transport, recipe
    )
    return _MXA2A.apply(x, plan, group, r, chunks, transport)


def a2a_dispatch_mxfp8(
    x: Tensor,
    output_splits,
    input_splits,
    group=None,
    *,
    check: bool = True,
    chunks: int | None = None,
    transport: str = "auto",
    recipe: MXRecipe | None = None,
) -> MXTensor:
    """MXFP8 all-to-all of rows without dequantizing, for an MX expert GEMM.

    x: (sum(input_splits), dim) bfloat16 or float32, dim % block_size == 0. Returns a 2D MXTensor
    quantized along axis=1 with the recipe (default RCEIL, e4m3, blocks of 32): storage qdata
    (sum(output_splits), dim) elem_dtype, scale (rows, dim // block_size) e8m0, orig_dtype x.dtype, and
    `grad_anchor`, a zero-stride (rows, dim) tensor whose gradient (the high-precision gradient of the
    dequantized rows) is sent back to x's rows with a plain high-precision all-to-all. Consumers take
    `mx.grad_anchor` as their differentiable input.
    check, chunks, transport, recipe: as in `to_mxfp8_a2a_dequant`.
    """
    r, plan = _recipe_and_plan(
        "a2a_dispatch_mxfp8", x, output_splits, input_splits, group, check, chunks, transport, recipe
    )
    anchor, q, s = _Dispatch.apply(x, plan, group, r, chunks, transport)
    return mx_tensor_trusted(q, s, 1, r.block_size, r.scaling_mode, x.dtype, anchor)


def a2a_combine(
    x: Tensor,
    output_splits,
    input_splits,
    group=None,
    *,
    check: bool = True,
    chunks: int | None = None,
    transport: str = "auto",
    recipe: MXRecipe | None = None,
) -> Tensor:
    """High-precision all-to-all of rows whose backward exchanges the gradient in MXFP8.

    x: (sum(input_splits), dim) bfloat16 or float32, dim % block_size == 0. Returns
    (sum(output_splits), dim), x.dtype. Backward: the gradient (rows_out, dim) is quantized with the
    recipe (default RCEIL, e4m3, blocks of 32), sent back with the splits swapped and dequantized to
    x.dtype, exactly like `to_mxfp8_a2a_dequant`'s forward.
    check, chunks, transport, recipe: as in `to_mxfp8_a2a_dequant`.
    """
    r, plan = _recipe_and_plan(
        "a2a_combine", x, output_splits, input_splits, group, check, chunks, transport, recipe
    )
    return _Combine.apply(x, plan, group, r, chunks, transport)


def a2a_unquantized(x: Tensor, output_splits, input_splits, group=None, *, check: bool = True) -> Tensor:
    """Differentiable all-to-all of rows in x's own dtype (the exchange of high-precision experts,
    or of MX experts with the MXFP8 exchange off).

    x: (sum(input_splits), ...) any dtype. Returns (sum(output_splits), ...), contiguous. Backward:
    the same exchange of the gradient in reverse. check: as in `to_mxfp8_a2a_dequant`.
    """
    plan = check_and_plan("a2a_unquantized", x, output_splits, input_splits, group, check=check, mx=False)
    return _UnquantizedA2A.apply(x, plan, group)
