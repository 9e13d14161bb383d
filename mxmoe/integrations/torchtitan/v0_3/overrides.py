"""torchtitan 0.3 overrides: mxmoe on any stock torchtitan 0.3 config, from the command line.

    --override.imports mxmoe.integrations.torchtitan.mxmoe        (or ...torchtitan.mx)

applies `MXMoEConverter` to the model config (MX Linear layers, MX experts, mxmoe's exchange; one
conversion line), optionally with JSON kwargs: fields of `mxmoe.MXOptions`
('mxmoe.integrations.torchtitan.mxmoe={"expert_gemm": "bf16", "mxfp8_a2a": true}'). One part at a
time: `...mxmoe_linear`, `...mxmoe_grouped_mm`, `...mxmoe_a2a` (kwargs: the recipe's fields; the
exchange's too for `mxmoe_a2a`). Re-exported by the package when torchtitan 0.3 is installed.
"""

from __future__ import annotations

from dataclasses import fields

from torchtitan.config.override import derive, override
from torchtitan.models.common.linear import Linear
from torchtitan.models.common.moe import GroupedExperts
from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher
from torchtitan.protocols.model import BaseModel

from mxmoe.integrations.torchtitan.common import RECIPE_FIELDS, check_kernels, mx_recipe
from mxmoe.integrations.torchtitan.v0_3.converters import MXLinear, MXMoEConverter, mx_grouped_experts_cls
from mxmoe.integrations.torchtitan.v0_3.dispatcher import (
    EXCHANGE_FIELDS,
    RENAMED,
    MXFP8AllToAllTokenDispatcher,
    mxfp8_dispatcher_config,
)
from mxmoe.options import MXOptions

PACKAGE = "mxmoe.integrations.torchtitan"


def _in_package(fn):
    # torchtitan keys an override by `fn.__module__ + "." + fn.__name__`: registering these
    # under the package keeps their public names (`mxmoe.integrations.torchtitan.mxmoe_linear`),
    # which the package re-exports.
    fn.__module__ = PACKAGE
    return fn


_ALL_OPTIONS = tuple(f.name for f in fields(MXOptions))


def _convert_model(cfg: BaseModel.Config, options: dict, where: str) -> BaseModel.Config:
    _check_option_names(where, options, _ALL_OPTIONS)
    return MXMoEConverter(MXMoEConverter.Config(**options)).convert(cfg)


@override(target=BaseModel.Config, description="mxmoe: MX Linear, MX experts, MXFP8 exchange (MXOptions)")
@_in_package
def mxmoe(cfg: BaseModel.Config, **options) -> BaseModel.Config:
    """Override: the model config through `MXMoEConverter`; kwargs: fields of mxmoe.MXOptions."""
    return _convert_model(cfg, options, "mxmoe")


@override(target=BaseModel.Config, description="mxmoe (the same as ...torchtitan.mxmoe)")
@_in_package
def mx(cfg: BaseModel.Config, **options) -> BaseModel.Config:
    """Override: the same as `mxmoe`, by mxmoe's other converter name."""
    return _convert_model(cfg, options, "mx")


LINEAR_OVERRIDE_FQNS = ["*layers.*.feed_forward.*", "*layers.*.moe.shared_experts.*"]
"""Linear layers the `mxmoe_linear` override converts (FQN globs, matched against
"model_spec.model.layers.1.feed_forward.w1" in the trainer; an override cannot see FQNs in its
factory, so MXOptions' default filter (output head, router gates, attention:
`mxmoe.options.DEFAULT_FILTER_FQNS`) is expressed as what to include): the dense feed-forward and
the shared-expert projections. `mxmoe` itself applies `filter_fqns`."""


@override(
    target=Linear.Config,
    fqns=LINEAR_OVERRIDE_FQNS,
    exact=True,
    description="mxmoe MX Linear (mx_mm forward, dgrad, wgrad; Hopper and CPU)",
)
@_in_package
def mxmoe_linear(cfg: Linear.Config, **options) -> Linear.Config:
    """Override: a Linear.Config -> MXLinear.Config (unchanged if a dim is not divisible by the
    block size). kwargs: the recipe's fields of MXOptions (recipe_name, ...)."""
    _check_option_names("mxmoe_linear", options, RECIPE_FIELDS)
    r = mx_recipe(**options)
    if cfg.in_features % r.block_size or cfg.out_features % r.block_size:
        return cfg
    return derive(cfg, MXLinear.Config, **options)


@override(
    target=GroupedExperts.Config,
    description="mxmoe MX grouped GEMMs for the routed experts (any token group sizes)",
)
@_in_package
def mxmoe_grouped_mm(cfg: GroupedExperts.Config, **options) -> GroupedExperts.Config:
    """Override: GroupedExperts.Config (or a subclass with the `_grouped_mm` seam) -> its MX
    subclass (unchanged if dim or hidden_dim is not divisible by the block size). kwargs: the
    recipe's fields of MXOptions."""
    _check_option_names("mxmoe_grouped_mm", options, RECIPE_FIELDS)
    r = mx_recipe(**options)
    if cfg.dim % r.block_size or cfg.hidden_dim % r.block_size:
        return cfg
    return derive(cfg, mx_grouped_experts_cls(type(cfg)._owner).Config, **options)


@override(
    target=AllToAllTokenDispatcher.Config,
    exact=True,
    description="mxmoe's exchange (MXFP8 dispatch / combine gradient) for the all-to-all dispatcher",
)
@_in_package
def mxmoe_a2a(cfg: AllToAllTokenDispatcher.Config, **options) -> MXFP8AllToAllTokenDispatcher.Config:
    """Override: torchtitan's standard all-to-all dispatcher -> mxmoe's. kwargs: the recipe's and
    the exchange's fields of MXOptions (mxfp8_a2a, a2a_transport)."""
    _check_option_names("mxmoe_a2a", options, EXCHANGE_FIELDS)
    return mxfp8_dispatcher_config(cfg, **options)


def _check_option_names(where: str, options: dict, accepted: tuple[str, ...]) -> None:
    """Unknown or renamed option names, then (for a one-part override, whose options are MXOptions
    fields) a cast kernel or GEMM backend this machine cannot run: errors naming them, as the
    converters' when they are built (not the first forward's)."""
    for old, new in RENAMED.items():
        if old in options:
            raise ValueError(f"{where}: {old} is now {new}")
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ValueError(f"{where}: unknown option(s) {unknown}; accepted: {list(accepted)}")
    if accepted is not _ALL_OPTIONS:  # mxmoe / mx: MXMoEConverter checks them itself
        check_kernels(MXOptions(**options), where)


__all__ = ["LINEAR_OVERRIDE_FQNS", "mx", "mxmoe", "mxmoe_a2a", "mxmoe_grouped_mm", "mxmoe_linear"]
