"""mxmoe inside torchtitan's trainer: MX linear layers, MX expert GEMMs and mxmoe's MXFP8 exchange
for expert parallelism, one adapter per torchtitan version (docs/torchtitan.md).

Importing this package picks the adapter of the installed torchtitan and exports its names:

* torchtitan **0.2.x** (torch >= 2.11), `v0_2/`: the TOML-era job config.
  `--job.custom_config_module mxmoe.integrations.torchtitan --model.converters mxmoe` (or `mx`)
  with the options (`mxmoe.MXOptions`) in an `[mx]` section or as `--mx.*` flags. Exports
  `JobConfig` (the `[mx]` section torchtitan merges into its own), `MXMoEConverter`,
  `MXGroupedExperts`, `MXExpertParallel`.
* torchtitan **0.3** (torch >= 2.14 for its trainer; its models import from torch 2.12), `v0_3/`:
  model-config converters (`MXMoEConverter` = `MXConverter`, and one part each), overrides
  (`--override.imports mxmoe.integrations.torchtitan.mxmoe`, or `.mx`, `.mxmoe_linear`,
  `.mxmoe_grouped_mm`, `.mxmoe_a2a`) and config functions (`--module mxmoe.integrations.torchtitan
  --config deepseek_v3_debugmodel_mxmoe`).

Both adapters are built on the shared core (`common`: version floors, MXOptions -> one
`mxmoe.MXRecipe`, the tensor-parallel refusal) and on mxmoe's dispatch seam (`mxmoe.comm.dispatch`):
a next version's adapter is a `v0_N/` package beside them, selected below.
"""

from __future__ import annotations

import importlib.util

import torch

from mxmoe.integrations.torchtitan.common import check_versions, installed_torchtitan, mx_recipe

try:
    TORCHTITAN_VERSION: str | None = installed_torchtitan()
    """The installed torchtitan's version string (None: torchtitan is not installed)."""
except ImportError as e:
    TORCHTITAN_VERSION, _MISSING = None, str(e)
ADAPTER = None if TORCHTITAN_VERSION is None else check_versions(TORCHTITAN_VERSION, torch.__version__)
"""The torchtitan (major, minor) whose adapter this package exports: (0, 2) or (0, 3); None without
torchtitan."""

if ADAPTER is None:
    # Without torchtitan the package still imports, for its tools that need none (`python -m
    # mxmoe.integrations.torchtitan.data`); an adapter's name raises the ImportError naming the fix.
    __all__ = ["ADAPTER", "TORCHTITAN_VERSION", "mx_recipe"]

    def __getattr__(name: str):
        if name.startswith("_") or importlib.util.find_spec(f"{__name__}.{name}") is not None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")  # a submodule: import it
        raise ImportError(_MISSING)

elif ADAPTER == (0, 2):
    from mxmoe.integrations.torchtitan.v0_2 import (
        MX,
        JobConfig,
        MXExpertParallel,
        MXGroupedExperts,
        MXMoEConverter,
    )

    __all__ = [
        "ADAPTER",
        "MX",
        "JobConfig",
        "MXExpertParallel",
        "MXGroupedExperts",
        "MXMoEConverter",
        "TORCHTITAN_VERSION",
        "mx_recipe",
    ]
else:
    from mxmoe.integrations.torchtitan.common import OPTION_NAMES, RECIPE_FIELDS
    from mxmoe.integrations.torchtitan.v0_3 import (
        CONFIG_FUNCTIONS,
        LINEAR_OVERRIDE_FQNS,
        MXConverter,
        MXFP8AllToAllTokenDispatcher,
        MXFP8TokenDispatcherConverter,
        MXGroupedExpertsConverter,
        MXLinear,
        MXLinearConverter,
        MXMoEConverter,
        mx,
        mx_grouped_experts_cls,
        mxfp8_dispatcher_config,
        mxmoe,
        mxmoe_a2a,
        mxmoe_grouped_mm,
        mxmoe_linear,
    )

    __all__ = [
        "ADAPTER",
        "CONFIG_FUNCTIONS",
        "LINEAR_OVERRIDE_FQNS",
        "MXConverter",
        "MXFP8AllToAllTokenDispatcher",
        "MXFP8TokenDispatcherConverter",
        "MXGroupedExpertsConverter",
        "MXLinear",
        "MXLinearConverter",
        "MXMoEConverter",
        "OPTION_NAMES",
        "RECIPE_FIELDS",
        "TORCHTITAN_VERSION",
        "mx",
        "mx_grouped_experts_cls",
        "mx_recipe",
        "mxfp8_dispatcher_config",
        "mxmoe",
        "mxmoe_a2a",
        "mxmoe_grouped_mm",
        "mxmoe_linear",
    ]

    def __getattr__(name: str):
        # `--module mxmoe.integrations.torchtitan --config F`: torchtitan 0.3's loader imports
        # `<module>.config_registry` and, on an ImportError (its trainer's torch floor, checked
        # there), looks F up on this package instead; importing the registry again here raises
        # mxmoe's ImportError (what is needed, what to install) out of the loader.
        if name in CONFIG_FUNCTIONS:
            from mxmoe.integrations.torchtitan.v0_3 import config_registry

            return getattr(config_registry, name)
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
