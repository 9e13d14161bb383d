"""Modules: the high-precision GroupedExperts, their MX versions, `convert`, and `project` (several
linear layers on one input, MXLinears sharing one cast of it)."""

from mxmoe.nn.converter import ConversionReport, convert
from mxmoe.nn.experts import GroupedExperts, grouped_mm, offsets_from_counts
from mxmoe.nn.linear import MXLinear, project
from mxmoe.nn.mx_experts import MXGroupedExperts

__all__ = [
    "ConversionReport",
    "GroupedExperts",
    "MXGroupedExperts",
    "MXLinear",
    "convert",
    "grouped_mm",
    "offsets_from_counts",
    "project",
]

