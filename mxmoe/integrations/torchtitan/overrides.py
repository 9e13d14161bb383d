"""torchtitan 0.3 overrides: mxmoe's MX Linear, MX expert GEMMs and MXFP8 token dispatcher on any
stock torchtitan 0.3 config, from the command line (`--override.imports
mxmoe.integrations.torchtitan.mxmoe_linear`, `...mxmoe_grouped_mm`, `...mxmoe_a2a`, each optionally
with JSON kwargs: the MX options of `mxmoe.integrations.torchtitan.common.OPTION_NAMES`; the
dispatcher's `mxfp8_a2a_kernel_choice` and `a2a_transport`). Re-exported by the package when
torchtitan 0.3 is installed.
"""

from __future__ import annotations

from torchtitan.config.override import derive, override
from torchtitan.models.common.linear import Linear
from torchtitan.models.common.moe import GroupedExperts
from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher

from mxmoe.integrations.torchtitan.common import OPTION_NAMES, mx_recipe
from mxmoe.integrations.torchtitan.converters import MXLinear, mx_grouped_experts_cls
from mxmoe.integrations.torchtitan.dispatcher import MXFP8AllToAllTokenDispatcher, mxfp8_dispatcher_config

PACKAGE = "mxmoe.integrations.torchtitan"


def _in_package(fn):
    # torchtitan keys an override by `fn.__module__ + "." + fn.__name__`: registering these
    # under the package keeps their public names (`mxmoe.integrations.torchtitan.mxmoe_linear`),
    # which the package re-exports.
    fn.__module__ = PACKAGE
    return fn


LINEAR_OVERRIDE_FQNS = ["*layers.*.attention.*", "*layers.*.feed_forward.*", "*layers.*.moe.shared_experts.*"]
"""Linear layers the `mxmoe_linear` override converts (FQN globs, matched against
"model_spec.model.layers.1.attention.wq" in the trainer; an override cannot see FQNs in
its factory, so the exclusions of `MXLinearConverter.filter_fqns` are expressed as what to
include): attention, dense feed-forward and shared-expert projections; not the output head nor
the MoE router gate (as torchtitan's own deepseek_v3_debugmodel_mxfp8 config)."""


@override(
    target=Linear.Config,
    fqns=LINEAR_OVERRIDE_FQNS,
    exact=True,
    description="mxmoe MX Linear (mx_mm forward, dgrad, wgrad; Hopper and CPU)",
)
@_in_package
def mxmoe_linear(cfg: Linear.Config, **options) -> Linear.Config:
    """Override: a Linear.Config -> MXLinear.Config (unchanged if a dim is not divisible by 32).
    kwargs: the MX options (recipe_name, mxfp8_dim1_cast_kernel_choice, ...)."""
    _check_option_names("mxmoe_linear", options)
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
    subclass (unchanged if dim or hidden_dim is not divisible by 32). kwargs: the MX options."""
    _check_option_names("mxmoe_grouped_mm", options)
    r = mx_recipe(**options)
    if cfg.dim % r.block_size or cfg.hidden_dim % r.block_size:
        return cfg
    return derive(cfg, mx_grouped_experts_cls(type(cfg)._owner).Config, **options)


@override(
    target=AllToAllTokenDispatcher.Config,
    exact=True,
    description="mxmoe MXFP8 all-to-all token dispatch / combine",
)
@_in_package
def mxmoe_a2a(
    cfg: AllToAllTokenDispatcher.Config, *, mxfp8_a2a_kernel_choice: str = "auto", a2a_transport: str = "auto"
) -> MXFP8AllToAllTokenDispatcher.Config:
    """Override: torchtitan's standard all-to-all dispatcher -> the MXFP8 one."""
    return mxfp8_dispatcher_config(
        cfg, mxfp8_a2a_kernel_choice=mxfp8_a2a_kernel_choice, a2a_transport=a2a_transport
    )


def _check_option_names(where: str, options: dict) -> None:
    unknown = sorted(set(options) - set(OPTION_NAMES))
    if unknown:
        raise ValueError(f"{where}: unknown option(s) {unknown}; accepted: {list(OPTION_NAMES)}")


__all__ = ["LINEAR_OVERRIDE_FQNS", "mxmoe_a2a", "mxmoe_grouped_mm", "mxmoe_linear"]
