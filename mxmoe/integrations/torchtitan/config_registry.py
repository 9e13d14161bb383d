"""`--module mxmoe.integrations.torchtitan`: torchtitan 0.3's loader imports this module for the
config functions (`mxmoe.integrations.torchtitan.v0_3.config_registry`; on torch < 2.14 importing
it raises an ImportError that says what to install)."""

from mxmoe.integrations.torchtitan.v0_3.config_registry import *  # noqa: F403
from mxmoe.integrations.torchtitan.v0_3.config_registry import (  # noqa: F401
    deepseek_v3_debugmodel_mx,
    deepseek_v3_debugmodel_mxmoe,
    mxmoe_converters,
    qwen3_moe_debug_mx,
    qwen3_moe_debug_mxmoe,
)
