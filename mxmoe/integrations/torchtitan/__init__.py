"""mxmoe inside torchtitan's trainer: MX linear layers, MX expert GEMMs (and an MXFP8 token
exchange for expert parallelism), one adapter per torchtitan version (docs/torchtitan.md).

Importing this package picks the adapter of the installed torchtitan and exports its names:

* torchtitan **0.2.x** (torch >= 2.11), `v0_2`: the TOML-era job config.
  `--job.custom_config_module mxmoe.integrations.torchtitan --model.converters mxmoe` with the
  options in an `[mx]` section or as `--mx.recipe_name`, `--mx.mxfp8_dim1_cast_kernel_choice`,
  `--mx.mxfp8_dim0_cast_kernel_choice`, `--mx.filter_fqns`, `--mx.gemm_backend`,
  `--mx.gemm_dtype`. Exports `JobConfig` (the `[mx]` section torchtitan merges into its own),
  `MXMoEConverter`, `MXGroupedExperts`.
* torchtitan **0.3** (torch >= 2.14 for its trainer; its models import from torch 2.12):
  model-config converters (`MXLinearConverter`, `MXGroupedExpertsConverter`,
  `MXFP8TokenDispatcherConverter`), overrides (`--override.imports
  mxmoe.integrations.torchtitan.mxmoe_linear`, `...mxmoe_grouped_mm`, `...mxmoe_a2a`) and
  config_registry functions (`--module mxmoe.integrations.torchtitan`).

Shared by both: `common` (version floors, the options -> one `mxmoe.MXRecipe`, the
tensor-parallel refusal; tensor parallelism is refused by both).
"""

from __future__ import annotations

import torch

from mxmoe.integrations.torchtitan.common import check_versions, installed_torchtitan, mx_recipe

TORCHTITAN_VERSION = installed_torchtitan()
"""The installed torchtitan's version string."""
ADAPTER = check_versions(TORCHTITAN_VERSION, torch.__version__)
"""The torchtitan (major, minor) whose adapter this package exports: (0, 2) or (0, 3)."""

if ADAPTER == (0, 2):
    from mxmoe.integrations.torchtitan.v0_2 import (
        MX,
        JobConfig,
        MXGroupedExperts,
        MXMoEConverter,
    )

    __all__ = [
        "ADAPTER",
        "MX",
        "MXGroupedExperts",
        "MXMoEConverter",
        "JobConfig",
        "TORCHTITAN_VERSION",
        "mx_recipe",
    ]
else:
    from mxmoe.integrations.torchtitan.common import OPTION_NAMES
    from mxmoe.integrations.torchtitan.converters import (
        MXGroupedExpertsConverter,
        MXLinear,
        MXLinearConverter,
        mx_grouped_experts_cls,
    )
    from mxmoe.integrations.torchtitan.dispatcher import (
        MXFP8AllToAllTokenDispatcher,
        MXFP8TokenDispatcherConverter,
        mxfp8_dispatcher_config,
    )
    from mxmoe.integrations.torchtitan.overrides import (
        LINEAR_OVERRIDE_FQNS,
        mxmoe_a2a,
        mxmoe_grouped_mm,
        mxmoe_linear,
    )

    __all__ = [
        "ADAPTER",
        "LINEAR_OVERRIDE_FQNS",
        "MXFP8AllToAllTokenDispatcher",
        "MXFP8TokenDispatcherConverter",
        "MXGroupedExpertsConverter",
        "MXLinear",
        "MXLinearConverter",
        "OPTION_NAMES",
        "TORCHTITAN_VERSION",
        "mx_grouped_experts_cls",
        "mx_recipe",
        "mxfp8_dispatcher_config",
        "mxmoe_a2a",
        "mxmoe_grouped_mm",
        "mxmoe_linear",
    ]
