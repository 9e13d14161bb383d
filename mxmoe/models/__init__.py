"""Models: a decoder-only MoE transformer (and its dense variant) with expert parallelism."""

from mxmoe.models.expert_parallel import (
    ExpertParallel,
    LocalExperts,
    apply_expert_parallel,
    expert_counts,
    expert_major_index,
    routed_experts,
)
from mxmoe.models.graphs import GraphedStep
from mxmoe.models.moe import PRESETS, ModelArgs, MoE, Router, Transformer, model_args

__all__ = [
    "ExpertParallel",
    "GraphedStep",
    "LocalExperts",
    "apply_expert_parallel",
    "expert_counts",
    "PRESETS",
    "ModelArgs",
    "MoE",
    "Router",
    "Transformer",
    "expert_major_index",
    "model_args",
    "routed_experts",
]
