"""The "mxmoe" experts implementation of Hugging Face transformers (package docstring)."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from mxmoe.ops import mx_grouped_mm, mx_grouped_swiglu_mlp
from mxmoe.recipe import DEFAULT_RECIPE, MXRecipe

NAME = "mxmoe"
"""The name under which the implementation is registered (`experts_implementation="mxmoe"`)."""


def register() -> None:
    """Register `mxmoe_experts_forward` in transformers' ExpertsInterface as "mxmoe" (idempotent).
    ImportError naming the fix when transformers (>= 5, with the experts interface) is missing."""
    try:
        from transformers.integrations.moe import ExpertsInterface
    except ImportError as e:
        raise ImportError(
            "mxmoe.integrations.hf needs Hugging Face transformers >= 5 (its ExpertsInterface): "
            f"pip install 'mxmoe[hf]' ({e})"
        ) from e
    ExpertsInterface.register(NAME, mxmoe_experts_forward)


def use_mx_experts(mx: list[nn.Module], high_precision: list[nn.Module], recipe: MXRecipe) -> None:
    """What `mxmoe.convert` does to transformers experts modules: `mx` compute with
    `experts_implementation="mxmoe"` in `recipe` (kept as their `mx_recipe`); `high_precision`
    (skipped by the filter or their dims) keep their implementation (their `mx_recipe` is None) even
    where they share a config with `mx`. Parameters and state-dict keys are unchanged.

    TypeError for a `recipe` that is not an MXRecipe; ValueError for `expert_gemm="bf16"` (the
    exchange-only mode of mxmoe's expert parallelism: transformers experts have no MXFP8 exchange),
    before any module changes."""
    check_recipe(mx, recipe)
    register()
    for mod in [*mx, *high_precision]:
        impl = mod.config._experts_implementation
        if impl != NAME and not hasattr(mod, "mx_fallback"):
            mod.mx_fallback = impl  # what runs the high-precision ones
    for mod in mx:
        mod.mx_recipe = recipe
    for mod in high_precision:
        mod.mx_recipe = None
    for mod in mx:
        # the config object's own attribute: no check of sub-configs, not written by save_pretrained
        mod.config._experts_implementation_internal = NAME


def check_recipe(mx: list[nn.Module], recipe: MXRecipe) -> None:
    """TypeError for a `recipe` that is not an MXRecipe; ValueError for `expert_gemm="bf16"` (the
    exchange-only mode of mxmoe's expert parallelism) when there are transformers experts `mx` to
    make MX: they have no MXFP8 exchange."""
    if not isinstance(recipe, MXRecipe):
        raise TypeError(f"recipe must be an mxmoe.MXRecipe (mxmoe.recipe(name)), got {type(recipe).__name__}")
    if mx and recipe.expert_gemm != "mx":
        raise ValueError(
            f"expert_gemm={recipe.expert_gemm!r} (the exchange-only mode of mxmoe's expert parallelism) "
            f"does not apply to transformers experts ({type(mx[0]).__name__}): they have no MXFP8 "
            "exchange. Use expert_gemm='mx' (both GEMMs in MX), or convert_grouped_experts=False to keep "
            "them high precision"
        )


def _high_precision(self: nn.Module, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor):
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    impl = getattr(self, "mx_fallback", None) or "grouped_mm"
    eager = type(self).forward.__wrapped__  # the class's own forward, under transformers' dispatch
    fn = eager if impl == "eager" else ALL_EXPERTS_FUNCTIONS.get_interface(impl, eager)
    return fn(self, hidden_states, top_k_index, top_k_weights)


def _is_swiglu(self: nn.Module) -> bool:
    """The module's gate is transformers' default (chunk, act(gate) * up) with SiLU (a module, or
    LFM2-MoE's `F.silu` itself): one fused op."""
    from transformers.integrations.moe import _default_apply_gate

    act = getattr(self, "act_fn", None)
    return (
        getattr(type(self), "_apply_gate", None) is _default_apply_gate
        and (isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation" or act is F.silu)
        and self.has_gate
        and not self.has_bias
        and not self.is_transposed
        and not getattr(self, "has_post_expert_norm", False)
    )


def mxmoe_experts_forward(
    self: nn.Module, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor
) -> Tensor:
    """transformers' grouped_mm experts forward with its two grouped GEMMs on MX operands.

    hidden_states (T, H), top_k_index (T, k) int expert ids, top_k_weights (T, k) -> (T, H) in
    hidden_states' dtype. The rows are sorted by expert (a stable sort), multiplied by the
    up-projection `gate_up_proj` (or `up_proj`), gated (`self._apply_gate`: act(gate) * up; SwiGLU
    as one fused op `mx_grouped_swiglu_mlp`), multiplied by `down_proj`, weighted and summed per
    token as transformers' grouped_mm does (biases and a post-expert norm in high precision). The
    recipe is `self.mx_recipe` (set by `mxmoe.convert`; default mxmoe.DEFAULT_RECIPE; None: the
    module was left high precision and runs its previous implementation). H and the intermediate
    size must be divisible by the block size (32). Expert parallelism (ids >= E on this rank) gives
    those rows weight 0.
    """
    recipe = getattr(self, "mx_recipe", DEFAULT_RECIPE)
    if recipe is None:
        return _high_precision(self, hidden_states, top_k_index, top_k_weights)
    E = self.num_experts
    up = self.gate_up_proj if self.has_gate else self.up_proj
    down = self.down_proj
    if up.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(
            f'experts_implementation="mxmoe": {type(self).__name__} has {up.dtype} weights; MX experts '
            "take bfloat16 or float32 (load with dtype=torch.bfloat16)"
        )
    up_t = up if self.is_transposed else up.transpose(-2, -1)  # (E, H, 2I or I)
    down_t = down if self.is_transposed else down.transpose(-2, -1)  # (E, I, H)
    bad = [d for d in (*up_t.shape[1:], down_t.shape[1]) if d % recipe.block_size]
    if bad:
        raise ValueError(
            f'experts_implementation="mxmoe": {type(self).__name__} has gate_up/down dims '
            f"{tuple(up_t.shape[1:])} / {tuple(down_t.shape[1:])}, not all divisible by the MX block "
            f"size {recipe.block_size}; leave it high precision (mxmoe.convert skips it)"
        )
    num_tokens, hidden = hidden_states.shape
    k = top_k_index.shape[-1]
    ids = top_k_index.reshape(-1)
    weights = top_k_weights.reshape(-1)
    if getattr(self, "_is_expert_parallel", False):  # ids of other ranks' experts: weight 0
        weights = weights * (ids < E).to(weights.dtype)
        ids = ids.clamp(max=E - 1)
    ids_g, perm = torch.sort(ids, stable=True)
    # counts as transformers' grouped_mm takes them: histc (no data-dependent shape; floats on CPU,
    # where histc takes no integers)
    hist_in = ids_g.float() if ids_g.device.type in ("cpu", "mps") else ids_g.int()
    counts = torch.histc(hist_in, bins=E, min=0, max=E - 1)
    offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
    x = hidden_states[perm // k]
    if not torch.is_autocast_enabled(x.device.type):
        x = x.to(up.dtype)  # as transformers' grouped_mm: the weights' dtype
    if _is_swiglu(self):
        inter = up_t.shape[-1] // 2
        out = mx_grouped_swiglu_mlp(x, up_t[..., :inter], up_t[..., inter:], down_t, offs, recipe)
    else:
        h = mx_grouped_mm(x, up_t, offs, recipe)
        if self.has_bias:
            h = h + (self.gate_up_proj_bias if self.has_gate else self.up_proj_bias)[ids_g]
        h = self._apply_gate(h) if self.has_gate else self.act_fn(h)
        out = mx_grouped_mm(h, down_t, offs, recipe)
        if self.has_bias:
            out = out + self.down_proj_bias[ids_g]
        if getattr(self, "has_post_expert_norm", False):
            out = self.post_expert_norm(out)
    out = out * weights[perm].unsqueeze(-1)
    out = _unsort(out, perm)
    return out.view(num_tokens, k, hidden).sum(dim=1).to(hidden_states.dtype)


def _unsort(rows: Tensor, perm: Tensor) -> Tensor:
    """rows[inv(perm)]: row i of the result is the row that `perm` moved from position i."""
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return rows[inv]


__all__ = ["NAME", "mxmoe_experts_forward", "register", "use_mx_experts"]
