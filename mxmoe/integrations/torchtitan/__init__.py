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

Both adapters are built on the shared core (`common`: the version table, MXOptions -> one
`mxmoe.MXRecipe`, the tensor-parallel refusal), on the experts' shared paths in `mxmoe.nn` and on
mxmoe's dispatch seam (`mxmoe.token_dispatch`): a next version's adapter is a `v0_N/` package
beside them and one row of `common.ADAPTERS`, which picks it here.
"""

from __future__ import annotations

import importlib
import importlib.util

import torch

from mxmoe.integrations.torchtitan.common import (
    ADAPTERS,
    check_versions,
    installed_torchtitan,
    mx_recipe,  # noqa: F401  (exported: __all__ below)
)

try:
    TORCHTITAN_VERSION: str | None = installed_torchtitan()
    """The installed torchtitan's version string (None: torchtitan is not installed)."""
except ImportError as e:
    TORCHTITAN_VERSION, _MISSING = None, str(e)
ADAPTER = None if TORCHTITAN_VERSION is None else check_versions(TORCHTITAN_VERSION, torch.__version__)
"""The torchtitan (major, minor) whose adapter this package exports (a key of `common.ADAPTERS`);
None without torchtitan."""

if ADAPTER is None:
    # Without torchtitan the package still imports, for its tools that need none (`python -m
    # mxmoe.integrations.torchtitan.data`); an adapter's name raises the ImportError naming the fix.
    _adapter = None
    __all__ = ["ADAPTER", "TORCHTITAN_VERSION", "mx_recipe"]
else:
    _adapter = importlib.import_module(ADAPTERS[ADAPTER].package)
    globals().update({name: getattr(_adapter, name) for name in _adapter.__all__})
    __all__ = sorted({"ADAPTER", "TORCHTITAN_VERSION", "mx_recipe", *_adapter.__all__})


def __getattr__(name: str):
    if _adapter is None:
        if name.startswith("_") or importlib.util.find_spec(f"{__name__}.{name}") is not None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")  # a submodule: import it
        raise ImportError(_MISSING)
    # what the adapter package resolves on first use (torchtitan 0.3's config functions)
    try:
        return getattr(_adapter, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
