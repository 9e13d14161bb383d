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
(N, K), as bf16 training's dgrad takes W. The weight casts (along K in forward, along N in
backward) go through `cache_weight_casts` (once per optimizer step inside its scope).
Other backends get MXTensors (`to_mx`, `to_mx_dim0_dim1`) of zero-padded rows and `mx_gemm`; the
"emulated" backend taken through that path (tests) makes the qdq path's dgrad and wgrad calls on
its dequantized operands (`dgrad_mx`, `wgrad_mx`), so the two paths are bit-identical.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from mxmoe.ops.config import as_recipe
from mxmoe.ops.gemm import autocast_input, hp_gemm, mx_gemm, no_autocast, uses_qdq
from mxmoe.ops.weight_cache import cached_cast
from mxmoe.quant.mx_tensor import MXTensor, to_mx, to_mx_dim0_dim1
from mxmoe.quant.qdq import qdq, qdq_dim0_dim1
from mxmoe.recipe import MXRecipe


def needs_grads(ctx, *indices: int) -> tuple[bool, ...]:
    """`ctx.needs_input_grad[i]` for each index."""
    return tuple(bool(ctx.needs_input_grad[i]) for i in indices)


def wants_grad(t: Tensor) -> bool:
    """Whether a forward must keep what the gradient of `t` needs (`t.requires_grad`)."""
    return t.requires_grad


def swap_last2(t: MXTensor) -> MXTensor:
    """The MXTensor whose logical shape has the last two dims of `t` swapped: same storage, the
    block axis follows its dim (2D: the transpose)."""
    return MXTensor(
        t.qdata_blocked,
        t.scale_blocked,
        2 * t.ndim - 3 - t.axis,
        t.block_size,
        t.scaling_mode,
        t.orig_dtype,
    )


def _slice_rows(t: MXTensor, rows: int) -> MXTensor:
    """First `rows` rows of a dim0-blocked 2D MXTensor (a view, stays contiguous)."""
    return MXTensor(
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


def cast_both(x: Tensor, cfg: MXRecipe) -> tuple[MXTensor, MXTensor]:
    """x (M, C) -> (along C: logical (M, C) axis 1, along M: logical (M_pad, C) axis 0), M_pad =
    M rounded up to the block size with zero rows, from one fused read."""
    M = x.shape[0]
    d0, d1 = to_mx_dim0_dim1(pad_rows(x, cfg.block_size), recipe=cfg)
    return (_slice_rows(d0, M) if d0.shape[0] != M else d0), d1


def cast_rows(x: Tensor, cfg: MXRecipe) -> MXTensor:
    """x (M, C) -> along M, logical (M_pad, C) axis 0, zero-padded rows."""
    return to_mx(pad_rows(x, cfg.block_size), axis=0, recipe=cfg)


def weight_qdq(w: Tensor, axis: int, cfg: MXRecipe, dtype: torch.dtype) -> Tensor:
    """qdq of a weight (any strides, e.g. W (N, K) or w (E, N, K)) along `axis` (-1 or -2) in
    `dtype`, reused within a `cache_weight_casts` scope while w is unchanged."""
    return cached_cast(w, ("qdq", axis, cfg, dtype), lambda: qdq(w, axis, recipe=cfg, out_dtype=dtype))


def weight_mx(w: Tensor, axis: int, cfg: MXRecipe) -> MXTensor:
    """to_mx of a weight along `axis`, reused like `weight_qdq`."""
    return cached_cast(w, ("mx", axis, cfg), lambda: to_mx(w, axis, recipe=cfg))


def dgrad_mx(
    dy0: MXTensor, w1: MXTensor, offs: Tensor | None, cfg: MXRecipe, out_dtype: torch.dtype
) -> Tensor:
    """The MX path's input gradient dy0 W: dy0 logical (M, N) blocked along N, w1 the weight cast
    along N, logical (N, K) or (E, N, K) (to_mx's storage: (K, N) / (E, K, N)); offs groups the
    rows of dy0 (None: dense). Returns (M, K).

    The emulated backend dequantizes, makes the weight row-major ((N, K) / (E, N, K), the layout
    the qdq path's weight cast has) and makes the qdq path's dgrad call (`hp_gemm(dy0, w1, offs)`),
    so the two paths stay bit-identical. Other backends get the MX operands."""
    if cfg.gemm_backend != "emulated":
        return mx_gemm(dy0, w1, offs, cfg, out_dtype=out_dtype)
    compute = cfg.compute_dtype(dy0.device)
    d = dy0.dequantize(compute, kernel=cfg.dim0_kernel)
    w = w1.dequantize(compute, kernel=cfg.dim0_kernel).contiguous()
    return hp_gemm(d, w, offs, out_dtype)


def wgrad_mx(
    dy1: MXTensor, x1: MXTensor, rows: Tensor | int, offs: Tensor | None, offs_pad: Tensor | None,
    cfg: MXRecipe, out_dtype: torch.dtype,
) -> Tensor:
    """The MX path's weight gradient dy1ᵀ x1 from the casts along M of zero-padded copies: dy1
    logical (M_pad, N), x1 (M_pad, K), both blocked along M; rows: M (dense: the real rows are the
    first M) or pos (grouped: where each real row sits in the padded copy); offs_pad groups the
    padded rows (None: dense). Returns (N, K), or (E, N, K) when grouped.

    The emulated backend dequantizes, takes the real rows back (row-major (M, ·)) and makes the GEMM
    call of the qdq path (`hp_gemm(dy1ᵀ, x1, offs)`), so the two paths stay bit-identical (a GEMM's
    result depends on its operands' layout and reduction length, not only on their values). Other
    backends get the padded MX operands (32-aligned groups)."""
    if cfg.gemm_backend != "emulated":
        return mx_gemm(swap_last2(dy1), x1, offs_pad, cfg, out_dtype=out_dtype)
    compute = cfg.compute_dtype(x1.device)
    d, a = (t.dequantize(compute, kernel=cfg.dim0_kernel) for t in (dy1, x1))
    if isinstance(rows, Tensor):
        d, a = d.index_select(0, rows), a.index_select(0, rows)
    else:
        d, a = d[:rows].contiguous(), a[:rows].contiguous()
    return hp_gemm(d.t(), a, offs, out_dtype)


class _MXMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, w_t: Tensor, cfg: MXRecipe) -> Tensor:
        # x (M, K); w_t (K, N), the transposed view of W (N, K)
        compute = cfg.compute_dtype(x.device)
        need_dw = wants_grad(w_t)
        w = w_t.t()
        x1q = x1s = x1 = None
        hp = uses_qdq(cfg)
        if hp:
            if need_dw:  # one read of x: along K, and along M (kept for the wgrad, row-major)
                x0, x1 = qdq_dim0_dim1(x, recipe=cfg, out_dtype=compute)
            else:
                x0 = qdq(x, -1, recipe=cfg, out_dtype=compute)
            y = hp_gemm(x0, weight_qdq(w, -1, cfg, compute).t(), None, x.dtype)
        else:
            if need_dw:
                x0, x1 = cast_both(x, cfg)
                x1q, x1s = x1.qdata_blocked, x1.scale_blocked
            else:
                x0 = to_mx(x, axis=-1, recipe=cfg)
            y = mx_gemm(x0, swap_last2(weight_mx(w, -1, cfg)), config=cfg)
        ctx.cfg = cfg
        ctx.x_dtype = x.dtype
        if need_dw and hp:  # x along M, (M, K) compute dtype
            ctx.save_for_backward(w_t, x1)
        elif need_dw:  # x along M as MX: (K, M_pad) elements and scales
            ctx.save_for_backward(w_t, x1q, x1s)
        else:
            ctx.save_for_backward(w_t)
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):
        cfg: MXRecipe = ctx.cfg
        need_dx, need_dw = needs_grads(ctx, 0, 1)
        w_t = ctx.saved_tensors[0]
        w = w_t.t()
        compute = cfg.compute_dtype(dy.device)
        M, bs = dy.shape[0], cfg.block_size
        dx = dw_t = None
        dy = dy.contiguous()
        if uses_qdq(cfg):
            if need_dx and need_dw:  # one read of dy: along N, and along M (row-major)
                dy0, dy1 = qdq_dim0_dim1(dy, recipe=cfg, out_dtype=compute)
            elif need_dx:
                dy0 = qdq(dy, -1, recipe=cfg, out_dtype=compute)
            else:
                dy1 = qdq(dy, -2, recipe=cfg, out_dtype=compute)
            if need_dx:  # W (N, K) along N, row-major
                dx = hp_gemm(dy0, weight_qdq(w, -2, cfg, compute), None, ctx.x_dtype)
            if need_dw:  # dy1ᵀ (N, M) and x1 (M, K), both M-major, as bf16 training's wgrad
                dw_t = hp_gemm(dy1.t(), ctx.saved_tensors[1], None, w_t.dtype).t()  # (N, K) -> (K, N)
            return dx, dw_t, None
        x1 = None
        if need_dw:
            _, xq, xs = ctx.saved_tensors
            x1 = MXTensor(xq, xs, 0, bs, cfg.scaling_mode, ctx.x_dtype)  # logical (M_pad, K)
        if need_dx and need_dw:
            dy0, dy1 = cast_both(dy, cfg)
        elif need_dx:
            dy0 = to_mx(dy, axis=-1, recipe=cfg)
        else:
            dy1 = cast_rows(dy, cfg)
        if need_dx:
            dx = dgrad_mx(dy0, weight_mx(w, -2, cfg), None, cfg, ctx.x_dtype)
        if need_dw:
            dw_t = wgrad_mx(dy1, x1, M, None, None, cfg, w_t.dtype).t()
        return dx, dw_t, None


def mx_mm(a: Tensor, b: Tensor, config: MXRecipe | None = None) -> Tensor:
    """y = a @ b with MX operands in forward, dgrad and wgrad (differentiable).

    a: (..., K) bf16/fp32 activations, any leading dims (flattened to M rows; M need not be a
       multiple of the block size).
    b: (K, N) bf16/fp32, typically `weight.t()` of a (N, K) nn.Linear weight.
    config: the MXRecipe (default mxmoe.DEFAULT_RECIPE; `MXOpConfig(...)` builds one).
    K and N must be divisible by config.block_size. Returns (..., N) in a's dtype, contiguous; under
    autocast (as torch.mm) a is first cast to the autocast dtype, so the result is of that dtype.
    """
    cfg = as_recipe(config)
    if not isinstance(a, Tensor) or not isinstance(b, Tensor):
        raise TypeError(f"mx_mm takes tensors, got a: {type(a).__name__}, b: {type(b).__name__}")
    if b.ndim != 2 or a.ndim < 1 or a.shape[-1] != b.shape[0]:
        raise ValueError(f"mx_mm needs a (..., K) and b (K, N); got a {tuple(a.shape)}, b {tuple(b.shape)}")
    K, N = b.shape
    for name, d in (("K", K), ("N", N)):
        if d % cfg.block_size:
            raise ValueError(
                f"mx_mm: {name}={d} (a {tuple(a.shape)}, b {tuple(b.shape)}) is not divisible by "
                f"block_size={cfg.block_size}"
            )
    lead = a.shape[:-1]
    a = autocast_input(a)
    with no_autocast(a.device):
        y = _MXMM.apply(a.reshape(-1, K), b, cfg)
    return y if a.ndim == 2 else y.view(*lead, N)
