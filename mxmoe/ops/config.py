"""The ops' configuration is the one recipe, `mxmoe.recipe.MXRecipe`; `MXOpConfig` stays as a
compatibility constructor for code written against the earlier op-level config."""

from __future__ import annotations

import torch

from mxmoe.recipe import DEFAULT_RECIPE, GEMM_BACKENDS, MXRecipe

__all__ = ["GEMM_BACKENDS", "MXOpConfig", "as_recipe"]


def MXOpConfig(  # noqa: N802 - keeps the former class name callable as before
    elem_dtype: torch.dtype = torch.float8_e4m3fn,
    block_size: int = 32,
    scaling_mode: str = "rceil",
    kernel: str = "auto",
    dim1_kernel: str = "auto",
    gemm_backend: str = "auto",
    gemm_dtype: torch.dtype | None = None,
) -> MXRecipe:
    """The `MXRecipe` with these settings (the former MXOpConfig's fields and defaults; `kernel`
    is the recipe's `dim0_kernel`). Checked as MXRecipe checks, with the same errors."""
    return MXRecipe(
        elem_dtype=elem_dtype,
        block_size=block_size,
        scaling_mode=scaling_mode,
        dim0_kernel=kernel,
        dim1_kernel=dim1_kernel,
        gemm_backend=gemm_backend,
        gemm_dtype=gemm_dtype,
    )


def as_recipe(config: MXRecipe | None, name: str = "config") -> MXRecipe:
    """`config`, or DEFAULT_RECIPE for None; a clear error for anything else."""
    if config is None:
        return DEFAULT_RECIPE
    if not isinstance(config, MXRecipe):
        raise TypeError(
            f"{name} must be an mxmoe.MXRecipe (e.g. mxmoe.recipe('mxfp8')) or None, got "
            f"{type(config).__name__}"
        )
    return config
