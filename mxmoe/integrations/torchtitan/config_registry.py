"""torchtitan config_registry functions with mxmoe's converters: `--module mxmoe.integrations.torchtitan
--config <function>` (torchtitan 0.3 selects a Python config function, not a TOML file; its trainer
needs torch >= 2.14, checked on import).

Each function is torchtitan's own config of the same name without the `_mxmoe` suffix, with the
model built through mxmoe's converters; everything else (data, optimizer, schedule, parallelism)
is torchtitan's and is changed from the command line as usual (`--training.steps 200`,
`--parallelism.expert_parallel_degree 2`, ...). docs/torchtitan.md has the commands.
"""

from __future__ import annotations

import torch

from mxmoe.integrations.torchtitan.common import check_trainer_torch

check_trainer_torch(torch)  # before torchtitan.trainer: a clear error instead of one after step 1

from torchtitan.trainer import Trainer  # noqa: E402

from mxmoe.integrations.torchtitan.converters import MXGroupedExpertsConverter, MXLinearConverter  # noqa: E402
from mxmoe.integrations.torchtitan.dispatcher import MXFP8TokenDispatcherConverter  # noqa: E402


def mxmoe_converters(recipe_name: str = "mxfp8_rceil", mxfp8_dim1_cast_kernel_choice: str = "auto") -> list:
    """MX Linear (all but the output head and router gates), MX expert GEMMs and the MXFP8
    all-to-all token dispatcher, with one recipe."""
    options = {
        "recipe_name": recipe_name,
        "mxfp8_dim1_cast_kernel_choice": mxfp8_dim1_cast_kernel_choice,
    }
    return [
        MXLinearConverter.Config(**options),
        MXGroupedExpertsConverter.Config(**options),
        MXFP8TokenDispatcherConverter.Config(),
    ]


def deepseek_v3_debugmodel_mxmoe() -> Trainer.Config:
    """torchtitan's DeepSeek-V3 debug MoE model (6 layers, dim 256, 8 experts, top-3, 2 shared
    experts), every Linear but lm_head / router gates and every routed-expert GEMM in MXFP8
    (RCEIL), MXFP8 expert-parallel all-to-all when expert_parallel_degree > 1."""
    from torchtitan.models.deepseek_v3 import model_registry
    from torchtitan.models.deepseek_v3.config_registry import deepseek_v3_debugmodel

    config = deepseek_v3_debugmodel()
    config.model_spec = model_registry("debugmodel", converters=mxmoe_converters())
    return config


def qwen3_moe_debug_mxmoe() -> Trainer.Config:
    """torchtitan's Qwen3 debug MoE model with mxmoe's converters (as deepseek_v3_debugmodel_mxmoe)."""
    from torchtitan.models.qwen3 import model_registry
    from torchtitan.models.qwen3.config_registry import qwen3_moe_debug

    config = qwen3_moe_debug()
    config.model_spec = model_registry("debugmodel_moe", converters=mxmoe_converters())
    return config
