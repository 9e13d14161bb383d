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
The weights go through `cache_weight_casts`.

Other backends (the MX path, e.g. "fp8"): the casts along M run on a copy of the tokens in which each
group starts at a multiple of the block size (`mxmoe.quant.groups`: group e occupies ceil(nₑ/32)·32
rows, gaps zero, static size roundup(T + 31·E, 32)); the fused dim0+dim1 cast runs on it, the dim0
result is gathered back to the T rows (an fp8 row gather), and the wgrad GEMM takes the padded
operands. The "emulated" backend taken through this path (tests) gathers its dequantized operands
back and makes the qdq path's dgrad and wgrad calls, so the two paths are bit-identical.

MX activations (an `MXTensor` from the MXFP8 dispatch, 2D, blocked along K) feed the forward GEMM
as they are, without dequantize/requantize; their gradient flows through `a.grad_anchor`. The
wgrad needs them along M: they are dequantized (to their orig_dtype) and cast along M per group.
They must have been quantized with the op's recipe (scaling mode, element dtype, block size).
"""

from __future__ import annotations

import torch
from torch import Tensor

from mxmoe.ops.config import as_recipe
from mxmoe.ops.gemm import autocast_input, hp_gemm, mx_gemm, no_autocast, uses_qdq
from mxmoe.ops.linear import (
    dgrad_mx,
    needs_grads,
    swap_last2,
    wants_grad,
    weight_mx,
    weight_qdq,
    wgrad_mx,
)
from mxmoe.quant.groups import group_padding, pad_groups
from mxmoe.quant.mx_tensor import MXTensor, to_mx, to_mx_dim0_dim1
from mxmoe.quant.qdq import qdq, qdq_dim0_dim1
from mxmoe.recipe import MXRecipe

__all__ = ["mx_grouped_mm"]


def _mx(q: Tensor, s: Tensor, axis: int, cfg: MXRecipe, mode: str, dtype: torch.dtype) -> MXTensor:
    return MXTensor(q, s, axis, cfg.block_size, mode, dtype)


class _MXGroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, a_q, a_s, a_mode, b_t, offs, cfg: MXRecipe, out_dtype):
        # a: (T, K) high precision, or the grad anchor of an MX activation given as (a_q, a_s).
        # b_t: (E, K, N), the transposed view of the expert weights w (E, N, K).
        is_mx = a_q is not None
        T = a.shape[0]
        need_dw = wants_grad(b_t)
        hp = uses_qdq(cfg)
        compute = cfg.compute_dtype(b_t.device)
        ctx.cfg, ctx.is_mx, ctx.a_dtype, ctx.a_mode = cfg, is_mx, out_dtype, a_mode
        pos = offs_pad = a1q = a1s = a1 = None
        cap = 0
        if need_dw and not hp:
            pos, offs_pad, cap = group_padding(offs, T, cfg.block_size)
        w = b_t.transpose(-2, -1)
        if is_mx:
            a0 = _mx(a_q, a_s, 1, cfg, a_mode, out_dtype)
            if hp:
                a0 = a0.dequantize(compute, kernel=cfg.dim0_kernel)
        elif need_dw and hp:  # one read of a: along K, and along M in groups (kept for the wgrad)
            a0, a1 = qdq_dim0_dim1(a, recipe=cfg, out_dtype=compute, offs=offs)
        elif need_dw:
            p0, a1 = to_mx_dim0_dim1(pad_groups(a, offs, pos, cap), recipe=cfg)
            a0, a1q, a1s = p0.index_rows(pos), a1.qdata_blocked, a1.scale_blocked
        elif hp:
            a0 = qdq(a, -1, recipe=cfg, out_dtype=compute)
        else:
            a0 = to_mx(a, axis=-1, recipe=cfg)
        # w (E, N, K) along K: its rows, read in place
        if hp:
            y = hp_gemm(a0, weight_qdq(w, -1, cfg, compute).transpose(-2, -1), offs, out_dtype)
        else:
            y = mx_gemm(a0, swap_last2(weight_mx(w, -1, cfg)), offs, cfg, out_dtype=out_dtype)
        ctx.cap = cap
        if not need_dw:
            ctx.save_for_backward(b_t, offs)
        elif is_mx and hp:
            ctx.save_for_backward(b_t, offs, a_q, a_s)
        elif is_mx:
            ctx.save_for_backward(b_t, offs, pos, offs_pad, a_q, a_s)
        elif hp:  # the tokens along M in groups, (T, K) compute dtype
            ctx.save_for_backward(b_t, offs, a1)
        else:  # the tokens along M as MX: (K, cap) elements and scales
            ctx.save_for_backward(b_t, offs, pos, offs_pad, a1q, a1s)
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):
        cfg: MXRecipe = ctx.cfg
        need_da, need_dw = needs_grads(ctx, 0, 4)
        b_t, offs = ctx.saved_tensors[:2]
        w = b_t.transpose(-2, -1)
        hp = uses_qdq(cfg)
        compute = cfg.compute_dtype(dy.device)
        dy = dy.contiguous()
        da = db_t = None
        dy0 = dy1 = None
        if need_dw and hp:
            if need_da:  # one read of dy: along N, and along M in groups
                dy0, dy1 = qdq_dim0_dim1(dy, recipe=cfg, out_dtype=compute, offs=offs)
            else:
                dy1 = qdq(dy, -2, recipe=cfg, out_dtype=compute, offs=offs)
            if ctx.is_mx:  # dequantize the MX activation and cast it along M (see module docstring)
                sq, ss = ctx.saved_tensors[2:]
                a_hp = _mx(sq, ss, 1, cfg, ctx.a_mode, ctx.a_dtype).dequantize(kernel=cfg.dim0_kernel)
                a1 = qdq(a_hp, -2, recipe=cfg, out_dtype=compute, offs=offs)
            else:
                (a1,) = ctx.saved_tensors[2:]
            # K-grouped (E, N, K): dy1ᵀ (N, T) and a1 (T, K), both T-major, grouped by the real offs
            db_t = hp_gemm(dy1.t(), a1, offs, b_t.dtype).transpose(-2, -1)
        elif need_dw:
            pos, offs_pad, sq, ss = ctx.saved_tensors[2:]
            dy_pad = pad_groups(dy, offs, pos, ctx.cap)
            if need_da:
                p0, dy1 = to_mx_dim0_dim1(dy_pad, recipe=cfg)
                dy0 = p0.index_rows(pos)
            else:
                dy1 = to_mx(dy_pad, axis=0, recipe=cfg)
            if ctx.is_mx:  # dequantize the MX activation and cast it along M (see module docstring)
                a_hp = _mx(sq, ss, 1, cfg, ctx.a_mode, ctx.a_dtype).dequantize(kernel=cfg.dim0_kernel)
                a1 = to_mx(pad_groups(a_hp, offs, pos, ctx.cap), axis=0, recipe=cfg)
            else:
                a1 = _mx(sq, ss, 0, cfg, cfg.scaling_mode, ctx.a_dtype)
            db_t = wgrad_mx(dy1, a1, pos, offs, offs_pad, cfg, b_t.dtype).transpose(-2, -1)
        elif need_da:
            dy0 = qdq(dy, -1, recipe=cfg, out_dtype=compute) if hp else to_mx(dy, axis=-1, recipe=cfg)
        if need_da:  # w (E, N, K) along N per expert, row-major (torch._grouped_mm's row-major b)
            if hp:
                da = hp_gemm(dy0, weight_qdq(w, -2, cfg, compute), offs, ctx.a_dtype)
            else:
                da = dgrad_mx(dy0, weight_mx(w, -2, cfg), offs, cfg, ctx.a_dtype)
        return da, None, None, None, db_t, None, None, None


def mx_grouped_mm(
    a: Tensor | MXTensor, b_t: Tensor, offs: Tensor, config: MXRecipe | None = None
) -> Tensor:
    """Drop-in for torch._grouped_mm(a, b_t, offs=offs) with MX operands in forward and backward.

    a: (T, K) bf16/fp32 tokens grouped by expert (group e = rows offs[e-1]:offs[e]); or a 2D
       MXTensor blocked along K (axis=1), e.g. from mxmoe.comm.a2a_dispatch_mxfp8: used as is in
       the forward GEMM; differentiable through `a.grad_anchor` (dense gradient) when present. It
       must match the recipe: same scaling_mode, element dtype and block size.
    b_t: (E, K, N) bf16/fp32, the transposed view of (E, N, K) expert weights.
    offs: (E,) int32 cumulative group ends, offs[-1] <= T (rows after it belong to no group and
       give zero output). Any group sizes, including 0 and sizes not a multiple of 32.
    config: the MXRecipe (default mxmoe.DEFAULT_RECIPE; `MXOpConfig(...)` builds one).
    K and N must be divisible by config.block_size. Returns (T, N) contiguous in a's (orig) dtype;
    under autocast (as torch._grouped_mm in bf16 training) a Tensor a is first cast to the autocast dtype.
    """
    cfg = as_recipe(config)
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
        diff = [
            f"{name}={got!r} (recipe: {want!r})"
            for name, got, want in (
                ("scaling_mode", a.scaling_mode, cfg.scaling_mode),
                ("elem_dtype", a.elem_dtype, cfg.elem_dtype),
                ("block_size", a.block_size, cfg.block_size),
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
        a = autocast_input(a)
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
    with no_autocast(b_t.device):
        return _MXGroupedMM.apply(*args, b_t, offs, cfg, out_dtype)
