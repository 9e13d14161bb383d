"""`mx_grouped_mm`: torch._grouped_mm for MoE experts with every GEMM on MX operands.

a (T, K) tokens sorted by expert, b_t (E, K, N) = w.transpose(-2, -1) of expert weights w (E, N, K),
offs (E,) int32 cumulative ends. Axes (y = a Wₑᵀ per group):
  forward  y  = a Wₑᵀ   : a along K (dim0),  Wₑ along K (dim0 of w)
  dgrad    da = dy Wₑ   : dy along N (dim0), Wₑ along N (dim1 of w)
  wgrad    dWₑ = dyₑᵀ aₑ: dy and a along M (dim1), reduced over each expert's tokens only.

Wgrad blocks along M must not straddle two experts: each expert's blocks along M start at its first
token (group e = rows offs[e-1]:offs[e], its last block short, equal to zero-padding it to a multiple
of 32: zeros change no block's amax and add nothing to dWₑ). Empty experts give dWₑ = 0; rows at or
after offs[-1] belong to no expert and get zero output and gradient. Nothing syncs with the host and
the shapes are static (torch.compile).

Emulated GEMM (the recipe's gemm_backend "emulated"): the fused quantize-dequantize
(`mxmoe.quant.qdq`) computes the group boundaries on the device: one read of the tokens gives them
along K (forward) and along M per group (kept for the wgrad, bf16 (T, K), the bytes bf16 training
keeps for its own wgrad), one read of dy gives dy along N (dgrad) and along M per group. No padded
copy, no gather, nothing dequantized in the backward. The wgrad is torch._grouped_mm's K-grouped
form with the real offs: dy1ᵀ (N, T) and a1 (T, K), both T-major, the layout in which
torch._grouped_mm takes any group sizes (empty included). The dgrad takes the weights along N as
(E, N, K) row-major (each expert's blocks along its own N), as bf16 training's dgrad takes them.

Other backends (the MX path, e.g. "native"): the casts along M run on a copy of the tokens in which
each group starts at a multiple of the block size (`mxmoe.quant.groups`: group e occupies
ceil(nₑ/32)·32 rows, gaps zero, static size roundup(T + 32·E, 32), torchao's padded copy); the fused
dim0+dim1 cast runs on it, the dim0 result is gathered back to the T rows (an fp8 row gather), and
the wgrad GEMM takes the padded operands with the padded offs (every group along K a multiple of
32: what torch._scaled_grouped_mm's 2D x 2D form needs, one e8m0 scale per 32 tokens of one
group). The forward and dgrad take the T rows with the real offs: torch._scaled_grouped_mm's 2D x 3D
form takes any group sizes along M (each group's scales swizzled from a multiple of 128 rows). The
emulated path's wgrad is the same sum (its blocks along M start at each group's first token,
equal to that zero padding), so a run moves between an H200 and a B200 with the same casts. The
"emulated" backend taken through this path (tests) gathers its dequantized operands back and makes
the qdq path's dgrad and wgrad calls, so the two paths are bit-identical.

MX activations (an `MXTensor` from the MXFP8 dispatch, 2D, blocked along K) feed the forward GEMM
as they are, without dequantize/requantize; their gradient flows through `a.grad_anchor`. The
wgrad needs them along M: they are dequantized (to their orig_dtype) and cast along M per group.
They must have been quantized with the op's recipe (scaling mode, element dtype, block size).

With the recipe's wgrad_with_hp (torchao's, "mxfp8_rceil_wgrad_with_hp") each expert's wgrad is dyₑᵀ
aₑ on the unquantized operands (`mxmoe.ops.linear.wgrad_with_hp`, the real offs): the forward keeps
the tokens themselves (an MX activation: its elements and scales, dequantized exactly in the
backward), tokens and dy are cast along K / N only, and no group-padded copy is made.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from mxmoe.formats import INPUT_DTYPES
from mxmoe.ops.gemm import (
    apply_function,
    autocast_input,
    autocast_off,
    autocast_on,
    autocast_target,
    check_dtype,
    first_order,
    gemm,
    mx_gemm,
    no_autocast,
)
from mxmoe.ops.gemm_backend import OpKernels, backward_kernels, op_kernels, uses_qdq
from mxmoe.ops.linear import (
    WeightCasts,
    cast_weight,
    casts_both,
    dgrad_mx,
    kept_weight,
    restored_weight,
    sum_like_autograd,
    swap_last2,
    wants_grad,
    weight_mx,
    weight_qdq,
    wgrad_mx,
    wgrad_with_hp,
)
from mxmoe.quant.groups import check_offsets, group_padding, pad_groups
from mxmoe.quant.mx_tensor import MXTensor, mx_tensor_trusted, to_mx, to_mx_dim0_dim1
from mxmoe.quant.qdq import (
    _MAX_GROUPS,
    qdq_trusted,
    swiglu_bwd,
    swiglu_bwd_qdq_trusted,
    swiglu_qdq_trusted,
)
from mxmoe.recipe import MXRecipe, as_recipe

__all__ = [
    "check_offsets",
    "mx_grouped_mm",
    "mx_grouped_mm_shared",
    "mx_grouped_mm_swiglu",
    "mx_grouped_swiglu_mlp",
]


def _mx(q: Tensor, s: Tensor, axis: int, recipe: MXRecipe, mode: str, dtype: torch.dtype) -> MXTensor:
    return mx_tensor_trusted(q, s, axis, recipe.block_size, mode, dtype)


def _cast_a(a, a_q, a_s, a_mode, offs, recipe: MXRecipe, kernels: OpKernels, need_dw: bool, out_dtype):
    """The tokens along K for the forward GEMM and what the wgrad keeps of them, from one read.

    Returns (a0, kept, cap): a0 (T, K) compute dtype (qdq path) or an MXTensor along K; kept the
    tensors saved for the wgrad (qdq path: (a1,) along M in groups, (T, K) compute dtype; MX path:
    (pos, offs_pad, elements, scales) of the group-padded copy along M; an MX activation: its own
    (elements, scales) instead of a1 / the copy's; () without need_dw); cap: the padded rows.
    With the recipe's wgrad_with_hp the wgrad takes the tokens themselves: a0 alone is cast, kept
    (a,) (an MX activation: its (elements, scales)), cap 0."""
    is_mx = a_q is not None
    if need_dw and recipe.wgrad_with_hp:
        a0 = _cast_a(a, a_q, a_s, a_mode, offs, recipe, kernels, False, out_dtype)[0]
        return a0, ((a_q, a_s) if is_mx else (a,)), 0
    qdq, compute, direct = kernels.qdq, kernels.compute, kernels.direct
    pos = offs_pad = None
    cap = 0
    if need_dw and not qdq:
        pos, offs_pad, cap = group_padding(offs, a.shape[0], recipe.block_size)
    if is_mx:
        a0 = _mx(a_q, a_s, 1, recipe, a_mode, out_dtype)
        if qdq:
            a0 = a0.dequantize(compute, recipe=recipe)
        kept = (a_q, a_s) if qdq else (pos, offs_pad, a_q, a_s)
    elif need_dw and qdq:  # one read of a: along K, and along M in groups (kept for the wgrad)
        a0, a1 = qdq_trusted(a, recipe, kernels.k1, compute, True, True, offs, direct)
        kept = (a1,)
    elif need_dw:
        p0, a1 = to_mx_dim0_dim1(pad_groups(a, offs, pos, cap), recipe=recipe)
        a0, kept = p0.index_rows(pos), (pos, offs_pad, a1.qdata_blocked, a1.scale_blocked)
    elif qdq:
        (a0,) = qdq_trusted(a, recipe, kernels.k0, compute, True, False, None, direct)
    else:
        a0 = to_mx(a, axis=-1, recipe=recipe)
    return a0, (kept if need_dw else ()), cap


def _forward_gemm(
    a0, w: Tensor | WeightCasts, offs: Tensor, recipe: MXRecipe, kernels: OpKernels, out_dtype
) -> Tensor:
    """y (T, N) = a0 Wₑᵀ per group: a0 from `_cast_a`, w (E, N, K) cast along K (its rows), or its
    `cast_weight`."""
    if kernels.qdq:
        w0 = weight_qdq(w, -1, recipe, kernels).transpose(-2, -1)
        return gemm(a0, w0, offs, out_dtype, kernels.direct)
    return mx_gemm(a0, swap_last2(weight_mx(w, -1, recipe)), offs, recipe, out_dtype=out_dtype)


def _wgrad_a(
    kept, offs: Tensor, recipe: MXRecipe, kernels: OpKernels, is_mx: bool, a_mode: str, a_dtype, cap: int
):
    """The tokens along M for the wgrad from `kept` (see `_cast_a`): qdq path (T, K) compute dtype,
    MX path an MXTensor of the group-padded copy. An MX activation is dequantized (to its
    orig_dtype) and cast along M here (see module docstring). With wgrad_with_hp: the tokens as the
    op received them, (T, K) a_dtype (an MX activation dequantized: its exact values)."""
    if recipe.wgrad_with_hp:
        return _mx(*kept, 1, recipe, a_mode, a_dtype).dequantize(recipe=recipe) if is_mx else kept[0]
    if kernels.qdq:
        if not is_mx:
            return kept[0]
        sq, ss = kept
        a_deq = _mx(sq, ss, 1, recipe, a_mode, a_dtype).dequantize(recipe=recipe)
        return qdq_trusted(a_deq, recipe, kernels.k1, kernels.compute, False, True, offs, kernels.direct)[0]
    pos, _, sq, ss = kept
    if is_mx:
        a_deq = _mx(sq, ss, 1, recipe, a_mode, a_dtype).dequantize(recipe=recipe)
        return to_mx(pad_groups(a_deq, offs, pos, cap), axis=0, recipe=recipe)
    return _mx(sq, ss, 0, recipe, recipe.scaling_mode, a_dtype)


def _backward_gemms(
    dy, w, offs, kept, a1_fn, recipe: MXRecipe, kernels: OpKernels, need_da, need_dw, a_dtype, cap,
    dy_qdq=None,
):
    """(da (T, K) in a_dtype, db_t (E, K, N) in w's dtype) given dy (T, N) and the expert weights w
    (E, N, K) (the forward's view of b_t): dy cast as the dgrad and wgrad need it; a1_fn() gives the
    tokens along M (`_wgrad_a`), called only for the wgrad. dy_qdq (qdq path only): dy's casts made
    already, (dy0, dy1) as qdq_dim0_dim1(dy, offs=offs) gives them (dy is then not read). With the
    recipe's wgrad_with_hp the wgrad is `wgrad_with_hp` of dy and the tokens, and dy is cast for the
    dgrad alone."""
    qdq, compute, direct = kernels.qdq, kernels.compute, kernels.direct
    da = db_t = None
    # given casts: qdq_dim0_dim1's dy0 has its rows after the groups zeroed, dgrad rows zeroed anyway
    dy0, dy1 = (None, None) if dy_qdq is None else dy_qdq
    dy = dy if dy is None else dy.contiguous()
    if need_dw and recipe.wgrad_with_hp:
        # K-grouped (E, N, K): dyᵀ (N, T) and a (T, K), both T-major, grouped by the real offs
        db_t = wgrad_with_hp(dy, a1_fn(), offs, w.dtype, direct).transpose(-2, -1)
        need_dw = False
    if need_dw and qdq:
        if dy1 is None and need_da:  # one read of dy: along N, and along M in groups
            dy0, dy1 = qdq_trusted(dy, recipe, kernels.k1, compute, True, True, offs, direct)
        elif dy1 is None:
            (dy1,) = qdq_trusted(dy, recipe, kernels.k1, compute, False, True, offs, direct)
        # K-grouped (E, N, K): dy1ᵀ (N, T) and a1 (T, K), both T-major, grouped by the real offs
        db_t = gemm(dy1.t(), a1_fn(), offs, w.dtype, direct).transpose(-2, -1)
    elif need_dw:
        pos, offs_pad = kept[:2]
        dy_pad = pad_groups(dy, offs, pos, cap)
        if need_da:
            p0, dy1 = to_mx_dim0_dim1(dy_pad, recipe=recipe)
            dy0 = p0.index_rows(pos)
        else:
            dy1 = to_mx(dy_pad, axis=0, recipe=recipe)
        db_t = wgrad_mx(dy1, a1_fn(), pos, offs, offs_pad, recipe, w.dtype).transpose(-2, -1)
    elif need_da and dy0 is None:
        if qdq:
            (dy0,) = qdq_trusted(dy, recipe, kernels.k0, compute, True, False, None, direct)
        else:
            dy0 = to_mx(dy, axis=-1, recipe=recipe)
    if need_da:  # w (E, N, K) along N per expert, row-major (torch._grouped_mm's row-major b)
        if qdq:
            da = gemm(dy0, weight_qdq(w, -2, recipe, kernels, dy0), offs, a_dtype, direct)
        else:
            da = dgrad_mx(dy0, weight_mx(w, -2, recipe, dy0.qdata_blocked), offs, recipe, a_dtype)
    return da, db_t


class _MXGroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, a_q, a_s, a_mode, b_t, offs, recipe: MXRecipe, kernels: OpKernels, out_dtype):
        # a: (T, K) high precision, or the grad anchor of an MX activation given as (a_q, a_s).
        # b_t: (E, K, N), the transposed view of the expert weights w (E, N, K).
        # kernels: op_kernels(recipe, b_t.device)
        a0, kept, cap = _cast_a(a, a_q, a_s, a_mode, offs, recipe, kernels, b_t.requires_grad, out_dtype)
        w = cast_weight(b_t.transpose(-2, -1), recipe, kernels, casts_both(kernels, a.requires_grad))
        y = _forward_gemm(a0, w, offs, recipe, kernels, out_dtype)
        ctx.recipe, ctx.kernels, ctx.is_mx, ctx.a_dtype, ctx.a_mode, ctx.cap = (
            recipe, kernels, a_q is not None, out_dtype, a_mode, cap
        )
        w, ctx.w_casts = kept_weight(w)
        ctx.w_dtype = b_t.dtype
        ctx.save_for_backward(w, offs, *kept)  # w (E, N, K) as the backward takes it
        return y

    @staticmethod
    @first_order("mxmoe.ops.mx_grouped_mm")
    def backward(ctx, dy: Tensor):
        need_da, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[4]
        w, offs, *kept = ctx.saved_tensors
        w = restored_weight(w, ctx.w_casts, ctx.w_dtype)
        recipe, kernels = ctx.recipe, backward_kernels(ctx.kernels)

        def a1_fn():
            return _wgrad_a(kept, offs, recipe, kernels, ctx.is_mx, ctx.a_mode, ctx.a_dtype, ctx.cap)

        da, db_t = _backward_gemms(
            dy, w, offs, kept, a1_fn, recipe, kernels, need_da, need_dw, ctx.a_dtype, ctx.cap
        )
        return da, None, None, None, db_t, None, None, None, None


def _grouped_shared_forward(
    a, a_q, a_s, a_mode, offs, recipe: MXRecipe, kernels: OpKernels, out_dtype, cast_to, ws, need_dw: bool
):
    """The forward of `mx_grouped_mm_shared`: (the outputs, what the backward keeps, its cap); ws:
    the expert weights (E, N_i, K) or their `cast_weight`s."""
    if cast_to is not None:
        a = a.to(cast_to)
    a0, kept, cap = _cast_a(a, a_q, a_s, a_mode, offs, recipe, kernels, need_dw, out_dtype)
    ys = tuple(_forward_gemm(a0, w, offs, recipe, kernels, out_dtype) for w in ws)
    return ys, kept, cap


def _cast_weights(b_ts, recipe: MXRecipe, kernels: OpKernels, both: bool) -> list:
    """`cast_weight` of each expert weight (E, N, K) given as its transposed view b_t (E, K, N)
    (both: `casts_both`)."""
    return [cast_weight(b_t.transpose(-2, -1), recipe, kernels, both) for b_t in b_ts]


def _keep_weights(ctx, ws, b_ts) -> list[Tensor]:
    """What a forward keeps of the weights `ws` (`_cast_weights` of b_ts); `_weights_back` restores them."""
    saved, ctx.w_casts = zip(*map(kept_weight, ws), strict=True)
    ctx.w_dtypes = [b_t.dtype for b_t in b_ts]
    return saved


def _weights_back(ctx, saved) -> list:
    """The backward's weights (E, N, K) (or their WeightCasts) from `_keep_weights`' tensors."""
    return [restored_weight(t, c, d) for t, c, d in zip(saved, ctx.w_casts, ctx.w_dtypes, strict=True)]


class _MXGroupedMMShared(torch.autograd.Function):
    """y_i = a W_iₑᵀ per group for several expert weights with one cast of a (`mx_grouped_mm_shared`)."""

    @staticmethod
    def forward(
        ctx, a, a_q, a_s, a_mode, offs, recipe: MXRecipe, kernels: OpKernels, out_dtype, cast_to, *b_ts
    ):
        ctx.set_materialize_grads(False)  # an unused output: no GEMMs, no gradient (as its own op)
        ctx.x_dtype = a.dtype
        need_dw = any(wants_grad(b_t) for b_t in b_ts)
        ws = _cast_weights(b_ts, recipe, kernels, casts_both(kernels, a.requires_grad))
        ys, kept, cap = _grouped_shared_forward(
            a, a_q, a_s, a_mode, offs, recipe, kernels, out_dtype, cast_to, ws, need_dw
        )
        ctx.recipe, ctx.kernels, ctx.is_mx, ctx.a_dtype, ctx.a_mode, ctx.cap = (
            recipe, kernels, a_q is not None, out_dtype, a_mode, cap
        )
        ctx.n = len(b_ts)
        ctx.save_for_backward(offs, *_keep_weights(ctx, ws, b_ts), *kept)  # the weights (E, N_i, K)
        return ys

    @staticmethod
    @first_order("mxmoe.ops.mx_grouped_mm_shared")
    def backward(ctx, *dys):
        recipe, kernels, n = ctx.recipe, backward_kernels(ctx.kernels), ctx.n
        saved = ctx.saved_tensors  # read once: under non-reentrant checkpointing each read unpacks
        offs, ws, kept = saved[0], saved[1 : 1 + n], saved[1 + n :]
        ws = _weights_back(ctx, ws)
        need_da = ctx.needs_input_grad[0]
        a1 = []  # the tokens along M, made once for all the wgrads

        def a1_fn():
            if not a1:
                a1.append(_wgrad_a(kept, offs, recipe, kernels, ctx.is_mx, ctx.a_mode, ctx.a_dtype, ctx.cap))
            return a1[0]

        das, db_ts = [], []
        for i, (dy, w) in enumerate(zip(dys, ws, strict=True)):
            if dy is None:
                db_ts.append(None)
                continue
            need_dw = ctx.needs_input_grad[9 + i]
            da, db_t = _backward_gemms(
                dy, w, offs, kept, a1_fn, recipe, kernels, need_da, need_dw, ctx.a_dtype, ctx.cap
            )
            db_ts.append(db_t)
            if need_da:  # each op's da, as autograd hands it to a: through its autocast cast
                das.append(da.to(ctx.x_dtype))
        da = sum_like_autograd(das) if das else None
        return (da, None, None, None, None, None, None, None, None, *db_ts)


def mx_grouped_mm(
    a: Tensor | MXTensor, b_t: Tensor, offs: Tensor, recipe: MXRecipe | None = None
) -> Tensor:
    """Drop-in for torch._grouped_mm(a, b_t, offs=offs) with MX operands in forward and backward.

    a: (T, K) bf16/fp32 tokens grouped by expert (group e = rows offs[e-1]:offs[e]); or a 2D
       MXTensor blocked along K (axis=1), e.g. from mxmoe.comm.a2a_dispatch_mxfp8: used as is in
       the forward GEMM; differentiable through `a.grad_anchor` (dense gradient) when present. It
       must match the recipe: same scaling_mode, element dtype and block size.
    b_t: (E, K, N) bf16/fp32, the transposed view of (E, N, K) expert weights.
    offs: (E,) int32 cumulative group ends, offs[-1] <= T (rows after it belong to no group and
       give zero output). Any group sizes, including 0 and sizes not a multiple of 32.
    recipe: the MXRecipe (default mxmoe.DEFAULT_RECIPE).
    K and N must be divisible by recipe.block_size. Returns (T, N) contiguous in a's (orig) dtype;
    under autocast (as torch._grouped_mm in bf16 training) a Tensor a is first cast to the autocast dtype.
    """
    if type(recipe) is not MXRecipe:  # (None, or one to check: a call only then)
        recipe = as_recipe(recipe)
    args, out_dtype = _checked_args(a, b_t, offs, recipe)
    kernels = op_kernels(recipe, b_t.device)
    offs = offs.contiguous()  # the casts read offs[e] at offs_ptr + e
    if not autocast_on(b_t.device.type):  # (no autocast context to enter: µs per call)
        return _grouped_call(args, b_t, offs, recipe, kernels, out_dtype)
    if args[1] is None:
        args = (autocast_input(a), *args[1:])
    with autocast_off(b_t.device.type, kernels.direct):
        return _grouped_call(args, b_t, offs, recipe, kernels, out_dtype)


def _grouped_call(args, b_t: Tensor, offs: Tensor, recipe: MXRecipe, kernels: OpKernels, out_dtype) -> Tensor:
    """mx_grouped_mm's (T, N) result from `_checked_args`'s args (a after autocast), autocast off."""
    if torch.is_grad_enabled() and (args[0].requires_grad or b_t.requires_grad):
        return apply_function(
            _MXGroupedMM, *args, b_t, offs, recipe, kernels, out_dtype, eager=kernels.direct
        )
    # no graph to record (e.g. validation under no_grad): the forward alone, nothing kept
    a0 = _cast_a(*args, offs, recipe, kernels, False, out_dtype)[0]
    return _forward_gemm(a0, b_t.transpose(-2, -1), offs, recipe, kernels, out_dtype)


def mx_grouped_mm_shared(
    a: Tensor | MXTensor, b_ts: list[Tensor] | tuple[Tensor, ...], offs: Tensor,
    recipe: MXRecipe | None = None,
) -> tuple[Tensor, ...]:
    """(mx_grouped_mm(a, b_t, offs, recipe) for b_t in b_ts) with one cast of `a` (e.g. the
    experts' w1 and w3): bit-identical outputs and gradients, fewer quantizer calls.

    a, offs, recipe: as for `mx_grouped_mm` (a (T, K) tokens or a 2D MXTensor along K).
    b_ts: one or more (E, K, N_i) bf16/fp32 tensors, transposed views of (E, N_i, K) expert weights.
    Returns a tuple of (T, N_i) tensors, contiguous, in a's (orig) dtype (the autocast dtype under
    autocast for a Tensor a).

    The forward casts a along K once (and along M in groups once, kept for all the wgrads: one
    saved copy instead of one per weight; an MX activation is cast along M once in the backward);
    the backward casts each dy as `mx_grouped_mm` does and sums the input gradients as autograd sums
    those of separate calls (in a's dtype, the last weight's first).
    """
    recipe = as_recipe(recipe)
    if not isinstance(b_ts, (list, tuple)) or not b_ts:
        raise TypeError(f"b_ts must be a non-empty list or tuple of (E, K, N) tensors, got {b_ts!r}")
    for b_t in b_ts:
        args, out_dtype = _checked_args(a, b_t, offs, recipe)
    # a Tensor a goes in as given and is cast to the autocast dtype inside (None: no cast), so that
    # its gradient is summed after each op's cast back, as for separate calls
    cast_to = autocast_target(a) if args[1] is None else None
    if cast_to is not None:
        check_dtype("a", cast_to)
    kernels = op_kernels(recipe, b_ts[0].device)
    offs = offs.contiguous()  # the casts read offs[e] at offs_ptr + e
    with no_autocast(b_ts[0].device, kernels.direct):
        if torch.is_grad_enabled() and (args[0].requires_grad or any(b.requires_grad for b in b_ts)):
            return apply_function(
                _MXGroupedMMShared, *args, offs, recipe, kernels, out_dtype, cast_to, *b_ts,
                eager=kernels.direct,
            )
        # no graph to record (e.g. validation under no_grad): the forward alone, nothing kept
        ws = [b_t.transpose(-2, -1) for b_t in b_ts]
        return _grouped_shared_forward(*args, offs, recipe, kernels, out_dtype, cast_to, ws, False)[0]


def _swiglu_forward(g, u, w, need_dw: bool, offs, recipe: MXRecipe, kernels: OpKernels, out_dtype):
    """The forward of `_MXGroupedMMSwiGLU` (qdq path): (y (T, N) out_dtype, what the wgrad keeps:
    (h1,), h along M in groups (T, K) compute dtype, when the weight needs its MX wgrad (need_dw),
    else ()); w: the expert weights (E, N, K) or their `cast_weight`."""
    if need_dw and not recipe.wgrad_with_hp:  # along K for the GEMM, along M kept for the wgrad
        h0, h1 = swiglu_qdq_trusted(g, u, recipe, kernels.k1, kernels.compute, offs, kernels.direct)
        kept = (h1,)
    else:  # as `_cast_a` without the wgrad (wgrad_with_hp: `_swiglu_wgrad_h` makes h again)
        h = F.silu(g) * u
        (h0,) = qdq_trusted(h, recipe, kernels.k0, kernels.compute, True, False, None, kernels.direct)
        kept = ()
    return _forward_gemm(h0, w, offs, recipe, kernels, out_dtype), kept


def _swiglu_wgrad_h(recipe: MXRecipe, g: Tensor, u: Tensor, kept) -> Tensor:
    """The w2 wgrad's tokens: h = F.silu(g) * u itself with wgrad_with_hp (eager's values, made
    again from the saved g and u), else h along M in groups from `_swiglu_forward`'s kept."""
    return F.silu(g) * u if recipe.wgrad_with_hp else kept[0]


class _MXGroupedMMSwiGLU(torch.autograd.Function):
    """y = mx_grouped_mm(F.silu(g) * u, b_t, offs) on the qdq path with h = F.silu(g) * u never in
    memory: the forward casts h along K and along M in groups from one read of g and u
    (`swiglu_qdq_trusted`); the backward is `_MXGroupedMM`'s for dh, then autograd's own formulas
    of `F.silu(g) * u` (MulBackward0, SiluBackward0) on it."""

    @staticmethod
    def forward(ctx, g, u, b_t, offs, recipe: MXRecipe, kernels: OpKernels, out_dtype):
        # g, u: (T, K) of out_dtype (no autocast cast left to make); b_t: (E, K, N)
        (w,) = _cast_weights((b_t,), recipe, kernels, casts_both(kernels, g.requires_grad or u.requires_grad))
        y, kept = _swiglu_forward(g, u, w, b_t.requires_grad, offs, recipe, kernels, out_dtype)
        ctx.recipe, ctx.kernels, ctx.a_dtype = recipe, kernels, out_dtype
        # g, u: silu's and mul's backward need them
        ctx.save_for_backward(g, u, *_keep_weights(ctx, (w,), (b_t,)), offs, *kept)
        return y

    @staticmethod
    @first_order("mxmoe.ops.mx_grouped_mm_swiglu")
    def backward(ctx, dy: Tensor):
        need_dg, need_du, need_dw = ctx.needs_input_grad[:3]
        g, u, w, offs, *kept = ctx.saved_tensors
        (w,) = _weights_back(ctx, (w,))
        recipe, kernels = ctx.recipe, backward_kernels(ctx.kernels)
        dh, db_t = _backward_gemms(
            dy, w, offs, kept, lambda: _swiglu_wgrad_h(recipe, g, u, kept), recipe, kernels,
            need_dg or need_du, need_dw, ctx.a_dtype, 0,
        )
        dg = du = None
        if dh is not None:  # autograd of `F.silu(g) * u`: MulBackward0 then SiluBackward0
            if need_du:
                du = dh * F.silu(g)
            if need_dg:
                dg = torch.ops.aten.silu_backward(dh * u, g)
        return dg, du, db_t, None, None, None, None


def mx_grouped_mm_swiglu(
    g: Tensor, u: Tensor, b_t: Tensor, offs: Tensor, recipe: MXRecipe | None = None
) -> Tensor:
    """`mx_grouped_mm(F.silu(g) * u, b_t, offs, recipe)` (the SwiGLU experts' w2 GEMM), bit for bit
    in the output and in every gradient (g, u, b_t), without h = F.silu(g) * u in memory where the
    fused cast applies: the qdq path (the emulated backend) with g and u of one dtype and no
    autocast cast of h to make. There the forward reads g and u once and writes h along K (the
    GEMM's operand) and along M in groups (kept for the wgrad) (`mxmoe.quant.qdq.
    swiglu_qdq_dim0_dim1`; on CUDA the C++ operator mxmoe_cuda::swiglu_qdq_dim0_dim1, which forms
    h in registers as eager PyTorch does), keeps g and u (as silu's and mul's backward do) instead
    of F.silu(g), u and h, and the backward applies autograd's formulas of `F.silu(g) * u` to the
    dgrad. Elsewhere (other GEMM backends, mixed dtypes, autocast recasting h) it is that
    composition.

    g, u: (T, K) bf16/fp32 tensors of one shape (the w1 and w3 GEMMs' outputs), tokens grouped by
    expert; b_t, offs, recipe: as for `mx_grouped_mm`. Returns (T, N) contiguous in g's dtype (the
    autocast dtype when autocast recasts h: the unfused composition).
    """
    recipe = as_recipe(recipe)
    for name, t in (("g", g), ("u", u)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a Tensor, got {type(t).__name__}")
    if u.shape != g.shape:
        raise ValueError(f"u has shape {tuple(u.shape)}; expected g's shape {tuple(g.shape)}")
    fused = (  # (b_t is checked by mx_grouped_mm: not a Tensor takes the composition, which says so)
        u.dtype == g.dtype
        and isinstance(b_t, Tensor)
        and uses_qdq(recipe, b_t.device)
        and autocast_target(g) is None
    )
    if not fused:  # the composition (the fused cast does not apply)
        return mx_grouped_mm(F.silu(g) * u, b_t, offs, recipe)
    (g_, *_), out_dtype = _checked_args(g, b_t, offs, recipe)  # checks g (2D, K, dtype), b_t and offs
    if u.device != g.device:
        raise ValueError(f"u is on {u.device} but g on {g.device}; they must share a device")
    kernels = op_kernels(recipe, b_t.device)
    offs = offs.contiguous()  # the casts read offs[e] at offs_ptr + e
    with no_autocast(b_t.device, kernels.direct):
        if torch.is_grad_enabled() and (g.requires_grad or u.requires_grad or b_t.requires_grad):
            return apply_function(
                _MXGroupedMMSwiGLU, g, u, b_t, offs, recipe, kernels, out_dtype, eager=kernels.direct
            )
        # no graph to record (e.g. validation under no_grad): the forward alone, as mx_grouped_mm's
        h = F.silu(g) * u
        h0 = _cast_a(h, None, None, recipe.scaling_mode, offs, recipe, kernels, False, out_dtype)[0]
        return _forward_gemm(h0, b_t.transpose(-2, -1), offs, recipe, kernels, out_dtype)


class _MXGroupedSwiGLUMLP(torch.autograd.Function):
    """The SwiGLU experts' MLP y = mx_grouped_mm_swiglu(g, u, w2_t) of g, u = mx_grouped_mm_shared(a,
    (w1_t, w3_t)) on the qdq path as one op: the forward is those two ops' (one cast of a, h cast
    straight from g and u); the backward forms dh (w2's dgrad) and, from one read of dh, g and u,
    the casts of dg and du that w1's and w3's dgrads and wgrads take (`swiglu_bwd_qdq_trusted`):
    dg and du are never written. It keeps what the two ops keep (a's cast along M, g, u, h along
    M, the weights, offs) and gives their gradients bit for bit (`mx_grouped_swiglu_mlp`)."""

    @staticmethod
    def forward(
        ctx, a, a_q, a_s, a_mode, offs, recipe: MXRecipe, kernels: OpKernels, out_dtype, cast_to,
        w1_t, w3_t, w2_t,
    ):
        need_dw = wants_grad(w1_t) or wants_grad(w3_t)
        ctx.x_dtype = a.dtype
        # w2's dgrad (dh) is needed for a's gradient and for w1's and w3's wgrads
        need_dh = a.requires_grad or need_dw
        both = casts_both(kernels, True)  # (asked once for the three weights)
        w1, w3 = _cast_weights((w1_t, w3_t), recipe, kernels, both and a.requires_grad)
        (w2,) = _cast_weights((w2_t,), recipe, kernels, both and need_dh)
        (g, u), kept, cap = _grouped_shared_forward(
            a, a_q, a_s, a_mode, offs, recipe, kernels, out_dtype, cast_to, (w1, w3), need_dw
        )
        y, h_kept = _swiglu_forward(g, u, w2, w2_t.requires_grad, offs, recipe, kernels, out_dtype)
        ctx.recipe, ctx.kernels, ctx.is_mx, ctx.a_dtype, ctx.a_mode, ctx.cap = (
            recipe, kernels, a_q is not None, out_dtype, a_mode, cap
        )
        ctx.n_h = len(h_kept)
        kept_ws = _keep_weights(ctx, (w1, w3, w2), (w1_t, w3_t, w2_t))  # (E, N, K) each
        ctx.save_for_backward(offs, *kept_ws, g, u, *h_kept, *kept)
        return y

    @staticmethod
    @first_order("mxmoe.ops.mx_grouped_swiglu_mlp")
    def backward(ctx, dy: Tensor):
        recipe, kernels = ctx.recipe, backward_kernels(ctx.kernels)
        offs, w1, w3, w2, g, u, *rest = ctx.saved_tensors
        w1, w3, w2 = _weights_back(ctx, (w1, w3, w2))
        h_kept, kept = rest[: ctx.n_h], rest[ctx.n_h :]
        need_da, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[9:12]
        need_dh = need_da or need_dw[0] or need_dw[1]
        dh, dw2_t = _backward_gemms(  # `_MXGroupedMMSwiGLU.backward`'s
            dy, w2, offs, h_kept, lambda: _swiglu_wgrad_h(recipe, g, u, h_kept), recipe,
            kernels, need_dh, need_dw[2], ctx.a_dtype, 0,
        )
        das, dws = [], [None, None]
        if dh is not None:  # `_MXGroupedMMShared.backward`'s, on dg and du cast from dh, g, u at once
            if recipe.wgrad_with_hp:  # the wgrads take dg and du themselves (autograd's); cast for the dgrads
                dgu = swiglu_bwd(dh, g, u)
            else:
                dgu = swiglu_bwd_qdq_trusted(
                    dh, g, u, recipe, kernels.k1, kernels.compute, offs, kernels.direct
                )
            a1 = []

            def a1_fn():
                if not a1:
                    a1.append(
                        _wgrad_a(kept, offs, recipe, kernels, ctx.is_mx, ctx.a_mode, ctx.a_dtype, ctx.cap)
                    )
                return a1[0]

            for i, w in enumerate((w1, w3)):
                dy_i, dy_qdq = (dgu[i], None) if recipe.wgrad_with_hp else (None, dgu[2 * i : 2 * i + 2])
                da, dws[i] = _backward_gemms(
                    dy_i, w, offs, kept, a1_fn, recipe, kernels, need_da, need_dw[i],
                    ctx.a_dtype, ctx.cap, dy_qdq,
                )
                if need_da:
                    das.append(da.to(ctx.x_dtype))
        da = sum_like_autograd(das) if das else None
        return (da, None, None, None, None, None, None, None, None, *dws, dw2_t)


def mx_grouped_swiglu_mlp(
    x: Tensor | MXTensor, w1_t: Tensor, w3_t: Tensor, w2_t: Tensor, offs: Tensor,
    recipe: MXRecipe | None = None,
) -> Tensor:
    """The SwiGLU experts' MLP, `mx_grouped_mm_swiglu(g, u, w2_t, offs, recipe)` of g, u =
    `mx_grouped_mm_shared(x, (w1_t, w3_t), offs, recipe)`, bit for bit in the output and in every
    gradient (x, w1_t, w3_t, w2_t), as one op where the fusion applies: the qdq path (the emulated
    backend), a graph to record, no autocast recasting of h (autocast off, or its dtype that of g).
    There the backward casts dg and du (the gradients of g and u) for w1's and w3's dgrads and
    wgrads straight from one read of dh, g and u (`mxmoe.quant.qdq.swiglu_bwd_qdq_dim0_dim1`; on
    CUDA the C++ operator mxmoe_cuda::swiglu_bwd_qdq_dim0_dim1, which forms them in registers as
    eager PyTorch's autograd does) instead of writing dg and du and reading each back for its
    casts; it keeps what the composition keeps. Elsewhere it is that composition.

    x: (T, D) bf16/fp32 tokens grouped by expert, or a 2D MXTensor blocked along D (as for
    `mx_grouped_mm`). w1_t, w3_t: (E, D, H) bf16/fp32, transposed views of the (E, H, D) expert
    weights w1 and w3; w2_t: (E, H, D') the transposed view of w2 (E, D', H). offs: (E,) int32
    cumulative group ends (any sizes, rows after offs[-1] give zero). D, H, D' divisible by the
    block size. Returns (T, D') contiguous in x's (orig) dtype (the autocast dtype under autocast
    for a Tensor x).
    """
    recipe = as_recipe(recipe)
    ws = (w1_t, w3_t, w2_t)
    fused = (  # else the composition raises what is wrong
        torch.is_grad_enabled()
        and all(isinstance(w, Tensor) and w.ndim == 3 and w.dtype in INPUT_DTYPES for w in ws)
        and w3_t.shape == w1_t.shape
        and w2_t.shape[:2] == (w1_t.shape[0], w1_t.shape[2])
        and w2_t.shape[2] % recipe.block_size == 0
        and w3_t.device == w2_t.device == w1_t.device
        and uses_qdq(recipe, w1_t.device)
    )
    if fused:
        args, out_dtype = _checked_args(x, w1_t, offs, recipe)  # x, offs and w1_t (w3_t, w2_t: above)
        dev = w1_t.device.type
        fused = (args[0].requires_grad or any(w.requires_grad for w in ws)) and not (
            autocast_on(dev) and torch.get_autocast_dtype(dev) != out_dtype  # h recast
        )
    if not fused:  # the composition (the fusion does not apply; its checks and errors)
        _check_mlp_weights(w1_t, w3_t, w2_t)
        g, u = mx_grouped_mm_shared(x, (w1_t, w3_t), offs, recipe)
        return mx_grouped_mm_swiglu(g, u, w2_t, offs, recipe)
    cast_to = autocast_target(x) if args[1] is None else None
    kernels = op_kernels(recipe, w1_t.device)
    offs = offs.contiguous()  # the casts read offs[e] at offs_ptr + e
    with no_autocast(w1_t.device, kernels.direct):
        return apply_function(
            _MXGroupedSwiGLUMLP, *args, offs, recipe, kernels, out_dtype, cast_to, *ws, eager=kernels.direct
        )


def _check_mlp_weights(w1_t, w3_t, w2_t) -> None:
    """ValueError naming the weight of `mx_grouped_swiglu_mlp` whose shape does not fit w1_t (E, D, H)
    where all three are 3D tensors (the composition's own checks would name its inner arguments: g
    and u, `a` for h, `offs` for another expert count; other mistakes get those, naming the weight)."""
    if not all(isinstance(w, Tensor) and w.ndim == 3 for w in (w1_t, w3_t, w2_t)):
        return
    E, D, H = w1_t.shape
    if w3_t.shape != w1_t.shape:
        raise ValueError(
            f"w3_t has shape {tuple(w3_t.shape)}; expected w1_t's shape {tuple(w1_t.shape)} (E, D, H): "
            "the transposed views of the (E, H, D) weights w1 and w3"
        )
    if w2_t.shape[:2] != (E, H):
        raise ValueError(
            f"w2_t has shape {tuple(w2_t.shape)}; expected ({E}, {H}, D'): the transposed view of w2 "
            f"(E, D', H) with w1_t's E={E} experts and hidden size H={H} (w1_t {tuple(w1_t.shape)})"
        )


def _checked_args(a, b_t, offs, recipe: MXRecipe):
    """The Function's activation arguments (a or its grad anchor, elements, scales, scaling mode)
    and the output dtype, after checking a, b_t and offs (errors name the argument)."""
    if not isinstance(b_t, Tensor) or b_t.ndim != 3:
        raise ValueError(
            f"b_t must be a 3D tensor (E, K, N), got {getattr(b_t, 'shape', type(b_t).__name__)}"
        )
    if not isinstance(offs, Tensor) or offs.ndim != 1 or offs.shape[0] != b_t.shape[0]:
        raise ValueError(f"offs must be a 1D int32 tensor of E={b_t.shape[0]} group ends, got {offs!r}")
    if offs.dtype != torch.int32:
        raise TypeError(f"offs has dtype {offs.dtype}; expected torch.int32 (as torch._grouped_mm)")
    if not 1 <= offs.shape[0] <= _MAX_GROUPS:
        raise ValueError(f"offs has {offs.shape[0]} groups; expected 1 to {_MAX_GROUPS}")
    if offs.device != b_t.device:
        raise ValueError(f"offs is on {offs.device} but b_t on {b_t.device}; they must share a device")
    if b_t.dtype not in INPUT_DTYPES:
        check_dtype("b_t", b_t.dtype)
    E, K, N = b_t.shape
    if isinstance(a, MXTensor):
        if a.ndim != 2 or a.axis != 1:
            raise ValueError(f"an MXTensor a must be 2D and blocked along K (axis=-1), got {a}")
        diff = [
            f"{name}={got!r} (recipe: {want!r})"
            for name, got, want in (
                ("scaling_mode", a.scaling_mode, recipe.scaling_mode),
                ("elem_dtype", a.elem_dtype, recipe.elem_dtype),
                ("block_size", a.block_size, recipe.block_size),
            )
            if got != want
        ]
        if diff:
            raise ValueError(
                f"MXTensor a does not match the op's recipe: it has {', '.join(diff)}. Quantize "
                "the activations with the experts' recipe, or give the op a recipe that matches them"
            )
        T = a.shape[0]
        anchor = a.grad_anchor
        if anchor is None:
            anchor = torch.zeros((), dtype=a.orig_dtype, device=a.device).expand(a.shape)
        args = (anchor, a.qdata_blocked, a.scale_blocked, a.scaling_mode)
        out_dtype = a.orig_dtype
    elif isinstance(a, Tensor):
        if a.ndim != 2:
            raise ValueError(f"a must be 2D (T, K), got shape {tuple(a.shape)}")
        out_dtype = autocast_target(a) or a.dtype
        if out_dtype not in INPUT_DTYPES:  # as the casts take it: after autocast
            check_dtype("a", out_dtype)
        T = a.shape[0]
        args = (a, None, None, recipe.scaling_mode)  # a not yet in the autocast dtype: the caller casts
    else:
        raise TypeError(f"a must be a Tensor or an MXTensor, got {type(a).__name__}")
    if a.shape[1] != K:
        raise ValueError(f"a has K={a.shape[1]} but b_t {tuple(b_t.shape)} has K={K}")
    if a.device != b_t.device:
        raise ValueError(f"a is on {a.device} but b_t on {b_t.device}; they must share a device")
    for name, d in (("K", K), ("N", N)):
        if d % recipe.block_size:
            raise ValueError(f"mx_grouped_mm: {name}={d} is not divisible by block_size={recipe.block_size}")
    if offs.is_cpu and not torch.compiler.is_compiling():
        check_offsets(offs, T)  # on the host already: no sync (CUDA offsets: see check_offsets)
    return args, out_dtype

