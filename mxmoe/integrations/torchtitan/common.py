"""The core mxmoe's torchtitan adapters (`v0_2`, `v0_3`) share, whatever the torchtitan version: the
version floors, the MX options (`mxmoe.MXOptions`, torchtitan's spellings) -> one `MXRecipe`, and
the tensor-parallel refusal. A new adapter (`v0_4/`) builds on these and on mxmoe's dispatch seam
(`mxmoe.token_dispatch`), as the two existing ones do.

This module imports neither torchtitan nor anything that does, so the version checks can run
before a torchtitan module is imported.
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass

from mxmoe.options import MXOptions
from mxmoe.recipe import DEFAULT_RECIPE_NAME, MXRecipe


@dataclass(frozen=True)
class Adapter:
    """One row of the version table: the adapter of one torchtitan (major, minor)."""

    package: str
    """The adapter's package, imported (and its `__all__` exported) when this torchtitan is installed."""
    torch_floor: tuple[int, int]
    """The oldest torch its trainer runs on."""
    import_floor: tuple[int, int]
    """The oldest torch on which torchtitan's models and the adapter import."""
    plugs_into: str
    """What the adapter plugs into."""
    floor_note: str = ""
    """Said after the torch-floor error: why, and what else would run."""


ADAPTERS: dict[tuple[int, int], Adapter] = {
    (0, 2): Adapter(
        "mxmoe.integrations.torchtitan.v0_2", (2, 11), (2, 11),
        "TOML job configs: --model.converters mxmoe with an [mx] section",
    ),
    (0, 3): Adapter(
        "mxmoe.integrations.torchtitan.v0_3", (2, 14), (2, 12),
        "config_registry functions, model-config converters and overrides",
        " (torchtitan 0.3's models need torch.distributed.fsdp.DataParallelMeshDims and "
        "torch.compiler._is_non_strict_tracing, from torch 2.12; its trainer calls "
        "torch.distributed.set_timeout, from torch 2.14); torchtitan 0.2.x runs on torch 2.11: "
        "pip install 'mxmoe[torchtitan02]'",
    ),
}
"""The version table: torchtitan (major, minor) -> its adapter. torchtitan 0.4 is one new package
(`v0_4/`, exporting its names in `__all__`) and one row here.

torchtitan 0.2.x imports and trains on torch 2.11. torchtitan 0.3's models import on torch 2.12
(they need torch.distributed.fsdp.DataParallelMeshDims, and its all-to-all dispatcher
torch.compiler._is_non_strict_tracing), but its trainer calls torch.distributed.set_timeout after
the first step, which torch 2.13 lacks: the trainer needs torch 2.14."""


def _major_minor(version: str) -> tuple[int, int]:
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError) as e:
        raise ValueError(f"version {version!r} is not of the form MAJOR.MINOR[.PATCH]") from e


def installed_torchtitan() -> str:
    """The installed torchtitan's version string (ImportError naming the fix when there is none)."""
    try:
        return importlib.metadata.version("torchtitan")
    except importlib.metadata.PackageNotFoundError as e:
        raise ImportError(
            "mxmoe.integrations.torchtitan needs torchtitan 0.2.x (torch >= 2.11) or 0.3 (torch >= 2.14): "
            "pip install 'mxmoe[torchtitan02]' or 'mxmoe[torchtitan]'"
        ) from e


def check_versions(torchtitan_version: str, torch_version: str) -> tuple[int, int]:
    """The adapter (torchtitan (major, minor)) for these versions; ImportError naming the versions
    and what is needed when there is none.

    torchtitan 0.3 on torch 2.12 / 2.13 passes (its models and mxmoe's converters import there)
    but its trainer needs torch 2.14 (`check_trainer_torch`, run by the 0.3 config_registry).
    """
    tt, th = _major_minor(torchtitan_version), _major_minor(torch_version)
    row = ADAPTERS.get(tt)
    if row is None:
        versions = " and ".join(f"{a}.{b}.x" for a, b in ADAPTERS)
        raise ImportError(
            f"mxmoe.integrations.torchtitan supports torchtitan {versions}, this is torchtitan "
            f"{torchtitan_version}"
        )
    if th < row.import_floor:
        floor = row.torch_floor
        raise ImportError(
            f"torchtitan {tt[0]}.{tt[1]} needs torch >= {floor[0]}.{floor[1]}, this is torch {torch_version}"
            + row.floor_note
        )
    return tt


def check_trainer_torch(torch_module) -> None:
    """ImportError unless this torch can run torchtitan 0.3's trainer (torch >= 2.14: after the
    first step the trainer calls torch.distributed.set_timeout)."""
    if not hasattr(torch_module.distributed, "set_timeout"):
        raise ImportError(
            f"torchtitan 0.3's trainer needs torch >= 2.14 (it calls torch.distributed.set_timeout after "
            f"the first step), this is torch {torch_module.__version__}: pip install 'torch>=2.14' "
            "(or torchtitan 0.2.x, which trains on torch 2.11: pip install 'mxmoe[torchtitan02]')"
        )


RECIPE_FIELDS = (
    "recipe_name",
    "mxfp8_dim0_cast_kernel_choice",
    "mxfp8_dim1_cast_kernel_choice",
    "gemm_backend",
    "gemm_dtype",
    "expert_gemm",
)
"""The `mxmoe.MXOptions` fields that make its recipe (`MXOptions.to_recipe`): what a swapped module's
Config carries (the converters' Configs carry every field of MXOptions)."""

OPTION_NAMES = RECIPE_FIELDS
"""The options a swapped module's Config carries (the old name of RECIPE_FIELDS)."""


def options_of(obj, **changes) -> MXOptions:
    """The MXOptions that `obj` (a converter's or a swapped module's Config, or any object) carries
    in its fields of the same names (missing ones: MXOptions' defaults), with `changes` applied;
    ValueError naming a bad field."""
    from dataclasses import fields

    values = {f.name: getattr(obj, f.name) for f in fields(MXOptions) if hasattr(obj, f.name)}
    return MXOptions(**{**values, **changes})


def mx_recipe(recipe_name: str = DEFAULT_RECIPE_NAME, **options) -> MXRecipe:
    """The MXRecipe named by MX options in torchtitan's spellings (strings, as they come from a CLI
    or a config): recipe_name and any other recipe field of `mxmoe.MXOptions`
    (mxfp8_dim0_cast_kernel_choice, mxfp8_dim1_cast_kernel_choice, gemm_backend, gemm_dtype,
    expert_gemm), MXOptions' defaults for the rest. Raises ValueError naming the option for a bad
    value, TypeError for an unknown option."""
    unknown = sorted(set(options) - set(RECIPE_FIELDS))
    if unknown:
        raise TypeError(f"mx_recipe: unknown option(s) {unknown}; accepted: {list(RECIPE_FIELDS)}")
    return MXOptions(recipe_name=recipe_name, **options).to_recipe()


def mx_options(cfg) -> dict:
    """The RECIPE_FIELDS of a converter or swapped module's Config, as `mx_recipe` kwargs."""
    return {name: getattr(cfg, name) for name in RECIPE_FIELDS}


def same_format(a: MXRecipe, b: MXRecipe) -> bool:
    """Whether rows quantized with `a` quantize to the same values with `b` (element dtype, block
    size, scaling mode): MX rows of one can feed GEMMs of the other without a cast."""
    return (a.elem_dtype, a.block_size, a.scaling_mode) == (b.elem_dtype, b.block_size, b.scaling_mode)


KERNEL_FIELDS = ("mxfp8_dim0_cast_kernel_choice", "mxfp8_dim1_cast_kernel_choice")
"""The MXOptions fields that name a cast kernel."""


def check_kernels(options: MXOptions, where: str, device=None) -> None:
    """ValueError naming the option, its value and why, when a cast kernel `options` names (not
    "auto"), or gemm_backend='native', cannot run on `device` (default: the one torchtitan trains
    on, CUDA where there is one, else the CPU): called when a converter is built, so that `triton`
    on a CPU without the Triton interpreter stops there, not at the first forward."""
    import torch

    from mxmoe.quant.backends import default_device, why_unavailable

    device = default_device() if device is None else torch.device(device)
    for name in KERNEL_FIELDS:
        kernel = getattr(options, name)
        reason = None if kernel == "auto" else why_unavailable(kernel, device)
        if reason is not None:
            raise ValueError(
                f"{where}: mx.{name}={kernel!r} cannot run on this machine's {device.type}: {reason}"
            )
    if options.gemm_backend == "native":
        from mxmoe.ops.gemm_backend import native_unavailable

        reason = native_unavailable(device)
        if reason is not None:
            raise ValueError(f"{where}: mx.{reason}; use gemm_backend 'auto' or 'emulated'")


def tensor_parallel_error(where: str, degree: int) -> ValueError:
    """The refusal of tensor parallelism (both adapters): MX linears and experts compute on whole
    weights (no sharded-K GEMM, no sharded scales)."""
    return ValueError(
        f"{where}: tensor parallelism is not supported with mxmoe's MX converters "
        f"(parallelism.tensor_parallel_degree={degree}); use tensor_parallel_degree=1 with data and "
        "expert parallelism"
    )
