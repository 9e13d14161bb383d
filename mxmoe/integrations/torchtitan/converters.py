"""torchtitan 0.3 model-config converters that put mxmoe's MX GEMMs into a torchtitan model.

torchtitan converts a model by rewriting its config tree before `build()` (`ModelConfigConverter`):
`MXLinearConverter` swaps `Linear.Config` for `MXLinear.Config`, and
`MXGroupedExpertsConverter` swaps every `GroupedExperts.Config` (and subclasses with the same
`_grouped_mm` seam, e.g. GPT-OSS's experts) for a subclass whose `_grouped_mm` is
`mxmoe.ops.mx_grouped_mm`. Parameters, their names and their initialization are unchanged, so
checkpoints, FSDP and optimizers see the same model.

Unlike torchtitan's own `mx` converters (torchao, sm_100 only, token groups padded to 32/128 by a
swapped token dispatcher), these run on Hopper (emulated GEMM on exactly dequantized operands) and
on CPU, and take token groups of any size, so the token dispatcher is left alone.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.tensor import DTensor
from torchtitan.components.quantization import QuantizationConverter
from torchtitan.models.common.linear import Linear
from torchtitan.models.common.moe import GroupedExperts

from mxmoe.integrations.torchtitan.common import mx_options, mx_recipe, tensor_parallel_error
from mxmoe.integrations.torchtitan.dispatcher import link_mx_rows
from mxmoe.ops import mx_grouped_mm, mx_mm
from mxmoe.quant.mx_tensor import MXTensor

log = logging.getLogger("mxmoe")


def _refuse_tensor_parallel(module: torch.nn.Module, parallel_dims) -> None:
    tp = int(getattr(parallel_dims, "tp", 1) or 1)
    if tp > 1:
        raise tensor_parallel_error(type(module).__name__, tp)


def _local(t: Tensor) -> Tensor:
    # Expert / data-parallel shards reach the GEMM as local tensors (as torchtitan's GroupedExperts).
    return t.to_local() if isinstance(t, DTensor) else t


def _replicated(t: Tensor, name: str) -> Tensor:
    # A Linear's parameters reach forward whole (FSDP unshards them); a sharded DTensor here would
    # mean a layout this module does not implement (tensor parallelism), not one to compute on.
    if isinstance(t, DTensor):
        if not all(p.is_replicate() for p in t.placements):
            raise ValueError(
                f"MXLinear.{name} is a DTensor with placements {t.placements}; MXLinear computes on "
                "whole (replicated) parameters only (no tensor parallelism)"
            )
        return t.to_local()
    return t


class MXLinear(Linear):
    """torchtitan `Linear` whose forward, dgrad and wgrad GEMMs run on MX operands (`mx_mm`).

    forward(x (..., in_features) bf16/fp32) -> (..., out_features) in x's dtype; bias added in high
    precision. Same parameters (`weight` (out, in), `bias`) and initialization as `Linear`. Equal,
    bit for bit, to `mxmoe.nn.MXLinear` with the same recipe.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Linear.Config):
        recipe_name: str = "mxfp8_rceil"
        mxfp8_dim1_cast_kernel_choice: str = "auto"
        mxfp8_dim0_cast_kernel_choice: str = "auto"
        gemm_dtype: str = "auto"

    def __init__(self, config: Config):
        super().__init__(config)
        self.mx_recipe = mx_recipe(**mx_options(config))

    def forward(self, x: Tensor) -> Tensor:
        y = mx_mm(x, _replicated(self.weight, "weight").t(), self.mx_recipe)
        return y if self.bias is None else y + _replicated(self.bias, "bias").to(y.dtype)

    def parallelize(self, parallel_dims) -> None:
        _refuse_tensor_parallel(self, parallel_dims)
        super().parallelize(parallel_dims)

    def extra_repr(self) -> str:
        r = self.mx_recipe
        return f"{super().extra_repr()}, mx={r.elem_dtype}/{r.scaling_mode}/{r.block_size}"


_mx_experts_cache: dict[type, type] = {}


def mx_grouped_experts_cls(parent_cls: type) -> type:
    """The MX subclass of an experts class with torchtitan's `_grouped_mm(*, A, B_t, offs)` seam.

    Its `_grouped_mm` is `mxmoe.ops.mx_grouped_mm(A, B_t, offs)`: A (T, K) bf16 tokens grouped by
    expert, B_t (E, K, N) the transposed expert weights, offs (E,) int32 group ends -> (T, N) in A's
    dtype. Its Config adds the mxmoe options. One class per parent (cached).
    """
    if parent_cls in _mx_experts_cache:
        return _mx_experts_cache[parent_cls]
    if not (isinstance(parent_cls, type) and issubclass(parent_cls, GroupedExperts)):
        raise TypeError(f"parent_cls must be a GroupedExperts subclass, got {parent_cls!r}")
    parent_config_cls = parent_cls.Config
    # MX rows from the MXFP8 dispatcher are understood where the forward is torchtitan's SwiGLU
    # GroupedExperts.forward (re-implemented below for MXTensor input), not by subclasses with
    # their own forward (GPT-OSS: biases, clamped SwiGLU), which get dequantized rows.
    accepts_mx_rows = parent_cls.forward is GroupedExperts.forward

    class MXGroupedExperts(parent_cls):
        @dataclass(kw_only=True, slots=True)
        class Config(parent_config_cls):
            recipe_name: str = "mxfp8_rceil"
            mxfp8_dim1_cast_kernel_choice: str = "auto"
            mxfp8_dim0_cast_kernel_choice: str = "auto"
            gemm_dtype: str = "auto"

        ACCEPTS_MX_ROWS = accepts_mx_rows
        """forward takes the MXFP8 dispatcher's MXTensor rows (see `takes_mx_rows`)."""

        def __init__(self, config):
            super().__init__(config)
            self.mx_recipe = mx_recipe(**mx_options(config))

        def _grouped_mm(self, *, A: Tensor | MXTensor, B_t: Tensor, offs: Tensor) -> Tensor:
            return mx_grouped_mm(A, B_t, offs, self.mx_recipe)

        if accepts_mx_rows:

            def forward(self, x_RD: Tensor | MXTensor, num_tokens_per_expert_E: Tensor) -> Tensor:
                if not isinstance(x_RD, MXTensor):
                    return super().forward(x_RD, num_tokens_per_expert_E)
                # MXFP8 rows from the dispatcher (bf16 origin): the w1 / w3 GEMMs take them as
                # they are; otherwise torchtitan's GroupedExperts.forward, step for step.
                w1, w2, w3 = (_local(w).bfloat16() for w in (self.w1_EFD, self.w2_EDF, self.w3_EFD))
                offs = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
                h = F.silu(self._grouped_mm(A=x_RD, B_t=w1.transpose(-2, -1), offs=offs))
                h = h * self._grouped_mm(A=x_RD, B_t=w3.transpose(-2, -1), offs=offs)
                return self._grouped_mm(A=h, B_t=w2.transpose(-2, -1), offs=offs)

        def parallelize(self, parallel_dims) -> None:
            _refuse_tensor_parallel(self, parallel_dims)
            super().parallelize(parallel_dims)

    MXGroupedExperts.__name__ = MXGroupedExperts.__qualname__ = f"MX{parent_cls.__name__}"
    MXGroupedExperts.Config.__qualname__ = f"MX{parent_cls.__name__}.Config"
    _mx_experts_cache[parent_cls] = MXGroupedExperts
    return MXGroupedExperts


def _replace(model_config, parent, attr, new_config):
    if parent is None:
        return new_config
    if isinstance(parent, list):
        parent[attr] = new_config
    else:
        setattr(parent, attr, new_config)
    return model_config


class MXLinearConverter(QuantizationConverter):
    """Replace matching `Linear.Config` with `MXLinear.Config` (mxmoe MX GEMMs; Hopper and CPU)."""

    @dataclass(kw_only=True, slots=True)
    class Config(QuantizationConverter.Config):
        recipe_name: str = "mxfp8_rceil"
        mxfp8_dim1_cast_kernel_choice: str = "auto"
        mxfp8_dim0_cast_kernel_choice: str = "auto"
        gemm_dtype: str = "auto"
        fqns: list[str] = field(default_factory=list)
        """Include list (as torchtitan's MXFP8LinearConverter): only Linear configs whose FQN
        contains one of these substrings are converted; empty = every Linear."""
        filter_fqns: list[str] = field(default_factory=lambda: ["lm_head", "router"])
        """Exclude list (as torchtitan's Float8LinearConverter): Linear configs whose FQN contains
        one of these substrings stay high precision. Default: the output head and the MoE router
        gate (routing decisions are precision-sensitive)."""

    def __init__(self, config: Config):
        self.config = config
        self.recipe = mx_recipe(**mx_options(config))  # checks the options now, not at build time

    def convert(self, model_config):
        cfg = self.config
        bs = self.recipe.block_size
        converted, skipped = 0, []
        for fqn, lin, parent, attr in list(model_config.traverse(Linear.Config)):
            if (
                type(lin) is not Linear.Config
            ):  # subclasses (e.g. TP's scaled-bias rowwise) keep their own forward
                continue
            if cfg.fqns and not any(f in fqn for f in cfg.fqns):
                continue
            if any(f in fqn for f in cfg.filter_fqns):
                skipped.append(f"{fqn} (filter_fqns)")
                continue
            if lin.in_features % bs or lin.out_features % bs:
                skipped.append(f"{fqn} ({lin.in_features}x{lin.out_features} not divisible by {bs})")
                continue
            new = MXLinear.Config(
                in_features=lin.in_features,
                out_features=lin.out_features,
                bias=lin.bias,
                param_init=lin.param_init,
                sharding_config=lin.sharding_config,
                **mx_options(cfg),
            )
            model_config = _replace(model_config, parent, attr, new)
            converted += 1
        log.info(
            "mxmoe: %d Linear -> MXLinear (recipe %s); skipped: %s",
            converted,
            cfg.recipe_name,
            ", ".join(skipped) or "none",
        )
        return model_config


class MXGroupedExpertsConverter(QuantizationConverter):
    """Replace every `GroupedExperts.Config` (and subclasses with the `_grouped_mm` seam, e.g.
    GPT-OSS's experts) with its MX subclass: the expert grouped GEMMs run on MX operands, forward
    and backward. Token groups of any size; the token dispatcher is not touched."""

    @dataclass(kw_only=True, slots=True)
    class Config(QuantizationConverter.Config):
        recipe_name: str = "mxfp8_rceil"
        mxfp8_dim1_cast_kernel_choice: str = "auto"
        mxfp8_dim0_cast_kernel_choice: str = "auto"
        gemm_dtype: str = "auto"

    def __init__(self, config: Config):
        self.config = config
        self.recipe = mx_recipe(**mx_options(config))

    def convert(self, model_config):
        bs = self.recipe.block_size
        converted, skipped = 0, []
        for fqn, exp, parent, attr in list(model_config.traverse(GroupedExperts.Config)):
            base_cls = type(exp)._owner
            if base_cls in _mx_experts_cache.values():  # already converted
                continue
            if exp.dim % bs or exp.hidden_dim % bs:
                skipped.append(f"{fqn} (dim {exp.dim}, hidden_dim {exp.hidden_dim} not divisible by {bs})")
                continue
            new_cls = mx_grouped_experts_cls(base_cls).Config
            new = new_cls(**{f.name: getattr(exp, f.name) for f in fields(exp)}, **mx_options(self.config))
            model_config = _replace(model_config, parent, attr, new)
            if hasattr(parent, "token_dispatcher"):  # parent: the RoutedExperts.Config
                link_mx_rows(parent)
            converted += 1
        log.info(
            "mxmoe: %d GroupedExperts -> MX grouped GEMMs (recipe %s); skipped: %s",
            converted,
            self.config.recipe_name,
            ", ".join(skipped) or "none",
        )
        return model_config
