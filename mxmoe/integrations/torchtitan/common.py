"""What mxmoe's torchtitan adapters share, whatever the torchtitan version: the version floors,
the MX options in torchtitan's spellings -> one `MXRecipe`, whether MX experts take the MXFP8
dispatcher's rows as they arrive (`takes_mx_rows`), and the tensor-parallel refusal.

This module imports neither torchtitan nor anything that does, so the version checks can run
before a torchtitan module is imported.
"""

from __future__ import annotations

import importlib.metadata

from mxmoe.options import MXOptions
from mxmoe.recipe import MXRecipe

SUPPORTED = {
    (0, 2): ((2, 11), "the seed's TOML-era job config: --model.converters mxmoe with an [mx] section"),
    (0, 3): ((2, 14), "config_registry functions, model-config converters and overrides"),
}
"""torchtitan (major, minor) -> (the torch it needs, what the adapter plugs into).

torchtitan 0.2.x imports and trains on torch 2.11. torchtitan 0.3's models import on torch 2.12
(they need torch.distributed.fsdp.DataParallelMeshDims, and its all-to-all dispatcher
torch.compiler._is_non_strict_tracing), but its trainer calls torch.distributed.set_timeout after
the first step, which torch 2.13 lacks: the trainer needs torch 2.14."""

TORCHTITAN_03_IMPORT_FLOOR = (2, 12)
"""The oldest torch on which torchtitan 0.3's models (and mxmoe's 0.3 converters) import."""


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
    if tt not in SUPPORTED:
        raise ImportError(
            f"mxmoe.integrations.torchtitan supports torchtitan 0.2.x and 0.3.x, this is torchtitan "
            f"{torchtitan_version}"
        )
    need = TORCHTITAN_03_IMPORT_FLOOR if tt == (0, 3) else SUPPORTED[tt][0]
    if th < need:
        floor = SUPPORTED[tt][0]
        raise ImportError(
            f"torchtitan {tt[0]}.{tt[1]} needs torch >= {floor[0]}.{floor[1]}, this is torch {torch_version}"
            + (
                " (torchtitan 0.3's models need torch.distributed.fsdp.DataParallelMeshDims and "
                "torch.compiler._is_non_strict_tracing, from torch 2.12; its trainer calls "
                "torch.distributed.set_timeout, from torch 2.14); torchtitan 0.2.x runs on torch 2.11: "
                "pip install 'mxmoe[torchtitan02]'"
                if tt == (0, 3)
                else ""
            )
        )
    return tt


def check_trainer_torch(torch_module) -> None:
    """ImportError unless this torch can run torchtitan 0.3's trainer (torch >= 2.14: after the
    first step the trainer calls torch.distributed.set_timeout)."""
    if not hasattr(torch_module.distributed, "set_timeout"):
        raise ImportError(
            f"torchtitan 0.3's trainer needs torch >= 2.14 (it calls torch.distributed.set_timeout after "
            f"the first step), this is torch {torch_module.__version__}; torchtitan 0.2.x trains on "
            "torch 2.11: pip install 'mxmoe[torchtitan02]'"
        )


OPTION_NAMES = (
    "recipe_name",
    "mxfp8_dim1_cast_kernel_choice",
    "mxfp8_dim0_cast_kernel_choice",
    "gemm_dtype",
)
"""The options every 0.3 converter and swapped module's Config carries (torchtitan spellings):
recipe_name ("mxfp8_rceil" default | "mxfp8"), the two cast kernel choices ("auto" default |
"torch" | "triton" | "cuda") and gemm_dtype ("auto" default | "bfloat16" | "float32"); see
`mx_recipe`."""


def mx_recipe(
    recipe_name: str = "mxfp8_rceil",
    mxfp8_dim1_cast_kernel_choice: str = "auto",
    mxfp8_dim0_cast_kernel_choice: str = "auto",
    gemm_dtype: str = "auto",
    gemm_backend: str = "auto",
) -> MXRecipe:
    """The MXRecipe named by torchtitan-style options (strings, as they come from a CLI or config).

    recipe_name: "mxfp8_rceil" (RCEIL scales, the default) | "mxfp8" (FLOOR scales, OCP).
    mxfp8_dim1_cast_kernel_choice / mxfp8_dim0_cast_kernel_choice: "auto" | "torch" | "triton" | "cuda".
    gemm_dtype: operand dtype of the emulated GEMM, "auto" (bf16 on CUDA, fp32 on CPU) | "bfloat16" |
    "float32". gemm_backend: a name in mxmoe.recipe.GEMM_BACKENDS ("auto" default).
    Raises ValueError naming the option for anything else (`mxmoe.MXOptions.to_recipe`).
    """
    return MXOptions(
        recipe_name=recipe_name,
        mxfp8_dim1_cast_kernel_choice=mxfp8_dim1_cast_kernel_choice,
        mxfp8_dim0_cast_kernel_choice=mxfp8_dim0_cast_kernel_choice,
        gemm_dtype=gemm_dtype,
        gemm_backend=gemm_backend,
    ).to_recipe()


def mx_options(cfg) -> dict:
    """The OPTION_NAMES fields of a converter or swapped module's Config, as `mx_recipe` kwargs."""
    return {name: getattr(cfg, name) for name in OPTION_NAMES}


A2A_RECIPE = MXRecipe(scaling_mode="rceil")
"""What mxmoe's MXFP8 exchange produces: e4m3 elements, blocks of 32, RCEIL scales."""


def takes_mx_rows(experts_config) -> bool:
    """Whether experts built from `experts_config` take the MXFP8 dispatcher's rows as MXTensor
    without a change in results: an MX experts config with torchtitan's SwiGLU forward whose
    recipe quantizes the rows as the exchange does (RCEIL, e4m3, blocks of 32), so that
    requantizing the dequantized rows would give the same values."""
    owner = getattr(type(experts_config), "_owner", None)
    if not getattr(owner, "ACCEPTS_MX_ROWS", False):
        return False
    r = mx_recipe(**mx_options(experts_config))
    return (r.elem_dtype, r.block_size, r.scaling_mode) == (
        A2A_RECIPE.elem_dtype,
        A2A_RECIPE.block_size,
        A2A_RECIPE.scaling_mode,
    )


def tensor_parallel_error(where: str, degree: int) -> ValueError:
    """The refusal of tensor parallelism (both adapters): MX linears and experts compute on whole
    weights (no sharded-K GEMM, no sharded scales)."""
    return ValueError(
        f"{where}: tensor parallelism is not supported with mxmoe's MX converters "
        f"(parallelism.tensor_parallel_degree={degree}); use tensor_parallel_degree=1 with data and "
        "expert parallelism"
    )
