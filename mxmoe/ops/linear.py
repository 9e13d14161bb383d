"""`mx_mm`: y = a @ b for a linear layer, every GEMM of forward and backward on MX operands.

With y = x Wᵀ (x: M x K, W: N x K, b = Wᵀ a (K, N) view), each operand is quantized along the
dim its GEMM reduces over (../shared/design/mx-numerics.md):
  forward  y  = x Wᵀ : x along K (dim0 of x),  W along K (dim0 of W)
  dgrad    dx = dy W : dy along N (dim0 of dy), W along N (dim1 of W)
  wgrad    dW = dyᵀ x: dy along M (dim1 of dy), x along M (dim1 of x)
x and dy are cast both ways by the fused dim0+dim1 cast (one read); the forward keeps x's dim1
cast (fp8, half of bf16 x) for the wgrad instead of x itself. W is re-cast along N in backward
from the parameter (free to keep). Rows are zero-padded to a multiple of the block size for the
casts along M (zero rows add nothing to dW).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from mxmoe.ops.config import MXOpConfig
from mxmoe.ops.gemm import mx_gemm
from mxmoe.quant.mx_tensor import MXTensor, to_mx, to_mx_dim0_dim1


def needs_grads(ctx, *indices: int) -> tuple[bool, ...]:
    """`ctx.needs_input_grad[i]` for each index."""
    return tuple(bool(ctx.needs_input_grad[i]) for i in indices)


def wants_grad(t: Tensor) -> bool:
    """Whether a forward must keep what the gradient of `t` needs (`t.requires_grad`)."""
    return t.requires_grad


def transpose_2d(t: MXTensor) -> MXTensor:
    """The transpose of a 2D MXTensor: same storage, blocks along the other logical axis."""
    return MXTensor(
        t.qdata_blocked,
        t.scale_blocked,
        1 - t.axis,
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


def cast_both(x: Tensor, cfg: MXOpConfig) -> tuple[MXTensor, MXTensor]:
    """x (M, C) -> (along C: logical (M, C) axis 1, along M: logical (M_pad, C) axis 0), M_pad =
    M rounded up to the block size with zero rows, from one fused read."""
    M = x.shape[0]
    pad = -M % cfg.block_size
    xp = F.pad(x, (0, 0, 0, pad)) if pad else x
    d0, d1 = to_mx_dim0_dim1(xp, **cfg.cast_kwargs(dim1=True))
    return (_slice_rows(d0, M) if pad else d0), d1


def cast_rows(x: Tensor, cfg: MXOpConfig) -> MXTensor:
    """x (M, C) -> along M, logical (M_pad, C) axis 0, zero-padded rows."""
    pad = -x.shape[0] % cfg.block_size
    xp = F.pad(x, (0, 0, 0, pad)) if pad else x
    return to_mx(xp, axis=0, **cfg.cast_kwargs(dim1=True))


class _MXMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, w_t: Tensor, cfg: MXOpConfig) -> Tensor:
        compute = cfg.compute_dtype(x.device)
        need_dw = wants_grad(w_t)
        if need_dw:
            x0, x1 = cast_both(x, cfg)
        else:
            x0, x1 = to_mx(x, axis=-1, **cfg.cast_kwargs()), None
        w0 = to_mx(w_t, axis=0, **cfg.cast_kwargs())  # (K, N) along K: W's rows, read in place
        y = mx_gemm(x0, w0, backend=cfg.gemm_backend, compute_dtype=compute, kernel=cfg.kernel)
        ctx.cfg = cfg
        ctx.m = x.shape[0]
        ctx.x_dtype = x.dtype
        if need_dw:
            ctx.save_for_backward(w_t, x1.qdata_blocked, x1.scale_blocked)
        else:
            ctx.save_for_backward(w_t)
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):
        cfg: MXOpConfig = ctx.cfg
        need_dx, need_dw = needs_grads(ctx, 0, 1)
        w_t = ctx.saved_tensors[0]
        compute = cfg.compute_dtype(dy.device)
        kw = {"backend": cfg.gemm_backend, "compute_dtype": compute, "kernel": cfg.kernel}
        dx = dw_t = None
        dy = dy.contiguous()
        if need_dx and need_dw:
            dy0, dy1 = cast_both(dy, cfg)
        elif need_dx:
            dy0, dy1 = to_mx(dy, axis=-1, **cfg.cast_kwargs()), None
        else:
            dy0, dy1 = None, cast_rows(dy, cfg)
        if need_dx:
            # W (N, K) along N: to_mx of the (K, N) view along its last dim reads W by columns.
            w1 = to_mx(w_t.t(), axis=0, **cfg.cast_kwargs(dim1=True))  # logical (N, K), axis 0
            dx = mx_gemm(dy0, w1, out_dtype=ctx.x_dtype, **kw)
        if need_dw:
            _, xq, xs = ctx.saved_tensors
            x1 = MXTensor(xq, xs, 0, cfg.block_size, cfg.scaling_mode, ctx.x_dtype)  # (M_pad, K)
            dw = mx_gemm(transpose_2d(dy1), x1, out_dtype=w_t.dtype, **kw)  # (N, K)
            dw_t = dw.t()
        return dx, dw_t, None


def mx_mm(a: Tensor, b: Tensor, config: MXOpConfig | None = None) -> Tensor:
    """y = a @ b with MX operands in forward, dgrad and wgrad (differentiable).

    a: (..., K) bf16/fp32 activations, any leading dims (flattened to M rows; M need not be a
       multiple of the block size).
    b: (K, N) bf16/fp32, typically `weight.t()` of a (N, K) nn.Linear weight.
    K and N must be divisible by config.block_size. Returns (..., N) in a's dtype, contiguous.
    """
    cfg = MXOpConfig() if config is None else config
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
    y = _MXMM.apply(a.reshape(-1, K), b, cfg)
    return y if a.ndim == 2 else y.view(*lead, N)
