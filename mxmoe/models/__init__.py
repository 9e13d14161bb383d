"""Models: a decoder-only MoE transformer (and its dense variant) with expert parallelism."""

from mxmoe.models.expert_parallel import ExpertParallel, apply_expert_parallel, expert_major_index
from mxmoe.models.graphs import GraphedStep
from mxmoe.models.moe import PRESETS, ModelArgs, MoE, Router, Transformer, model_args
from mxmoe.models.routing import LocalExperts, expert_counts, routed_experts

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
