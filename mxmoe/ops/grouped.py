"""`mx_grouped_mm`: torch._grouped_mm for MoE experts with every GEMM on MX operands.

a (T, K) tokens sorted by expert, b_t (E, K, N) = w.transpose(-2, -1) of expert weights w (E, N, K),
offs (E,) int32 cumulative ends. Axes (y = a Wₑᵀ per group):
  forward  y  = a Wₑᵀ   : a along K (dim0),  Wₑ along K (dim0 of w)
  dgrad    da = dy Wₑ   : dy along N (dim0), Wₑ along N (dim1 of w)
  wgrad    dWₑ = dyₑᵀ aₑ: dy and a along M (dim1), reduced over each expert's tokens only.

Wgrad blocks along M must not straddle two experts, so the casts along M run on a copy of the
tokens in which each group starts at a multiple of the block size: group e occupies
ceil(nₑ/32)·32 rows, the gaps are zero (zeros add nothing to dWₑ). The padded tensor has the
static size roundup(T + 31·E, 32), so nothing syncs with the host and torch.compile sees fixed
shapes. Empty experts get zero rows and dWₑ = 0. The fused dim0+dim1 cast runs on the padded
tensor; the dim0 result is gathered back to the T real rows (an fp8 row gather).

MX activations (an `MXTensor` from the MXFP8 dispatch, 2D, blocked along K) feed the forward GEMM
as they are, without dequantize/requantize; their gradient flows through `a.grad_anchor`. The
wgrad needs them along M: they are dequantized (to their orig_dtype), padded and cast along M.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mxmoe.ops.config import MXOpConfig
from mxmoe.ops.gemm import mx_gemm
from mxmoe.ops.linear import needs_grads, transpose_2d, wants_grad
from mxmoe.quant.mx_tensor import MXTensor, to_mx, to_mx_dim0_dim1


def group_padding(offs: Tensor, rows: int, block_size: int) -> tuple[Tensor, Tensor, int]:
    """Where each of `rows` tokens goes when every group starts at a multiple of `block_size`.

    offs: (E,) int cumulative group ends. Returns pos (rows,) int64 destination rows, offs_pad (E,)
    int32 padded cumulative ends (the last extended to the padded size), and the padded size
    roundup(rows + (block_size - 1) E, block_size). Rows at or after offs[-1] (in no group) go to
    the tail, after the last padded group, and are zeroed by `pad_groups`.
    """
    E = offs.shape[0]
    cap = -(-(rows + (block_size - 1) * E) // block_size) * block_size
    ends = offs.to(torch.int64)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    padded = (counts + block_size - 1) // block_size * block_size
    ends_pad = torch.cumsum(padded, 0)
    t = torch.arange(rows, device=offs.device)
    g = torch.searchsorted(ends, t, right=True)
    gc = g.clamp(max=E - 1)
    pos = (ends_pad - padded)[gc] + t - (ends - counts)[gc]
    pos = torch.where(g < E, pos, ends_pad[-1] + t - ends[-1])
    offs_pad = torch.cat([ends_pad[:-1], ends_pad.new_full((1,), cap)]).to(torch.int32)
    return pos, offs_pad, cap


def pad_groups(x: Tensor, offs: Tensor, pos: Tensor, cap: int) -> Tensor:
    """x (T, C) -> (cap, C): row t moved to pos[t], gaps zero, rows outside every group zeroed."""
    valid = (torch.arange(x.shape[0], device=x.device) < offs[-1].to(torch.int64)).unsqueeze(1)
    src = torch.where(valid, x, torch.zeros((), dtype=x.dtype, device=x.device))
    return x.new_zeros(cap, x.shape[1]).index_copy(0, pos, src)


def _mx(q: Tensor, s: Tensor, axis: int, cfg: MXOpConfig, mode: str, dtype: torch.dtype) -> MXTensor:
    return MXTensor(q, s, axis, cfg.block_size, mode, dtype)


class _MXGroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, a_q, a_s, a_mode, b_t, offs, cfg: MXOpConfig, out_dtype):
        # a: (T, K) high precision, or the grad anchor of an MX activation given as (a_q, a_s).
        is_mx = a_q is not None
        T = a.shape[0]
        need_dw = wants_grad(b_t)
        ctx.cfg, ctx.is_mx, ctx.a_dtype, ctx.a_mode = cfg, is_mx, out_dtype, a_mode
        pos = offs_pad = a1 = None
        cap = 0
        if need_dw:
            pos, offs_pad, cap = group_padding(offs, T, cfg.block_size)
        if is_mx:
            a0 = _mx(a_q, a_s, 1, cfg, a_mode, out_dtype)
        elif need_dw:
            p0, a1 = to_mx_dim0_dim1(pad_groups(a, offs, pos, cap), **cfg.cast_kwargs(dim1=True))
            a0 = p0.index_rows(pos)
        else:
            a0 = to_mx(a, axis=-1, **cfg.cast_kwargs())
        w0 = to_mx(b_t, axis=-2, **cfg.cast_kwargs())  # (E, K, N) along K: w's rows, read in place
        y = mx_gemm(
            a0,
            w0,
            offs,
            backend=cfg.gemm_backend,
            compute_dtype=cfg.compute_dtype(b_t.device),
            kernel=cfg.kernel,
            out_dtype=out_dtype,
        )
        ctx.cap = cap
        if not need_dw:
            ctx.save_for_backward(b_t, offs)
        elif is_mx:
            ctx.save_for_backward(b_t, offs, pos, offs_pad, a_q, a_s)
        else:
            ctx.save_for_backward(b_t, offs, pos, offs_pad, a1.qdata_blocked, a1.scale_blocked)
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):
        cfg: MXOpConfig = ctx.cfg
        need_da, need_dw = needs_grads(ctx, 0, 4)
        b_t, offs = ctx.saved_tensors[:2]
        kw = {
            "backend": cfg.gemm_backend,
            "compute_dtype": cfg.compute_dtype(dy.device),
            "kernel": cfg.kernel,
        }
        dy = dy.contiguous()
        da = db_t = None
        if need_dw:
            pos, offs_pad, sq, ss = ctx.saved_tensors[2:]
            dy_pad = pad_groups(dy, offs, pos, ctx.cap)
            if need_da:
                p0, dy1 = to_mx_dim0_dim1(dy_pad, **cfg.cast_kwargs(dim1=True))
                dy0 = p0.index_rows(pos)
            else:
                dy0, dy1 = None, to_mx(dy_pad, axis=0, **cfg.cast_kwargs(dim1=True))
            if ctx.is_mx:  # dequantize the MX activation and cast it along M (see module docstring)
                a_hp = _mx(sq, ss, 1, cfg, ctx.a_mode, ctx.a_dtype).dequantize(kernel=cfg.kernel)
                a1 = to_mx(pad_groups(a_hp, offs, pos, ctx.cap), axis=0, **cfg.cast_kwargs(dim1=True))
            else:
                a1 = _mx(sq, ss, 0, cfg, cfg.scaling_mode, ctx.a_dtype)
            dw = mx_gemm(transpose_2d(dy1), a1, offs_pad, out_dtype=b_t.dtype, **kw)  # (E, N, K)
            db_t = dw.transpose(-2, -1)
        elif need_da:
            dy0 = to_mx(dy, axis=-1, **cfg.cast_kwargs())
        if need_da:
            # w (E, N, K) along N: the transposing cast of the contiguous weights.
            w1 = to_mx(b_t.transpose(-2, -1), axis=-2, **cfg.cast_kwargs(dim1=True))
            da = mx_gemm(dy0, w1, offs, out_dtype=ctx.a_dtype, **kw)
        return da, None, None, None, db_t, None, None, None


def mx_grouped_mm(
    a: Tensor | MXTensor, b_t: Tensor, offs: Tensor, config: MXOpConfig | None = None
) -> Tensor:
    """Drop-in for torch._grouped_mm(a, b_t, offs=offs) with MX operands in forward and backward.

    a: (T, K) bf16/fp32 tokens grouped by expert (group e = rows offs[e-1]:offs[e]); or a 2D
       MXTensor blocked along K (axis=1), e.g. from mxmoe.comm.a2a_dispatch_mxfp8: used as is in
       the forward GEMM; differentiable through `a.grad_anchor` (dense gradient) when present.
    b_t: (E, K, N) bf16/fp32, the transposed view of (E, N, K) expert weights.
    offs: (E,) int32 cumulative group ends, offs[-1] <= T (rows after it belong to no group and
       give zero output). Any group sizes, including 0 and sizes not a multiple of 32.
    K and N must be divisible by config.block_size. Returns (T, N) contiguous in a's (orig) dtype.
    """
    cfg = MXOpConfig() if config is None else config
    if not isinstance(b_t, Tensor) or b_t.ndim != 3:
        raise ValueError(
            f"b_t must be a 3D tensor (E, K, N), got {getattr(b_t, 'shape', type(b_t).__name__)}"
        )
    if not isinstance(offs, Tensor) or offs.ndim != 1 or offs.shape[0] != b_t.shape[0]:
        raise ValueError(f"offs must be a 1D int32 tensor of E={b_t.shape[0]} group ends, got {offs!r}")
    if offs.dtype != torch.int32:
        raise TypeError(f"offs has dtype {offs.dtype}; expected torch.int32 (as torch._grouped_mm)")
    E, K, N = b_t.shape
    if isinstance(a, MXTensor):
        if a.ndim != 2 or a.axis != 1:
            raise ValueError(f"an MXTensor a must be 2D and blocked along K (axis=-1), got {a}")
        if a.block_size != cfg.block_size or a.elem_dtype != cfg.elem_dtype:
            raise ValueError(
                f"MXTensor a has block_size={a.block_size}, elem {a.elem_dtype}; the config wants "
                f"block_size={cfg.block_size}, elem {cfg.elem_dtype}"
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
        T = a.shape[0]
        args = (a, None, None, cfg.scaling_mode)
        out_dtype = a.dtype
    else:
        raise TypeError(f"a must be a Tensor or an MXTensor, got {type(a).__name__}")
    if a.shape[1] != K:
        raise ValueError(f"a has K={a.shape[1]} but b_t {tuple(b_t.shape)} has K={K}")
    for name, d in (("K", K), ("N", N)):
        if d % cfg.block_size:
            raise ValueError(f"mx_grouped_mm: {name}={d} is not divisible by block_size={cfg.block_size}")
    del T
    return _MXGroupedMM.apply(*args, b_t, offs, cfg, out_dtype)
