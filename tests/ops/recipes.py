"""Recipes and group sizes the ops' tests share (CPU kernels: the torch casts)."""

import torch

from mxmoe.recipe import MXRecipe

CPU = MXRecipe(dim0_kernel="torch", dim1_kernel="torch")
CPU_BF16 = MXRecipe(dim0_kernel="torch", dim1_kernel="torch", gemm_dtype=torch.bfloat16)

SWIGLU_COUNTS = [
    [5, 0, 33, 1, 31, 0],  # ragged, empty groups, 10 rows after the last group (T = 80)
    [0, 80, 0],  # one group of every row
    [0, 0, 0],  # every row in no group
]
"""Expert group sizes of the SwiGLU ops' tests (80 rows)."""
