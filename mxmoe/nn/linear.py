"""`MXLinear`: nn.Linear whose three GEMMs (forward, dgrad, wgrad) run on MX operands; `project`:
several linear layers on one input (attention's q, k, v), MXLinears sharing one cast of it."""

from __future__ import annotations

from torch import Tensor, nn
from torch.nn.modules import module as _module
from torch.nn.utils import parametrize

from mxmoe.ops import mx_mm, mx_mm_shared
from mxmoe.recipe import MXRecipe, as_recipe


class MXLinear(nn.Linear):
    """Drop-in for nn.Linear (same parameters `weight` (out, in) and `bias`, same state-dict keys).

    forward(x (..., in_features) bf16/fp32) -> (..., out_features) in x's dtype. in_features and
    out_features must be divisible by the block size (32). The bias add is high precision.
    """

    def __init__(self, *args, recipe: MXRecipe | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.recipe = as_recipe(recipe)
        dims = {"in_features": self.in_features, "out_features": self.out_features}
        check_block_dims(self, self.recipe, dims)

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: MXRecipe | None = None) -> MXLinear:
        """An MXLinear sharing `linear`'s Parameter objects (no copy; optimizers keep working)."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"from_linear needs an nn.Linear, got {type(linear).__name__}")
        if parametrize.is_parametrized(linear):
            raise ValueError(
                f"from_linear: the {type(linear).__name__}'s weight is parametrized (torch.nn.utils."
                "parametrize, e.g. weight_norm): an MXLinear shares a Parameter; remove the "
                "parametrization first"
            )
        if isinstance(linear.weight, nn.parameter.UninitializedParameter):
            raise ValueError(
                f"from_linear: the {type(linear).__name__}'s weight is uninitialized (a lazy module before "
                "its first forward, which an MXLinear would never run): run a forward first"
            )
        new = cls(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            device="meta",
            recipe=recipe,
        )
        new.weight = linear.weight
        new.bias = linear.bias
        new.train(linear.training)
        carry_hooks(linear, new)
        return new

    def forward(self, x: Tensor) -> Tensor:
        y = mx_mm(x, self.weight.t(), self.recipe)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        c = self.recipe
        return f"{super().extra_repr()}, mx={c.elem_dtype}/{c.scaling_mode}/{c.block_size}"


def check_block_dims(module: nn.Module, recipe: MXRecipe, dims: dict[str, int]) -> None:
    """ValueError naming each dim of an MX module (of `recipe`) that is not a multiple of the block
    size (every GEMM of forward and backward blocks along each of them): refused when the module is
    made, not at its first forward or backward."""
    bs = recipe.block_size
    bad = {k: v for k, v in dims.items() if v % bs}
    if bad:
        got = ", ".join(f"{k}={v}" for k, v in bad.items())
        raise ValueError(
            f"{type(module).__name__}: {got} not divisible by the recipe's block_size={bs} (its MX GEMMs "
            "block along every dim); keep the module high precision (mxmoe.convert skips it)"
        )


_HOOK_ATTRS = tuple(k for k in vars(nn.Module()) if "hook" in k)
"""nn.Module's own hook attributes (forward, backward, state dict), as this torch names them."""


def carry_hooks(old: nn.Module, new: nn.Module) -> None:
    """`new` (the MX module swapped in for `old`) runs `old`'s hooks (forward, backward, state dict):
    the same hook dicts, so the handles their registration returned still remove them."""
    for name in _HOOK_ATTRS:
        setattr(new, name, getattr(old, name))


def _plain_mx(m: nn.Module) -> bool:
    """Whether calling `m` is exactly MXLinear.forward: an MXLinear (not a subclass) without forward
    hooks (calls a wrapper, e.g. FSDP2 on the module itself, would expect)."""
    return type(m) is MXLinear and not (m._forward_hooks or m._forward_pre_hooks)


def project(x: Tensor, *linears: nn.Module) -> tuple[Tensor, ...]:
    """(m(x) for m in linears), e.g. attention's q, k, v projections of one input.

    x: (..., in_features), as each module takes it. Returns a tuple of (..., out_features_i).
    When every module is a plain MXLinear (no subclass, no forward hooks) of one recipe, one
    `mx_mm_shared` casts x once for all of them (bit-identical outputs and gradients, fewer
    quantizer calls, x along M saved once); otherwise (nn.Linear: the bf16 model, mixed modules or
    recipes) each module is called on x, as the model would call them one by one.
    """
    for i, m in enumerate(linears):
        if not isinstance(m, nn.Module):
            raise TypeError(
                f"project: linears[{i}] is a {type(m).__name__}; expected modules (nn.Linear, MXLinear) to "
                "call on x"
            )
    if (
        len(linears) > 1
        and all(_plain_mx(m) for m in linears)
        and all(m.recipe == linears[0].recipe for m in linears[1:])
        and not (_module._global_forward_hooks or _module._global_forward_pre_hooks)
    ):
        ys = mx_mm_shared(x, [m.weight.t() for m in linears], linears[0].recipe)
        return tuple(
            y if m.bias is None else y + m.bias.to(y.dtype) for y, m in zip(ys, linears, strict=True)
        )
    return tuple(m(x) for m in linears)
