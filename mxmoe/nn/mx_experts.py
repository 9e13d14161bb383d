"""`MXGroupedExperts`: GroupedExperts with every grouped GEMM on MX operands, or (recipe
`expert_gemm="bf16"`) GEMMs in the compute dtype on rows rounded to MX: the exchange-only mode."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from mxmoe.nn.experts import GroupedExperts, offsets_from_counts
from mxmoe.nn.linear import carry_hooks, check_block_dims
from mxmoe.ops import mx_grouped_swiglu_mlp
from mxmoe.ops.gemm import autocast_input, first_order
from mxmoe.quant.mx_tensor import MXTensor
from mxmoe.quant.qdq import qdq
from mxmoe.recipe import MXRecipe, as_recipe
from mxmoe.token_dispatch import RowsFromAnchor


class MXGroupedExperts(GroupedExperts):
    """E SwiGLU experts, same parameters as GroupedExperts: w1, w3 (E, hidden, dim), w2 (E, dim, hidden).

    forward(x, num_tokens_per_expert (E,) int) -> (T, dim) in x's (orig) dtype; x is (T, dim)
    bf16/fp32 sorted by expert, or a 2D MXTensor blocked along dim (the MXFP8 dispatch's output):
    the w1/w3 GEMMs then use it without requantizing, and its gradient flows to `x.grad_anchor`.
    dim and hidden_dim must be divisible by the block size (32). Group sizes are arbitrary.

    With the recipe's `expert_gemm="bf16"` the three GEMMs are `GroupedExperts`' own (compute dtype,
    bf16 under autocast) on the input rows rounded to MX once, Q(x) (Q: quantize along dim with the
    recipe, dequantize exactly), and the gradient flows to x unchanged (straight through). Rows that
    come as an MXTensor (the MXFP8 dispatch's) are Q(x) already: they are dequantized, and the
    expert-parallel combine sends the output's gradient as MXFP8, so the experts' backward starts
    from Q(dy). Rows that come as a Tensor (no exchange: all experts local) are rounded here, and
    so is the output's gradient, as the exchange would: the same numbers at every EP degree.
    """

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, recipe: MXRecipe | None = None):
        recipe = as_recipe(recipe)
        check_block_dims(self, recipe, {"dim": dim, "hidden_dim": hidden_dim})  # before the weights are made
        super().__init__(dim, hidden_dim, num_experts)
        self.recipe = recipe

    @classmethod
    def from_experts(cls, experts: GroupedExperts, recipe: MXRecipe | None = None) -> MXGroupedExperts:
        """An MXGroupedExperts sharing `experts`' Parameter objects."""
        if not isinstance(experts, GroupedExperts):
            raise TypeError(f"from_experts needs a GroupedExperts, got {type(experts).__name__}")
        if parametrize.is_parametrized(experts):
            raise ValueError(
                "from_experts: the experts' weights are parametrized (torch.nn.utils.parametrize): "
                "an MXGroupedExperts shares their Parameters; remove the parametrization first"
            )
        new = cls.__new__(cls)
        nn.Module.__init__(new)  # no fresh weights: the parameters are shared
        new.recipe = as_recipe(recipe)
        check_block_dims(new, new.recipe, {"dim": experts.dim, "hidden_dim": experts.hidden_dim})
        new.dim, new.hidden_dim, new.num_experts = experts.dim, experts.hidden_dim, experts.num_experts
        new.w1, new.w2, new.w3 = experts.w1, experts.w2, experts.w3
        new.train(experts.training)
        carry_hooks(experts, new)
        return new

    def forward(self, x: Tensor | MXTensor, num_tokens_per_expert: Tensor) -> Tensor:
        recipe = self.recipe
        if recipe.expert_gemm == "bf16":
            return self._forward_bf16(x, num_tokens_per_expert)
        self.check_counts(num_tokens_per_expert, x.shape[0])
        offs = offsets_from_counts(num_tokens_per_expert)
        if isinstance(x, Tensor):
            # one cast to the autocast dtype for both w1 and w3 (each op would cast x on its own:
            # two copies forward, two gradient casts back), as GroupedExperts casts x once
            x = autocast_input(x)
        # g, u = mx_grouped_mm_shared(x, (w1ᵀ, w3ᵀ)) (w1 and w3 on one cast of x), then
        # mx_grouped_mm_swiglu(g, u, w2ᵀ) (h = F.silu(g) * u cast straight from g and u on the qdq
        # path), bit-identical to mx_grouped_mm calls on x and h; on the qdq path one op whose
        # backward casts dg and du straight from dh, g and u (never written or read back)
        w1_t, w3_t, w2_t = (w.transpose(-2, -1) for w in (self.w1, self.w3, self.w2))
        return mx_grouped_swiglu_mlp(x, w1_t, w3_t, w2_t, offs, recipe)

    def _forward_bf16(self, x: Tensor | MXTensor, num_tokens_per_expert: Tensor) -> Tensor:
        """expert_gemm="bf16" (class docstring): GroupedExperts.forward on Q(x)."""
        if isinstance(x, Tensor):
            x = autocast_input(x)  # rounded in the dtype the EP dispatch sends (the autocast dtype)
        return run_on_mx_rounded_rows(
            x, self.recipe, lambda rows: GroupedExperts.forward(self, rows, num_tokens_per_expert)
        )

    def extra_repr(self) -> str:
        c = self.recipe
        gemm = ", expert_gemm=bf16" if c.expert_gemm == "bf16" else ""
        return (
            f"dim={self.dim}, hidden_dim={self.hidden_dim}, num_experts={self.num_experts}, "
            f"mx={c.elem_dtype}/{c.scaling_mode}/{c.block_size}{gemm}"
        )


def run_on_mx_rounded_rows(
    x: Tensor | MXTensor,
    recipe: MXRecipe,
    run: Callable[[Tensor], Tensor],
    *,
    dtype: torch.dtype | None = None,
) -> Tensor:
    """The experts' `expert_gemm="bf16"` path (the exchange only), shared by `MXGroupedExperts` and
    the torchtitan adapters: `run` (rows (T, D) -> (T, D'), the experts' own high-precision GEMMs)
    on the rows rounded to MX once, Q(x) along D with `recipe`.

    x: (T, D) rows grouped by expert, a Tensor (rounded here, and so is the gradient of `run`'s
    output, as the MXFP8 exchange would: the same numbers at every EP degree) or a 2D MXTensor
    blocked along D (the MXFP8 dispatch's rows: Q(x) already, dequantized exactly; its gradient goes
    to `x.grad_anchor`). dtype: the rows' dtype for `run` (None: the MXTensor's orig dtype, the
    Tensor's own). Returns `run`'s output (its dtype)."""
    if isinstance(x, MXTensor):
        if x.ndim != 2 or x.axis != 1:
            raise ValueError(f"x must be a 2D MXTensor blocked along dim (axis=1), got {x!r}")
        rows = x.dequantize(dtype, recipe=recipe)  # exact: Q(x) in every float dtype
        if x.grad_anchor is not None:  # the dispatch sends this gradient back in high precision
            rows = RowsFromAnchor.apply(x.grad_anchor, rows)
        return run(rows)
    rows = x if dtype is None else x.to(dtype)
    return _RoundGrad.apply(run(_RoundRows.apply(rows, recipe)), recipe)


class _RoundRows(torch.autograd.Function):
    """Q(x) along the last dim (what the MXFP8 dispatch delivers); gradient straight through (what
    its backward sends: the high-precision gradient)."""

    @staticmethod
    def forward(ctx, x: Tensor, recipe: MXRecipe) -> Tensor:
        return qdq(x, -1, recipe=recipe)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None


class _RoundGrad(torch.autograd.Function):
    """Identity forward; gradient Q(dy) along the last dim (what the combine's MXFP8 backward sends)."""

    @staticmethod
    def forward(ctx, y: Tensor, recipe: MXRecipe) -> Tensor:
        ctx.recipe = recipe
        return y.view_as(y)

    @staticmethod
    @first_order("mxmoe.nn.mx_experts.run_on_mx_rounded_rows (expert_gemm='bf16')")
    def backward(ctx, grad: Tensor):
        return qdq(grad, -1, recipe=ctx.recipe), None
