"""`mx_mm`: y = a @ b for a linear layer, every GEMM of forward and backward on MX operands.

With y = x Wᵀ (x: M x K, W: N x K, b = Wᵀ a (K, N) view), each operand is quantized along the
dim its GEMM reduces over (docs/training-ops.md):
  forward  y  = x Wᵀ : x along K (dim0 of x),  W along K (dim0 of W)
  dgrad    dx = dy W : dy along N (dim0 of dy), W along N (dim1 of W)
  wgrad    dW = dyᵀ x: dy along M (dim1 of dy), x along M (dim1 of x)
M need not be a multiple of the block size: the last block along M is short (equal to zero-padding
it: zeros change no block's amax and add nothing to dW).

Emulated GEMM (the recipe's gemm_backend "emulated"): each operand is made by the fused
quantize-dequantize (`mxmoe.quant.qdq`), every result in the operand's own row-major layout: x and
dy both ways from one read, W along K and along N. The forward keeps x along M in the compute dtype
(bf16 on CUDA: what bf16 training keeps for its wgrad) and the backward uses it as is: dW = dy1ᵀ x1,
both M-major, the layout of bf16 training's wgrad. The dgrad dx = dy0 W takes W along N row-major
(N, K), as bf16 training's dgrad takes W.
Other backends get MXTensors (`to_mx`, `to_mx_dim0_dim1`) of zero-padded rows and `mx_gemm`; the
"emulated" backend taken through that path (tests) makes the qdq path's dgrad and wgrad calls on
its dequantized operands (`dgrad_mx`, `wgrad_mx`), so the two paths are bit-identical.

With the recipe's wgrad_with_hp (torchao's, "mxfp8_rceil_wgrad_with_hp") the wgrad is dyᵀ x on the
unquantized operands (`wgrad_with_hp`): the forward keeps x itself, x and dy are cast along K / N
only, on every path.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
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
from mxmoe.ops.gemm_backend import OpKernels, backward_kernels, op_kernels, resolve_gemm_backend
from mxmoe.quant.backends import cast_kernel
from mxmoe.quant.gathered import MXGatheredWeight, gathered_mx
from mxmoe.quant.mx_tensor import MXTensor, mx_tensor_trusted, to_mx, to_mx_dim0_dim1
from mxmoe.quant.qdq import qdq_trusted
from mxmoe.recipe import MXRecipe, as_recipe


def wants_grad(t: Tensor) -> bool:
    """Whether a forward must keep what the gradient of `t` needs (`t.requires_grad`)."""
    return t.requires_grad


def swap_last2(t: MXTensor) -> MXTensor:
    """The MXTensor whose logical shape has the last two dims of `t` swapped: same storage, the
    block axis follows its dim (2D: the transpose); swizzled scales are kept (swizzled per group,
    they group the logical rows: not swappable)."""
    if t.offs is not None:
        raise ValueError(f"swap_last2 needs scales that are not swizzled per group, got {t}")
    return mx_tensor_trusted(
        t.qdata_blocked,
        t.scale_blocked,
        2 * t.ndim - 3 - t.axis,
        t.block_size,
        t.scaling_mode,
        t.orig_dtype,
        scale_swizzled=t.scale_swizzled,
    )


def _slice_rows(t: MXTensor, rows: int) -> MXTensor:
    """First `rows` rows of a dim0-blocked 2D MXTensor (a view, stays contiguous)."""
    return mx_tensor_trusted(
        t.qdata_blocked[:rows],
        t.scale_blocked[:rows],
        t.axis,
        t.block_size,
        t.scaling_mode,
        t.orig_dtype,
    )


def pad_rows(x: Tensor, block_size: int) -> Tensor:
    """x (M, C) with zero rows appended up to a multiple of block_size (x itself if none needed)."""
    pad = -x.shape[0] % block_size
    return F.pad(x, (0, 0, 0, pad)) if pad else x


def cast_both(x: Tensor, recipe: MXRecipe) -> tuple[MXTensor, MXTensor]:
    """x (M, C) -> (along C: logical (M, C) axis 1, along M: logical (M_pad, C) axis 0), M_pad =
    M rounded up to the block size with zero rows, from one fused read."""
    M = x.shape[0]
    d0, d1 = to_mx_dim0_dim1(pad_rows(x, recipe.block_size), recipe=recipe)
    return (_slice_rows(d0, M) if d0.shape[0] != M else d0), d1


def cast_rows(x: Tensor, recipe: MXRecipe) -> MXTensor:
    """x (M, C) -> along M, logical (M_pad, C) axis 0, zero-padded rows."""
    return to_mx(pad_rows(x, recipe.block_size), axis=0, recipe=recipe)


class WeightCasts:
    """A weight's two qdq casts made from one read (`cast_weight`): k along K (the forward GEMM's
    operand), n along N (the dgrad's; k is None once the forward is done), both of the weight's
    shape ((N, K) or (E, N, K)), row-major, in the compute dtype; dtype: the weight's own (its
    gradient's). A slotted class: made per weight twice a step, in one Python call."""

    __slots__ = ("k", "n", "dtype")

    def __init__(self, k: Tensor | None, n: Tensor, dtype: torch.dtype):
        self.k, self.n, self.dtype = k, n, dtype


_DIST = dist.is_available()


def _one_process() -> bool:
    return not (_DIST and dist.is_initialized() and dist.get_world_size() > 1)


def casts_both(kernels: OpKernels, need_dgrad: bool) -> bool:
    """Whether a forward's `cast_weight` calls make both casts of their weights (asked once per
    forward, for all its weights): on the qdq path, with the dgrad to come, in one process."""
    return need_dgrad and kernels.qdq and _one_process()


def cast_weight(w: Tensor, recipe: MXRecipe, kernels: OpKernels, both: bool) -> Tensor | WeightCasts:
    """What a forward on the qdq path takes of a weight W ((N, K) or (E, N, K)): with `both`
    (`casts_both`: the dgrad to come, one process), both casts from one read (WeightCasts): the
    forward uses the cast along K and keeps the one along N for the backward, which then casts
    nothing; that reads W once a step instead of twice and keeps 2 bytes a weight element from the
    forward to the backward, as bf16 autocast keeps its bf16 copy of each weight. Several processes
    (FSDP frees each unsharded weight after the forward), no dgrad or a weight FSDP2 gathered as MX:
    W itself, cast along K by the forward and along N by the backward (`weight_qdq`). Same values
    either way."""
    if both and not isinstance(w, MXGatheredWeight):
        k, n = qdq_trusted(w, recipe, kernels.k1, kernels.compute, True, True, None, kernels.direct)
        return WeightCasts(k, n, w.dtype)
    return w


def kept_weight(w: Tensor | WeightCasts) -> tuple[Tensor, bool]:
    """(the tensor a forward keeps of `cast_weight`'s answer, whether it is a WeightCasts' cast
    along N (else the weight itself))."""
    return (w.n, True) if isinstance(w, WeightCasts) else (w, False)


def restored_weight(t: Tensor, casts: bool, dtype: torch.dtype) -> Tensor | WeightCasts:
    """The backward's weight from `kept_weight`'s tensor (`casts`: it was a WeightCasts of a weight
    of `dtype`)."""
    return WeightCasts(None, t, dtype) if casts else t


def weight_qdq(
    w: Tensor | WeightCasts, axis: int, recipe: MXRecipe, kernels: OpKernels, after: Tensor | None = None
) -> Tensor:
    """qdq of a weight (bf16/fp32, any strides, e.g. W (N, K) or w (E, N, K), checked by the op)
    along `axis` (-1 or -2) in kernels.compute, row-major (WeightCasts: the cast made already; a
    weight FSDP2 gathered as MX, `MXGatheredWeight`: dequantized, not cast, the same values; `after`:
    the backward's gradient, see `gathered_mx`)."""
    if isinstance(w, WeightCasts):
        return w.k if axis == -1 else w.n
    if isinstance(w, MXGatheredWeight):  # (gathered_mx's own test, without its call otherwise)
        pre = gathered_mx(w, axis, recipe, after)
        return pre.dequantize_trusted(kernels.compute, cast_kernel(recipe, w.device, "dequant")).contiguous()
    dim1 = axis == -2
    k = kernels.k1 if dim1 else kernels.k0
    return qdq_trusted(w, recipe, k, kernels.compute, not dim1, dim1, None, kernels.direct)[0]


def weight_mx(w: Tensor, axis: int, recipe: MXRecipe, after: Tensor | None = None) -> MXTensor:
    """to_mx of a weight along `axis` (a weight FSDP2 gathered as MX: its gathered cast; `after`: see
    `gathered_mx`)."""
    pre = gathered_mx(w, axis, recipe, after)
    return to_mx(w, axis, recipe=recipe) if pre is None else pre


def dgrad_mx(
    dy0: MXTensor, w1: MXTensor, offs: Tensor | None, recipe: MXRecipe, out_dtype: torch.dtype
) -> Tensor:
    """The MX path's input gradient dy0 W: dy0 logical (M, N) blocked along N, w1 the weight cast
    along N, logical (N, K) or (E, N, K) (to_mx's storage: (K, N) / (E, K, N)); offs groups the
    rows of dy0 (None: dense). Returns (M, K).

    The emulated backend dequantizes, makes the weight row-major ((N, K) / (E, N, K), the layout
    the qdq path's weight cast has) and makes the qdq path's dgrad call (`gemm(dy0, w1, offs)`),
    so the two paths stay bit-identical. Other backends get the MX operands."""
    if resolve_gemm_backend(recipe, dy0.device) != "emulated":
        return mx_gemm(dy0, w1, offs, recipe, out_dtype=out_dtype)
    compute = recipe.compute_dtype(dy0.device)
    d = dy0.dequantize(compute, recipe=recipe)
    w = w1.dequantize(compute, recipe=recipe).contiguous()
    return gemm(d, w, offs, out_dtype)


def wgrad_mx(
    dy1: MXTensor, x1: MXTensor, rows: Tensor | int, offs: Tensor | None, offs_pad: Tensor | None,
    recipe: MXRecipe, out_dtype: torch.dtype,
) -> Tensor:
    """The MX path's weight gradient dy1ᵀ x1 from the casts along M of zero-padded copies: dy1
    logical (M_pad, N), x1 (M_pad, K), both blocked along M; rows: M (dense: the real rows are the
    first M) or pos (grouped: where each real row sits in the padded copy); offs_pad groups the
    padded rows (None: dense). Returns (N, K), or (E, N, K) when grouped.

    The emulated backend dequantizes, takes the real rows back (row-major (M, ·)) and makes the GEMM
    call of the qdq path (`gemm(dy1ᵀ, x1, offs)`), so the two paths stay bit-identical (a GEMM's
    result depends on its operands' layout and reduction length, not only on their values). Other
    backends get the padded MX operands (32-aligned groups)."""
    if resolve_gemm_backend(recipe, x1.device) != "emulated":
        return mx_gemm(swap_last2(dy1), x1, offs_pad, recipe, out_dtype=out_dtype)
    compute = recipe.compute_dtype(x1.device)
    d, a = (t.dequantize(compute, recipe=recipe) for t in (dy1, x1))
    if isinstance(rows, Tensor):
        d, a = d.index_select(0, rows), a.index_select(0, rows)
    else:
        d, a = d[:rows].contiguous(), a[:rows].contiguous()
    return gemm(d.t(), a, offs, out_dtype)


def wgrad_with_hp(
    dy: Tensor, x: Tensor, offs: Tensor | None, out_dtype: torch.dtype, direct: bool = False
) -> Tensor:
    """The weight gradient of torchao's wgrad_with_hp: dyᵀ x on the unquantized operands, in their
    own dtype (`gemm`, fp32 accumulation), as bf16 training's wgrad. dy (M, N) row-major, x (M, K),
    both of one dtype; offs groups the rows (None: dense). Returns (N, K), or (E, N, K) grouped,
    in out_dtype. direct: as for `gemm`."""
    return gemm(dy.t(), x, offs, out_dtype, direct)


def _cast_x(
    x: Tensor, recipe: MXRecipe, kernels: OpKernels, need_dw: bool
) -> tuple[Tensor | MXTensor, tuple[Tensor, ...]]:
    """x (M, K) -> (x along K for the forward GEMM, what the wgrad keeps of x along M).

    qdq path: x0 (M, K) compute dtype, kept (x1,) (M, K) compute dtype row-major; MX path: x0 an
    MXTensor along K, kept (elements, scales) of x along M, zero-padded rows. Nothing kept when
    `need_dw` is False. With need_dw, one read of x gives both. With the recipe's wgrad_with_hp
    the wgrad takes x itself: x0 alone is cast, kept (x,)."""
    if need_dw and recipe.wgrad_with_hp:
        return _cast_x(x, recipe, kernels, False)[0], (x,)
    if kernels.qdq:
        if need_dw:  # one read of x: along K, and along M (kept for the wgrad, row-major)
            x0, x1 = qdq_trusted(x, recipe, kernels.k1, kernels.compute, True, True, None, kernels.direct)
            return x0, (x1,)
        return qdq_trusted(x, recipe, kernels.k0, kernels.compute, True, False, None, kernels.direct)[0], ()
    if need_dw:
        x0, x1 = cast_both(x, recipe)
        return x0, (x1.qdata_blocked, x1.scale_blocked)
    return to_mx(x, axis=-1, recipe=recipe), ()


def _forward_gemm(
    x0: Tensor | MXTensor, w: Tensor | WeightCasts, recipe: MXRecipe, kernels: OpKernels,
    out_dtype: torch.dtype,
) -> Tensor:
    """y = x0 Wᵀ (M, N) in out_dtype: x0 from `_cast_x`, W (N, K) cast along K (or `cast_weight`'s)."""
    if kernels.qdq:
        return gemm(x0, weight_qdq(w, -1, recipe, kernels).t(), None, out_dtype, kernels.direct)
    return mx_gemm(x0, swap_last2(weight_mx(w, -1, recipe)), recipe=recipe)


def _backward_gemms(
    dy: Tensor, w: Tensor | WeightCasts, kept: tuple[Tensor, ...], recipe: MXRecipe, kernels: OpKernels,
    need_dx: bool, need_dw: bool, x_dtype: torch.dtype,
) -> tuple[Tensor | None, Tensor | None]:
    """(dx (M, K) in x_dtype, dW_t (K, N) in w's dtype) of y = x Wᵀ given dy (M, N) and W (N, K)
    (the forward's view of w_t): dy cast as the dgrad and wgrad need it, `kept` what `_cast_x`
    kept of x along M (with wgrad_with_hp: x itself, and dy is cast for the dgrad alone)."""
    if need_dw and recipe.wgrad_with_hp:
        dy = dy.contiguous()
        dw_t = wgrad_with_hp(dy, kept[0], None, w.dtype, kernels.direct).t()  # (N, K) -> (K, N)
        return _backward_gemms(dy, w, (), recipe, kernels, need_dx, False, x_dtype)[0], dw_t
    dx = dw_t = None
    if kernels.qdq:  # (qdq_trusted makes dy contiguous)
        direct = kernels.direct
        if need_dx and need_dw:  # one read of dy: along N, and along M (row-major)
            dy0, dy1 = qdq_trusted(dy, recipe, kernels.k1, kernels.compute, True, True, None, direct)
        elif need_dx:
            (dy0,) = qdq_trusted(dy, recipe, kernels.k0, kernels.compute, True, False, None, direct)
        else:
            (dy1,) = qdq_trusted(dy, recipe, kernels.k1, kernels.compute, False, True, None, direct)
        if need_dx:  # W (N, K) along N, row-major
            dx = gemm(dy0, weight_qdq(w, -2, recipe, kernels, dy0), None, x_dtype, direct)
        if need_dw:  # dy1ᵀ (N, M) and x1 (M, K), both M-major, as bf16 training's wgrad
            dw_t = gemm(dy1.t(), kept[0], None, w.dtype, direct).t()  # (N, K) -> (K, N)
        return dx, dw_t
    M, bs = dy.shape[0], recipe.block_size
    dy = dy.contiguous()
    x1 = None
    if need_dw:
        xq, xs = kept
        x1 = mx_tensor_trusted(xq, xs, 0, bs, recipe.scaling_mode, x_dtype)  # logical (M_pad, K)
    if need_dx and need_dw:
        dy0, dy1 = cast_both(dy, recipe)
    elif need_dx:
        dy0 = to_mx(dy, axis=-1, recipe=recipe)
    else:
        dy1 = cast_rows(dy, recipe)
    if need_dx:
        dx = dgrad_mx(dy0, weight_mx(w, -2, recipe, dy0.qdata_blocked), None, recipe, x_dtype)
    if need_dw:
        dw_t = wgrad_mx(dy1, x1, M, None, None, recipe, w.dtype).t()
    return dx, dw_t


class _MXMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, w_t: Tensor, recipe: MXRecipe, kernels: OpKernels) -> Tensor:
        # x (M, K); w_t (K, N), the transposed view of W (N, K); kernels: op_kernels(recipe, x.device)
        x0, kept = _cast_x(x, recipe, kernels, w_t.requires_grad)
        w = cast_weight(w_t.t(), recipe, kernels, casts_both(kernels, x.requires_grad))
        y = _forward_gemm(x0, w, recipe, kernels, x.dtype)
        ctx.recipe, ctx.kernels, ctx.x_dtype = recipe, kernels, x.dtype
        w, ctx.w_casts = kept_weight(w)
        ctx.w_dtype = w_t.dtype
        ctx.save_for_backward(w, *kept)  # W (N, K) as the backward takes it
        return y

    @staticmethod
    @first_order("mxmoe.ops.mx_mm")
    def backward(ctx, dy: Tensor):
        need_dx, need_dw, _, _ = ctx.needs_input_grad
        w, *kept = ctx.saved_tensors
        w = restored_weight(w, ctx.w_casts, ctx.w_dtype)
        kernels = backward_kernels(ctx.kernels)
        dx, dw_t = _backward_gemms(dy, w, kept, ctx.recipe, kernels, need_dx, need_dw, ctx.x_dtype)
        return dx, dw_t, None, None


def sum_like_autograd(grads: list[Tensor]) -> Tensor:
    """The sum autograd makes of the gradients that several ops, applied to one tensor in list
    order, give it, when their backward nodes run in reverse order of creation (the engine runs the
    latest-created ready node first): the last op's gradient first, then each earlier one added in
    turn, in their dtype (bit-identical: a + b == b + a, but (a + b) + c need not be a + (b + c))."""
    acc = grads[-1]
    for g in reversed(grads[:-1]):
        acc = acc + g
    return acc


def _mm_shared_forward(x: Tensor, cast_to, recipe: MXRecipe, kernels: OpKernels, ws, need_dw: bool):
    """The forward of `mx_mm_shared`: (the outputs, x as the GEMMs take it (2D), what the backward
    keeps); ws: the weights W_i (N_i, K) or their `cast_weight`s."""
    a = x.to(cast_to) if cast_to is not None else x
    a = a.reshape(-1, a.shape[-1])
    x0, kept = _cast_x(a, recipe, kernels, need_dw)
    return tuple(_forward_gemm(x0, w, recipe, kernels, a.dtype) for w in ws), a, kept


class _MXMMShared(torch.autograd.Function):
    """y_i = x W_iᵀ for several weights with one cast of x (see `mx_mm_shared`)."""

    @staticmethod
    def forward(
        ctx, x: Tensor, cast_to: torch.dtype | None, recipe: MXRecipe, kernels: OpKernels, *w_ts: Tensor
    ):
        # x (..., K) as the caller gave it; cast_to: the autocast dtype each single op would cast
        # x to (None: no cast); kernels: op_kernels(recipe, x.device); w_ts (K, N_i), the transposed views
        # of W_i (N_i, K)
        ctx.set_materialize_grads(False)  # an unused output: no GEMMs, no gradient (as its own op)
        need_dw = any(wants_grad(w_t) for w_t in w_ts)
        both = casts_both(kernels, x.requires_grad)
        ws = [cast_weight(w_t.t(), recipe, kernels, both) for w_t in w_ts]
        ys, a, kept = _mm_shared_forward(x, cast_to, recipe, kernels, ws, need_dw)
        ctx.recipe, ctx.kernels, ctx.a_dtype = recipe, kernels, a.dtype
        ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
        ctx.n = len(w_ts)
        saved, ctx.w_casts = zip(*map(kept_weight, ws), strict=True)
        ctx.w_dtypes = [w_t.dtype for w_t in w_ts]
        ctx.save_for_backward(*saved, *kept)  # W_i (N_i, K)
        return ys

    @staticmethod
    @first_order("mxmoe.ops.mx_mm_shared")
    def backward(ctx, *dys: Tensor | None):
        need_dx = ctx.needs_input_grad[0]
        saved = ctx.saved_tensors  # read once: under non-reentrant checkpointing each read unpacks
        ws, kept = saved[: ctx.n], tuple(saved[ctx.n :])
        kernels = backward_kernels(ctx.kernels)
        dxs, dw_ts = [], []
        for i, (dy, w) in enumerate(zip(dys, ws, strict=True)):
            need_dw = ctx.needs_input_grad[4 + i]
            if dy is None:
                dw_ts.append(None)
                continue
            dx, dw_t = _backward_gemms(
                dy, restored_weight(w, ctx.w_casts[i], ctx.w_dtypes[i]), kept, ctx.recipe, kernels,
                need_dx, need_dw, ctx.a_dtype,
            )
            dw_ts.append(dw_t)
            if need_dx:  # each op's dx, as autograd hands it to x: through its view and cast
                dxs.append(dx.view(ctx.x_shape).to(ctx.x_dtype))
        dx = sum_like_autograd(dxs) if dxs else None
        return (dx, None, None, None, *dw_ts)


def mx_mm(a: Tensor, b: Tensor, recipe: MXRecipe | None = None) -> Tensor:
    """y = a @ b with MX operands in forward, dgrad and wgrad (differentiable).

    a: (..., K) bf16/fp32 activations, any leading dims (flattened to M rows; M need not be a
       multiple of the block size).
    b: (K, N) bf16/fp32, typically `weight.t()` of a (N, K) nn.Linear weight.
    recipe: the MXRecipe (default mxmoe.DEFAULT_RECIPE).
    K and N must be divisible by recipe.block_size. Returns (..., N) in a's dtype, contiguous; under
    autocast (as torch.mm) a is first cast to the autocast dtype, so the result is of that dtype.
    """
    if type(recipe) is not MXRecipe:  # (None, or one to check: a call only then)
        recipe = as_recipe(recipe)
    if not isinstance(a, Tensor) or not isinstance(b, Tensor):
        raise TypeError(f"mx_mm takes tensors, got a: {type(a).__name__}, b: {type(b).__name__}")
    if b.ndim != 2 or a.ndim < 1 or a.shape[-1] != b.shape[0]:
        raise ValueError(f"mx_mm needs a (..., K) and b (K, N); got a {tuple(a.shape)}, b {tuple(b.shape)}")
    if b.device != a.device:
        raise ValueError(f"mx_mm: a is on {a.device} but b on {b.device}; they must share a device")
    K, N = b.shape
    for name, d in (("K", K), ("N", N)):
        if d % recipe.block_size:
            raise ValueError(
                f"mx_mm: {name}={d} (a {tuple(a.shape)}, b {tuple(b.shape)}) is not divisible by "
                f"block_size={recipe.block_size}"
            )
    lead = a.shape[:-1]
    dev = a.device
    autocast = autocast_on(dev.type)
    if autocast:
        a = autocast_input(a)
    if a.dtype not in INPUT_DTYPES or b.dtype not in INPUT_DTYPES:  # (the checks' own test, inline)
        check_dtype("a", a.dtype)
        check_dtype("b", b.dtype)
    kernels = op_kernels(recipe, dev)
    if autocast:
        with autocast_off(dev.type, kernels.direct):
            y = _mm_call(a, b, recipe, kernels)
    else:  # (no autocast context to enter: µs per call)
        y = _mm_call(a, b, recipe, kernels)
    return y if a.ndim == 2 else y.view(*lead, N)


def _mm_call(a: Tensor, b: Tensor, recipe: MXRecipe, kernels: OpKernels) -> Tensor:
    """mx_mm's (M, N) result of a (..., K) (after autocast, checked) and b (K, N), autocast off."""
    x = a if a.ndim == 2 else a.reshape(-1, b.shape[0])  # (no view op for a 2D a)
    if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad):
        return apply_function(_MXMM, x, b, recipe, kernels, eager=kernels.direct)
    # no graph to record (e.g. validation under no_grad): the forward alone, nothing kept
    return _forward_gemm(_cast_x(x, recipe, kernels, False)[0], b.t(), recipe, kernels, x.dtype)


def mx_mm_shared(
    a: Tensor, bs: list[Tensor] | tuple[Tensor, ...], recipe: MXRecipe | None = None
) -> tuple[Tensor, ...]:
    """(a @ b for b in bs) with one cast of `a`: bit-identical to `mx_mm(a, b, recipe)` per b, in
    outputs and in every gradient, with fewer quantizer calls (e.g. attention's q, k, v).

    a: (..., K) bf16/fp32 activations, as for `mx_mm`.
    bs: one or more (K, N_i) bf16/fp32 tensors, typically `weight.t()` of (N_i, K) weights.
    recipe: the MXRecipe shared by all GEMMs (default mxmoe.DEFAULT_RECIPE).
    Returns a tuple of (..., N_i) tensors in a's dtype (the autocast dtype under autocast),
    contiguous.

    The forward casts a along K once (and along M once, kept for all the wgrads: one saved copy
    instead of one per weight); the backward casts each dy as `mx_mm` does and sums the input
    gradients as autograd sums those of separate `mx_mm` calls (each through its autocast cast, in
    a's dtype, the last weight's first), so the result is the same bits.
    """
    recipe = as_recipe(recipe)
    if not isinstance(a, Tensor):
        raise TypeError(f"mx_mm_shared takes a tensor a, got {type(a).__name__}")
    if not isinstance(bs, (list, tuple)) or not bs or not all(isinstance(b, Tensor) for b in bs):
        raise TypeError(f"mx_mm_shared takes bs: a non-empty list or tuple of tensors, got {bs!r}")
    for b in bs:
        if b.ndim != 2 or a.ndim < 1 or a.shape[-1] != b.shape[0]:
            raise ValueError(
                f"mx_mm_shared needs a (..., K) and each b (K, N); got a {tuple(a.shape)}, "
                f"b {tuple(b.shape)}"
            )
        if b.device != a.device:
            raise ValueError(
                f"mx_mm_shared: a is on {a.device} but b on {b.device}; they must share a device"
            )
        for name, d in (("K", b.shape[0]), ("N", b.shape[1])):
            if d % recipe.block_size:
                raise ValueError(
                    f"mx_mm_shared: {name}={d} (a {tuple(a.shape)}, b {tuple(b.shape)}) is not "
                    f"divisible by block_size={recipe.block_size}"
                )
    lead = a.shape[:-1]
    cast_to = autocast_target(a)
    check_dtype("a", a.dtype if cast_to is None else cast_to)
    for b in bs:
        check_dtype("b", b.dtype)
    kernels = op_kernels(recipe, a.device)
    with no_autocast(a.device, kernels.direct):
        if torch.is_grad_enabled() and (a.requires_grad or any(b.requires_grad for b in bs)):
            ys = apply_function(_MXMMShared, a, cast_to, recipe, kernels, *bs, eager=kernels.direct)
        else:  # no graph to record (e.g. validation under no_grad): the forward alone, nothing kept
            ys = _mm_shared_forward(a, cast_to, recipe, kernels, [b.t() for b in bs], False)[0]
    return tuple(y if a.ndim == 2 else y.view(*lead, b.shape[1]) for y, b in zip(ys, bs, strict=True))
