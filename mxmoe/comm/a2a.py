"""All-to-alls for expert parallelism: MXFP8 (exact, overlapped) and plain high precision.

Every function exchanges *rows*: x is (rows_in, ...) ordered by destination rank, `input_splits[p]`
rows go to rank p, and the result is (sum(output_splits), ...) ordered by source rank. Splits are
lists of ints or 1D integer tensors (any device); they may be uneven or zero.

MXFP8 exchanges quantize rows along the last dim with an `MXRecipe` (its elem dtype, block size,
scaling mode and dim0 kernel; default `DEFAULT_RECIPE`: e4m3, blocks of 32, RCEIL) and move the element
bytes plus the E8M0 scale bytes (1 + 1/32 bytes per element instead of 2 for bf16). The result is
bit-for-bit what `reference_mxfp8_a2a` computes (quantize -> all_to_all_single -> dequantize). The
fused kernels (own rows' quantize+dequantize, symmetric memory) serve the default format; other
recipes take the same paths with the generic cast kernels (NCCL/gloo transport).

Transports. On GPUs of one host (transport "auto" or "symm") one kernel per exchange quantizes each
peer's rows straight into that peer's symmetric-memory buffer, does the own rows meanwhile, and
dequantizes each received tile as soon as its flag says it has landed: `mxmoe.comm.symm` explains
it. Otherwise ("nccl", or "auto" with `chunks` given) the process group moves the bytes, overlapped
with the casts: `mxmoe.comm.nccl` explains how. The format (rows quantized with the recipe):
`mxmoe.comm.mx_rows`; the definition every exchange matches: `mxmoe.comm.reference`. This module:
the transport choice and the differentiable public functions.

Timeouts: nothing here waits without a bound; a peer that never joins is reported by the process
group's timeout (`init_process_group(timeout=...)`; NCCL's watchdog aborts the collective).
"""

from __future__ import annotations

import torch
from torch import Tensor

from mxmoe.comm.mx_rows import _dequantize, _fast, _kernel, _quantize, _recipe, quantize_rows
from mxmoe.comm.nccl import (
    PIPELINE_MIN_ELEMS,
    _pipelined_mx_exchange,
    _simple_mx_exchange,
    _use_pipeline,
    all_to_all_rows,
)
from mxmoe.comm.reference import reference_mxfp8_a2a
from mxmoe.comm.splits import Plan, check_and_plan
from mxmoe.comm.symm import SymmWorkspace, symm_mx_exchange, symm_usable
from mxmoe.quant.mx_tensor import MXTensor, make_grad_anchor, mx_tensor_trusted
from mxmoe.recipe import MXRecipe

__all__ = [  # (with names of mx_rows, nccl and reference, importable from here as before)
    "PIPELINE_MIN_ELEMS", "a2a_combine", "a2a_dispatch_mxfp8", "all_to_all_hp", "all_to_all_rows",
    "quantize_rows", "reference_mxfp8_a2a", "to_mxfp8_a2a_dequant",
]


# --------------------------------------------------------------------------------------------
# The MXFP8 exchange: transport choice
# --------------------------------------------------------------------------------------------


def _pick_transport(x: Tensor, plan: Plan, group, chunks: int | None, transport: str, r: MXRecipe) -> str:
    """Returns "symm" or "nccl" (NCCL, or gloo on CPU): the same on every rank, from facts every rank
    shares. auto: symmetric memory when it can run here, the format is the default one and no `chunks`
    asks for the NCCL pipeline."""
    if transport == "nccl" or plan.world == 1:
        return "nccl"
    usable = symm_usable(group, x.device)
    if transport == "symm":
        if not usable:
            raise RuntimeError(
                "transport='symm' needs CUDA tensors, an NCCL process group of GPUs on one host, "
                "torch.distributed._symmetric_memory and triton; use transport='nccl' or 'auto'"
            )
        if not _fast(r):
            raise ValueError(
                f"transport='symm' exchanges the default format only (RCEIL, e4m3, blocks of 32); the "
                f"recipe asks for {r.scaling_mode}, {r.elem_dtype}, blocks of {r.block_size}: use "
                "transport='nccl' or 'auto'"
            )
        return "symm"
    return "symm" if usable and chunks is None and _fast(r) else "nccl"


def _mx_exchange(
    x: Tensor,
    plan: Plan,
    group,
    r: MXRecipe,
    dequant: bool,
    chunks: int | None,
    transport: str = "nccl",
):
    """Quantize x's rows in r's format, exchange per plan, and (if dequant) dequantize: y (rows_out,
    dim) x.dtype, else (q (rows_out, dim) r.elem_dtype, s (rows_out, dim // r.block_size) e8m0)."""
    x = x.contiguous()
    k = _kernel(r, x.device)
    if _pick_transport(x, plan, group, chunks, transport, r) == "symm":
        ws = SymmWorkspace.get(group, x.device)
        return symm_mx_exchange(x, plan.input_splits, plan.output_splits, plan.rank, ws, k, dequant)
    pipelined = _use_pipeline(x.is_cuda, plan, chunks)
    if plan.world == 1 and not pipelined:
        q, s = _quantize(x, r, k)
        return _dequantize(q, s, x.dtype, r, k) if dequant else (q, s)
    if pipelined:
        return _pipelined_mx_exchange(x, plan, group, r, k, dequant, chunks)
    return _simple_mx_exchange(x, plan, group, r, k, dequant)


def _hp_exchange(x: Tensor, plan: Plan, group) -> Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(plan.output_splits), *x.shape[1:]))
    return all_to_all_rows(out, x, plan.output_splits, plan.input_splits, group)


# --------------------------------------------------------------------------------------------
# Autograd functions
# --------------------------------------------------------------------------------------------


class _MXA2A(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, plan, group, r, chunks, transport):
        ctx.args = (plan, group, r, chunks, transport)
        return _mx_exchange(x, plan, group, r, True, chunks, transport)

    @staticmethod
    def backward(ctx, grad):
        plan, group, r, chunks, transport = ctx.args
        y = _mx_exchange(grad, plan.reversed(), group, r, True, chunks, transport)
        return y, None, None, None, None, None


class _HPA2A(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, plan, group):
        ctx.args = (plan, group)
        return _hp_exchange(x, plan, group)

    @staticmethod
    def backward(ctx, grad):
        plan, group = ctx.args
        return _hp_exchange(grad, plan.reversed(), group), None, None


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, plan, group, r, chunks, transport):
        ctx.args = (plan, group)
        q, s = _mx_exchange(x, plan, group, r, False, chunks, transport)
        anchor = make_grad_anchor((q.shape[0], q.shape[1]), x.dtype, x.device)
        ctx.mark_non_differentiable(q, s)
        return anchor, q, s

    @staticmethod
    def backward(ctx, grad, _gq, _gs):
        plan, group = ctx.args
        return _hp_exchange(grad, plan.reversed(), group), None, None, None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, plan, group, r, chunks, transport):
        ctx.args = (plan, group, r, chunks, transport)
        return _hp_exchange(x, plan, group)

    @staticmethod
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
        check=check, chunks=chunks, transport=transport, block_size=r.block_size,
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


def all_to_all_hp(x: Tensor, output_splits, input_splits, group=None, *, check: bool = True) -> Tensor:
    """Plain differentiable all-to-all of rows in x's own dtype (bf16 expert parallelism).

    x: (sum(input_splits), ...) any dtype. Returns (sum(output_splits), ...), contiguous. Backward:
    the same exchange of the gradient in reverse.
    """
    plan = check_and_plan("all_to_all_hp", x, output_splits, input_splits, group, check=check, mx=False)
    return _HPA2A.apply(x, plan, group)


