"""torchtitan config_registry functions with mxmoe's converter: `--module mxmoe.integrations.torchtitan
--config <function>` (torchtitan 0.3 selects a Python config function, not a TOML file; its trainer
needs torch >= 2.14, checked on import: on an older torch the ImportError says what to install,
whatever torchtitan's loader does with it, see `mxmoe.integrations.torchtitan.__getattr__`).

Each function is torchtitan's own config of the same name without the `_mxmoe` suffix (`_mx`: the
same), with the model built through `MXMoEConverter` and `mxmoe.MXOptions`' defaults; everything
else (data, optimizer, schedule, parallelism) is torchtitan's and is changed from the command line
as usual (`--training.steps 200`, `--parallelism.expert_parallel_degree 2`, ...). docs/torchtitan.md
has the commands.
"""

from __future__ import annotations

import torch

from mxmoe.integrations.torchtitan.common import check_trainer_torch

check_trainer_torch(torch)  # before torchtitan.trainer: a clear error instead of one after step 1

from torchtitan.trainer import Trainer  # noqa: E402

from mxmoe.integrations.torchtitan.v0_3.converters import MXMoEConverter  # noqa: E402


def mxmoe_converters(**options) -> list:
    """mxmoe's converter with `options` (fields of mxmoe.MXOptions; its defaults otherwise): MX
    Linear layers (not the output head, router gates or attention), MX experts and mxmoe's MXFP8
    exchange for expert parallelism."""
    return [MXMoEConverter.Config(**options)]


def deepseek_v3_debugmodel_mxmoe() -> Trainer.Config:
    """torchtitan's DeepSeek-V3 debug MoE model (6 layers, dim 256, 8 experts, top-3, 2 shared
    experts) with mxmoe's defaults: the routed experts' GEMMs, the dense and shared-expert
    feed-forward layers in MXFP8 (RCEIL), the MXFP8 exchange when expert_parallel_degree > 1."""
    from torchtitan.models.deepseek_v3 import model_registry
    from torchtitan.models.deepseek_v3.config_registry import deepseek_v3_debugmodel

    config = deepseek_v3_debugmodel()
    config.model_spec = model_registry("debugmodel", converters=mxmoe_converters())
    return config


def qwen3_moe_debug_mxmoe() -> Trainer.Config:
    """torchtitan's Qwen3 debug MoE model with mxmoe's converter (as deepseek_v3_debugmodel_mxmoe)."""
    from torchtitan.models.qwen3 import model_registry
    from torchtitan.models.qwen3.config_registry import qwen3_moe_debug

    config = qwen3_moe_debug()
    config.model_spec = model_registry("debugmodel_moe", converters=mxmoe_converters())
    return config


deepseek_v3_debugmodel_mx = deepseek_v3_debugmodel_mxmoe
qwen3_moe_debug_mx = qwen3_moe_debug_mxmoe
