"""`MXLinear`: nn.Linear whose three GEMMs (forward, dgrad, wgrad) run on MX operands."""

from __future__ import annotations

from torch import Tensor, nn

from mxmoe.ops import mx_mm
from mxmoe.ops.config import as_recipe
from mxmoe.recipe import MXRecipe


class MXLinear(nn.Linear):
    """Drop-in for nn.Linear (same parameters `weight` (out, in) and `bias`, same state-dict keys).

    forward(x (..., in_features) bf16/fp32) -> (..., out_features) in x's dtype. in_features and
    out_features must be divisible by the block size (32). The bias add is high precision.
    """

    def __init__(self, *args, config: MXRecipe | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.mx_config = as_recipe(config)

    @classmethod
    def from_linear(cls, linear: nn.Linear, config: MXRecipe | None = None) -> MXLinear:
        """An MXLinear sharing `linear`'s Parameter objects (no copy; optimizers keep working)."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"from_linear needs an nn.Linear, got {type(linear).__name__}")
        new = cls(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            device="meta",
            config=config,
        )
        new.weight = linear.weight
        new.bias = linear.bias
        new.train(linear.training)
        return new

    def forward(self, x: Tensor) -> Tensor:
        y = mx_mm(x, self.weight.t(), self.mx_config)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        c = self.mx_config
        return f"{super().extra_repr()}, mx={c.elem_dtype}/{c.scaling_mode}/{c.block_size}"
