"""Llama 4's routed experts in MX: `MXLlama4TextExperts`.

transformers' `Llama4TextExperts` is not behind its experts interface: its forward takes the rows
(E * T, H) that `Llama4TextMoe` builds (every token once per expert, scaled by that expert's router
score, zero where the expert was not chosen) and runs two batched GEMMs, `gate_up_proj` (E, H, 2I)
then `down_proj` (E, I, H), with `up * act(gate)` between them. `MXLlama4TextExperts` is that class
with both GEMMs on MX operands: grouped GEMMs over E equal groups of T rows (`mx_grouped_swiglu_mlp`
for SiLU, the fused path of the other transformers experts; `mx_grouped_mm` twice otherwise).
`mxmoe.convert` swaps a module's class to it in place (`use_mx_llama4_experts`; the parameters,
their names and `save_pretrained` unchanged) and keeps the recipe as the module's `mx_recipe`.
Importing this module imports transformers' Llama 4 model code.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from transformers.models.llama4.modeling_llama4 import Llama4TextExperts

from mxmoe.integrations.hf.experts import check_recipe
from mxmoe.ops import mx_grouped_mm, mx_grouped_swiglu_mlp
from mxmoe.recipe import MXRecipe


class MXLlama4TextExperts(Llama4TextExperts):
    """`Llama4TextExperts` with its two GEMMs in MX (module docstring); built by
    `use_mx_llama4_experts`, never constructed directly. `mx_recipe`: the MXRecipe of its GEMMs."""

    mx_recipe: MXRecipe

    def forward(self, hidden_states: Tensor) -> Tensor:
        """hidden_states (E * T, H), rows of expert e at [e T, (e + 1) T) -> (E * T, H), as
        `Llama4TextExperts.forward` with each GEMM on MX operands (blocks of the recipe along H, then
        along I)."""
        E, H = self.num_experts, self.hidden_size
        x = hidden_states.reshape(-1, H)
        if x.shape[0] % E:
            raise ValueError(
                f"{type(self).__name__}: hidden_states has {x.shape[0]} rows, not a multiple of the "
                f"{E} experts (Llama4TextMoe hands every expert every token)"
            )
        up = self.gate_up_proj  # (E, H, 2I): already (E, K, N) as the grouped GEMMs take it
        if not torch.is_autocast_enabled(x.device.type):
            x = x.to(up.dtype)  # as torch.bmm needs: the weights' dtype
        T = x.shape[0] // E
        offs = torch.arange(1, E + 1, device=x.device, dtype=torch.int32) * T
        recipe, inter = self.mx_recipe, up.shape[-1] // 2
        if isinstance(self.act_fn, nn.SiLU) or type(self.act_fn).__name__ == "SiLUActivation":
            # chunk(2): gate the first half, up the second; up * silu(gate) == silu(gate) * up
            return mx_grouped_swiglu_mlp(x, up[..., :inter], up[..., inter:], self.down_proj, offs, recipe)
        gate, up_h = mx_grouped_mm(x, up, offs, recipe).chunk(2, dim=-1)
        return mx_grouped_mm(up_h * self.act_fn(gate), self.down_proj, offs, recipe)


def use_mx_llama4_experts(mods: list[nn.Module], recipe: MXRecipe) -> None:
    """What `mxmoe.convert` does to Llama 4 experts modules: each becomes an `MXLlama4TextExperts`
    (class swapped in place: the same parameters) computing in `recipe`; `check_recipe`'s errors
    before any module changes."""
    check_recipe(mods, recipe)  # before any module changes
    for mod in mods:
        if type(mod) is not Llama4TextExperts and not isinstance(mod, MXLlama4TextExperts):
            raise TypeError(f"{type(mod).__name__} is not transformers' Llama4TextExperts")
        mod.__class__ = MXLlama4TextExperts
        mod.mx_recipe = recipe


__all__ = ["MXLlama4TextExperts", "use_mx_llama4_experts"]
