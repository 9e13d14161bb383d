"""mxmoe through torchao's entry point: `torchao.quantize_(model, config, filter_fn=...)`.

    from torchao import quantize_
    from torchao.prototype.moe_training.config import MXFP8TrainingRecipe
    from mxmoe.integrations.torchao import MXMoETrainingConfig, mx_filter_fn

    config = MXMoETrainingConfig.from_recipe(MXFP8TrainingRecipe.MXFP8_RCEIL)  # or "mxfp8_rceil"
    quantize_(model, config, filter_fn=mx_filter_fn(config))

`MXMoETrainingConfig` is a torchao `AOBaseConfig` holding one `mxmoe.MXOptions`; importing this
module registers its handler with torchao (`register_quantize_module_handler`), which swaps each
module `filter_fn` selects: nn.Linear -> MXLinear, GroupedExperts -> MXGroupedExperts, a Hugging
Face transformers experts module -> `experts_implementation="mxmoe"` (parameters unchanged, as
`mxmoe.convert`), any other module -> `mxmoe.convert(module, options)` on its children.
`mx_filter_fn(config)` selects what `mxmoe.convert` would convert (the options' filter_fqns, dims
divisible by 32); torchao's default filter (every nn.Linear, the output head and routers too) leaves
the experts out. torchao is optional: only this module needs it.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

from torch import nn
from torchao.core.config import AOBaseConfig
from torchao.quantization.transform_module import register_quantize_module_handler

from mxmoe.nn.converter import (
    MX_PARAM_DTYPES,
    ROUTER_NAMES,
    _filter_hit,
    _implied_here,
    convert,
    hf_experts_dims,
    implied_entries,
    llama4_experts_dims,
    why_not_plain,
)
from mxmoe.nn.experts import GroupedExperts
from mxmoe.nn.linear import MXLinear
from mxmoe.nn.mx_experts import MXGroupedExperts
from mxmoe.options import MXOptions, RecipeName
from mxmoe.recipe import MXRecipe


@dataclass
class MXMoETrainingConfig(AOBaseConfig):
    """torchao's config for mxmoe's MX training: `options` (mxmoe.MXOptions) say the recipe and what
    is converted, as in every mxmoe front end."""

    options: MXOptions = field(default_factory=MXOptions)

    def __post_init__(self) -> None:
        if not isinstance(self.options, MXOptions):
            raise TypeError(
                f"MXMoETrainingConfig options must be an mxmoe.MXOptions, got {type(self.options).__name__} "
                "(a recipe by name: MXMoETrainingConfig.from_recipe('mxfp8_rceil'))"
            )

    @classmethod
    def from_recipe(cls, recipe: Enum | RecipeName, **options) -> MXMoETrainingConfig:
        """The config of a torchao recipe (`MXFP8TrainingRecipe.MXFP8_RCEIL`, `..._WGRAD_WITH_HP`,
        `MXFP8_EMULATED_RCEIL`) or its name ("mxfp8_rceil", ...; mxmoe's "mxfp8" too), other
        MXOptions fields as keywords. ValueError naming the recipe for an unknown one."""
        name = recipe.value if isinstance(recipe, Enum) else recipe
        return cls(MXOptions(recipe_name=name, **options))


def _dims(module: nn.Module) -> tuple[int, int] | None:
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    if isinstance(module, GroupedExperts):
        return module.dim, module.hidden_dim
    return hf_experts_dims(module) or llama4_experts_dims(module)


def mx_filter_fn(config: MXMoETrainingConfig | MXOptions | None = None) -> Callable[[nn.Module, str], bool]:
    """A `filter_fn` for `quantize_` selecting what `mxmoe.convert` with these options converts:
    nn.Linear (convert_linears), GroupedExperts and transformers experts modules
    (convert_grouped_experts) whose FQN no filter_fqns entry matches (what is attention or an MoE
    router counts as such whatever its name, as in `mxmoe.convert`: `implied_entries`, read from
    the model `quantize_` hands over first) and whose dims are divisible by the block size."""
    if config is not None and not isinstance(config, (MXMoETrainingConfig, MXOptions)):
        raise TypeError(
            f"mx_filter_fn takes an MXMoETrainingConfig, an mxmoe.MXOptions or None, got "
            f"{type(config).__name__} (a recipe by name: mx_filter_fn(MXMoETrainingConfig.from_recipe(name)))"
        )
    opts = config.options if isinstance(config, MXMoETrainingConfig) else config or MXOptions()
    block = opts.to_recipe().block_size
    filter_fqns = list(opts.filter_fqns)
    implied: dict[str, frozenset[str]] = {}

    def filter_fn(module: nn.Module, fqn: str) -> bool:
        if fqn == "":  # quantize_ asks about the model itself first
            implied.clear()
            implied.update(implied_entries(module))
            _warn_twice_registered(module)
        if isinstance(module, nn.Linear):
            if not opts.convert_linears:
                return False
        elif not opts.convert_grouped_experts or _dims(module) is None:
            return False
        name = fqn.rsplit(".", 1)[-1]
        # called on its own (not from quantize_): what the module itself is; a Linear "gate" a router
        alone = _implied_here(None, name, module) | ({"router"} if name in ROUTER_NAMES else set())
        here = implied.get(fqn, alone)
        if _filter_hit(fqn, filter_fqns, here):
            return False
        if isinstance(module, (nn.Linear, GroupedExperts)) and why_not_plain(module):
            return False  # (mxmoe.convert skips it too: the MX module would drop what it adds)
        return not any(d % block for d in _dims(module))

    return filter_fn


def _warn_twice_registered(model: nn.Module) -> None:
    """A warning naming a module with something to convert registered under two names of one parent
    (`m.a = m.b = linear`): quantize_ walks `named_children`, which gives it once, so it would be
    MX under its first name only, high precision under the other (`mxmoe.convert` swaps both)."""
    for prefix, parent in model.named_modules():
        seen: dict[int, str] = {}
        for name, child in parent._modules.items():
            if child is None:
                continue
            if id(child) in seen and any(_dims(m) is not None for m in child.modules()):
                at = f"{prefix}." if prefix else ""
                warnings.warn(
                    f"quantize_(..., MXMoETrainingConfig): {at}{seen[id(child)]} and {at}{name} are one "
                    "module; quantize_ visits it under its first name only, so the second would stay high "
                    "precision: mxmoe.convert(model, config.options) converts both",
                    stacklevel=4,
                )
                return
            seen[id(child)] = name


@register_quantize_module_handler(MXMoETrainingConfig)
def _mx_transform(module: nn.Module, config: MXMoETrainingConfig) -> nn.Module:
    """The module `quantize_` hands over, made MX (module docstring)."""
    opts = config.options
    r: MXRecipe = opts.to_recipe()
    dims = _dims(module)
    if dims is not None and any(d % r.block_size for d in dims):  # (an MX one re-given `r` too)
        raise ValueError(
            f"quantize_(..., MXMoETrainingConfig): a {type(module).__name__} with dims {dims[0]}x{dims[1]} "
            f"cannot be MX (not divisible by the block size {r.block_size}); leave it out with "
            "filter_fn=mx_filter_fn(config)"
        )
    if isinstance(module, (MXLinear, MXGroupedExperts)):
        module.recipe = r
        return module
    if isinstance(module, (nn.Linear, GroupedExperts)):  # what mxmoe.convert skips or refuses
        why = why_not_plain(module)
        odd = sorted(map(str, {p.dtype for p in module.parameters()} - set(MX_PARAM_DTYPES)))
        if why is None and odd:
            why = f"{', '.join(odd)} parameters; MX modules take bfloat16 or float32: model.to(bfloat16)"
        if why is not None:
            raise ValueError(
                f"quantize_(..., MXMoETrainingConfig): a {type(module).__name__} cannot be MX ({why}); "
                "leave it out with filter_fn=mx_filter_fn(config)"
            )
    if isinstance(getattr(module, "mx_recipe", None), MXRecipe) and llama4_experts_dims(module):
        module.mx_recipe = r  # Llama 4's experts made MX before
        return module
    if isinstance(module, nn.Linear):
        return MXLinear.from_linear(module, r)
    if isinstance(module, GroupedExperts):
        return MXGroupedExperts.from_experts(module, r)
    if llama4_experts_dims(module) is not None:  # Llama 4's experts (outside the experts interface)
        from mxmoe.integrations.hf.llama4 import use_mx_llama4_experts

        use_mx_llama4_experts([module], r)
        return module
    if dims is not None:  # a transformers experts module
        from mxmoe.integrations.hf import use_mx_experts

        use_mx_experts([module], [], r)
        return module
    return convert(module, opts)


__all__ = ["MXMoETrainingConfig", "mx_filter_fn"]
