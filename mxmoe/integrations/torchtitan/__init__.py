"""mxmoe inside torchtitan 0.3: MX linear layers, MX expert GEMMs and an MXFP8 token dispatcher.

Two ways in, both torchtitan's own (docs/torchtitan.md):

* Converters, in a config_registry function: `model_registry(flavor, converters=[...])` with
  `MXLinearConverter.Config(...)`, `MXGroupedExpertsConverter.Config(...)` and
  `MXFP8TokenDispatcherConverter.Config(...)`; ready-made functions are in
  `mxmoe.integrations.torchtitan.config_registry` (`--module mxmoe.integrations.torchtitan`).
* Overrides, on any stock torchtitan config, from the command line: `--override.imports`
  with `mxmoe.integrations.torchtitan.mxmoe_linear`, `...mxmoe_grouped_mm`, `...mxmoe_a2a`,
  each optionally with JSON kwargs (the options below).

Options (torchtitan spellings): `recipe_name` ("mxfp8_rceil" default | "mxfp8"),
`mxfp8_dim1_cast_kernel_choice` / `mxfp8_dim0_cast_kernel_choice` ("auto" | "torch" | "triton" |
"cuda"), `gemm_dtype` ("auto" | "bfloat16" | "float32"); the converters also take `fqns` (include)
and `filter_fqns` (exclude); the dispatcher `mxfp8_a2a_kernel_choice` and `a2a_transport`.
Tensor parallelism is refused (when the model is parallelized).
"""

from __future__ import annotations

import torch

try:
    import torchtitan  # noqa: F401
except ImportError as e:  # a clear message instead of a deep import error
    raise ImportError(
        "mxmoe.integrations.torchtitan needs torchtitan 0.3: pip install 'mxmoe[torchtitan]'"
    ) from e

from torchtitan.config.override import derive, override
from torchtitan.models.common.linear import Linear
from torchtitan.models.common.moe import GroupedExperts
from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher

from mxmoe.integrations.torchtitan.converters import (
    OPTION_NAMES,
    MXGroupedExpertsConverter,
    MXLinear,
    MXLinearConverter,
    mx_grouped_experts_cls,
    mx_recipe,
)
from mxmoe.integrations.torchtitan.dispatcher import (
    MXFP8AllToAllTokenDispatcher,
    MXFP8TokenDispatcherConverter,
    mxfp8_dispatcher_config,
)

MIN_TORCH = (2, 12)
"""torchtitan 0.3.0's trainer and models import torch.distributed.fsdp.DataParallelMeshDims and its
token dispatcher calls torch.compiler._is_non_strict_tracing; torch 2.11 has neither."""
if tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) < MIN_TORCH:
    raise ImportError(
        f"torchtitan 0.3 needs torch >= 2.12, this is torch {torch.__version__} (it lacks "
        "torch.distributed.fsdp.DataParallelMeshDims and torch.compiler._is_non_strict_tracing)"
    )

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


__all__ = [
    "LINEAR_OVERRIDE_FQNS",
    "MXFP8AllToAllTokenDispatcher",
    "MXFP8TokenDispatcherConverter",
    "MXGroupedExpertsConverter",
    "MXLinear",
    "MXLinearConverter",
    "OPTION_NAMES",
    "mx_grouped_experts_cls",
    "mx_recipe",
    "mxfp8_dispatcher_config",
    "mxmoe_a2a",
    "mxmoe_grouped_mm",
    "mxmoe_linear",
]
