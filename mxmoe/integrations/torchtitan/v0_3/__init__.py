"""mxmoe's adapter for torchtitan 0.3 (its models import on torch >= 2.12, its trainer needs 2.14).

Model-config converters (`converters`: `MXMoEConverter` = `MXConverter`, one option set:
`mxmoe.MXOptions`; and one part each: `MXLinearConverter`, `MXGroupedExpertsConverter`,
`MXFP8TokenDispatcherConverter`), the token dispatcher with mxmoe's exchange (`dispatcher`),
command-line overrides (`overrides`: `--override.imports mxmoe.integrations.torchtitan.mxmoe`) and
config functions (`config_registry`: `--module mxmoe.integrations.torchtitan --config
deepseek_v3_debugmodel_mxmoe`). Built on the shared core (`mxmoe.integrations.torchtitan.common`)
and mxmoe's dispatch seam (`mxmoe.token_dispatch`).
"""

from mxmoe.integrations.torchtitan.common import OPTION_NAMES, RECIPE_FIELDS
from mxmoe.integrations.torchtitan.v0_3.converters import (
    MXConverter,
    MXGroupedExpertsConverter,
    MXLinear,
    MXLinearConverter,
    MXMoEConverter,
    mx_grouped_experts_cls,
)
from mxmoe.integrations.torchtitan.v0_3.dispatcher import (
    MXFP8AllToAllTokenDispatcher,
    MXFP8TokenDispatcherConverter,
    mxfp8_dispatcher_config,
)
from mxmoe.integrations.torchtitan.v0_3.overrides import (
    LINEAR_OVERRIDE_FQNS,
    mx,
    mxmoe,
    mxmoe_a2a,
    mxmoe_grouped_mm,
    mxmoe_linear,
)

CONFIG_FUNCTIONS = (
    "deepseek_v3_debugmodel_mxmoe",
    "deepseek_v3_debugmodel_mx",
    "qwen3_moe_debug_mxmoe",
    "qwen3_moe_debug_mx",
)
"""The config functions of `v0_3.config_registry` (imported on first use: it needs torch >= 2.14)."""

__all__ = [
    "CONFIG_FUNCTIONS",
    "OPTION_NAMES",
    "RECIPE_FIELDS",
    "LINEAR_OVERRIDE_FQNS",
    "MXConverter",
    "MXFP8AllToAllTokenDispatcher",
    "MXFP8TokenDispatcherConverter",
    "MXGroupedExpertsConverter",
    "MXLinear",
    "MXLinearConverter",
    "MXMoEConverter",
    "mx",
    "mx_grouped_experts_cls",
    "mxfp8_dispatcher_config",
    "mxmoe",
    "mxmoe_a2a",
    "mxmoe_grouped_mm",
    "mxmoe_linear",
]


def __getattr__(name: str):
    # `--module mxmoe.integrations.torchtitan --config F`: torchtitan 0.3's loader imports
    # `<module>.config_registry` and, on an ImportError (its trainer's torch floor, checked
    # there), looks F up on the package instead; importing the registry again here raises
    # mxmoe's ImportError (what is needed, what to install) out of the loader.
    if name in CONFIG_FUNCTIONS:
        from mxmoe.integrations.torchtitan.v0_3 import config_registry

        return getattr(config_registry, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
