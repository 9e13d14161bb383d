"""Routed experts: the high-precision `GroupedExperts` (what the model builds, what
`mxmoe.convert` swaps for its MX version).

Weights are stored torchtitan-style as (E, N, K) — out-features by in-features per expert — and
used through transposed (E, K, N) views by the grouped GEMM.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mxmoe.ops.gemm import autocast_on, on_torch_grouped_mm


def offsets_from_counts(num_tokens_per_expert: Tensor) -> Tensor:
    """(E,) token counts -> (E,) int32 cumulative end offsets, as torch._grouped_mm wants."""
    return torch.cumsum(num_tokens_per_expert, dim=0, dtype=torch.int32)


def grouped_mm(a: Tensor, b_t: Tensor, offs: Tensor) -> Tensor:
    """High-precision grouped GEMM: a (T, K) rows grouped by expert, b_t (E, K, N), offs (E,)
    int32 cumulative ends -> (T, N). torch._grouped_mm on CUDA bf16; elsewhere an exact loop over
    the groups inside the custom op `mxmoe::grouped_mm` (its host read of `offs` stays out of a
    compiled graph, so the model compiles with fullgraph=True on CPU too)."""
    if on_torch_grouped_mm(a, b_t):
        return torch._grouped_mm(a, b_t, offs=offs)
    return _GroupedMMLoop.apply(a, b_t, offs)


class _GroupedMMLoop(torch.autograd.Function):
    # dA_g = dY_g B_g^T, dB_g = A_g^T dY_g per group, each through the same opaque custom op.
    @staticmethod
    def forward(ctx, a: Tensor, b_t: Tensor, offs: Tensor) -> Tensor:
        from mxmoe.ops.gemm import grouped_mm

        ctx.save_for_backward(a, b_t, offs)
        return grouped_mm(a, b_t, offs)

    @staticmethod
    def backward(ctx, dy: Tensor):
        from mxmoe.ops.gemm import grouped_mm

        a, b_t, offs = ctx.saved_tensors
        dy = dy.contiguous()
        da = grouped_mm(dy, b_t.transpose(-2, -1), offs) if ctx.needs_input_grad[0] else None
        db_t = grouped_mm(a.t(), dy, offs) if ctx.needs_input_grad[1] else None
        return da, db_t, None


class GroupedExperts(nn.Module):
    """E SwiGLU experts. forward(x (T, dim) sorted by expert, num_tokens_per_expert (E,)) -> (T, dim)."""

    def __init__(self, dim: int, hidden_dim: int, num_experts: int):
        super().__init__()
        self.dim, self.hidden_dim, self.num_experts = dim, hidden_dim, num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.reset_parameters()

    def reset_parameters(self, std: float | None = None) -> None:
        for w in (self.w1, self.w2, self.w3):
            nn.init.trunc_normal_(w, std=std if std is not None else 1.0 / math.sqrt(w.shape[-1]))

    def check_counts(self, num_tokens_per_expert: Tensor, rows: int | None = None) -> None:
        """TypeError / ValueError naming `num_tokens_per_expert` unless it is a 1D tensor of
        num_experts counts (a shorter one was taken by the high-precision GEMMs as fewer groups);
        counts on the host (no sync) must also be >= 0 and, with `rows` (x's), sum to at most rows
        (the high-precision GEMMs took a negative count or one past x's rows silently)."""
        c = num_tokens_per_expert
        if not isinstance(c, Tensor):
            raise TypeError(
                f"num_tokens_per_expert must be a tensor of num_experts={self.num_experts} token counts, "
                f"got {type(c).__name__}"
            )
        if c.ndim != 1 or c.shape[0] != self.num_experts:
            raise ValueError(
                f"num_tokens_per_expert has shape {tuple(c.shape)}; expected ({self.num_experts},): one "
                f"token count per expert (num_experts={self.num_experts})"
            )
        if c.is_cpu and not torch.compiler.is_compiling():
            counts = c.tolist()
            if any(n < 0 for n in counts) or (rows is not None and sum(counts) > rows):
                raise ValueError(
                    f"num_tokens_per_expert={counts}: expected counts >= 0 that sum to at most x's {rows} "
                    "rows (the tokens sorted by expert)"
                )

    def forward(self, x: Tensor, num_tokens_per_expert: Tensor) -> Tensor:
        self.check_counts(num_tokens_per_expert, x.shape[0])
        offs = offsets_from_counts(num_tokens_per_expert)
        w1, w2, w3 = self.w1, self.w2, self.w3
        dev = x.device.type
        if autocast_on(dev):
            # autocast covers neither torch._grouped_mm nor the loop: give them operands of the
            # autocast dtype, as autocast gives nn.Linear's GEMM (on CUDA the grouped GEMM then
            # runs as one kernel instead of the fp32 loop; CPU autocast runs what CUDA runs)
            dt = torch.get_autocast_dtype(dev)
            x, w1, w2, w3 = (t.to(dt) for t in (x, w1, w2, w3))
        h = F.silu(grouped_mm(x, w1.transpose(-2, -1), offs))
        h = h * grouped_mm(x, w3.transpose(-2, -1), offs)
        return grouped_mm(h, w2.transpose(-2, -1), offs)
