"""torchtitan 0.3 model-config converters that put mxmoe's MX GEMMs and MXFP8 exchange into a
torchtitan model.

torchtitan converts a model by rewriting its config tree before `build()` (`ModelConfigConverter`).
`MXMoEConverter` does all of mxmoe's parts with one option set (its Config is `mxmoe.MXOptions`,
field for field, with MXOptions' defaults): every `Linear.Config` not filtered -> `MXLinear.Config`
(`convert_linears`), every `GroupedExperts.Config` (and subclasses with the same `_grouped_mm` seam,
e.g. GPT-OSS's experts) -> its MX subclass (`convert_grouped_experts`; the GEMMs per `expert_gemm`),
and torchtitan's all-to-all token dispatcher -> mxmoe's (`mxmoe.integrations.torchtitan.v0_3.dispatcher`:
the exchange per `mxfp8_a2a` and `a2a_transport`); it logs one line (`ConversionReport.summary`).
`MXLinearConverter`, `MXGroupedExpertsConverter` and `MXFP8TokenDispatcherConverter` do one part
each, from the same option set. Parameters, their names and their initialization are unchanged, so
checkpoints, FSDP and optimizers see the same model.

Unlike torchtitan's own `mx` converters (torchao, sm_100 only, token groups padded to 32/128 by a
swapped token dispatcher), these run on Hopper (emulated GEMM on exactly dequantized operands) and
on CPU, and take token groups of any size.
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
from torchtitan.protocols.model import ModelConfigConverter

from mxmoe.integrations.torchtitan.common import check_kernels, options_of, tensor_parallel_error
from mxmoe.integrations.torchtitan.v0_3.dispatcher import convert_dispatchers, link_mx_rows
from mxmoe.integrations.torchtitan.v0_3.fields import (
    MODULE_FIELDS,
    RecipeFields,
    finish_conversion,
    recipe_of,
    reconvert,
)
from mxmoe.nn.converter import ConversionReport
from mxmoe.nn.mx_experts import run_on_mx_rounded_rows
from mxmoe.ops import mx_grouped_mm, mx_mm
from mxmoe.options import MXOptions
from mxmoe.quant.mx_tensor import MXTensor
from mxmoe.token_dispatch import ExpertRows

log = logging.getLogger("mxmoe")


def _fsdp_mxfp8_all_gather(
    module, attrs: tuple[str, ...], config, parallel_dims, cast_dtype: torch.dtype | None = None
) -> None:
    """With config.fsdp_mxfp8_all_gather: let FSDP2 gather `module`'s weights `attrs` as MXFP8
    (`mxmoe.nn.fsdp.wrap_weight`) over torchtitan's FSDP degree (dp_shard x cp); a weight whose
    shards would not hold whole blocks gathers as before. cast_dtype: the dtype the module's forward
    converts the weights to before its MX casts (the experts': bf16)."""
    if not getattr(config, "fsdp_mxfp8_all_gather", False):
        return
    if attrs != ("weight",) and module.recipe.expert_gemm == "bf16":
        return  # bf16 expert GEMMs read the weights themselves
    from mxmoe.nn.fsdp import wrap_weight

    world = int(getattr(parallel_dims, "dp_shard", 1) or 1) * int(getattr(parallel_dims, "cp", 1) or 1)
    for attr in attrs:
        if not isinstance(getattr(module, attr, None), torch.Tensor):  # experts of another layout
            name = type(module).__name__
            log.info("fsdp_mxfp8_all_gather: %s has no weight %s: its weights gather as before", name, attr)
            continue
        why = wrap_weight(module, attr, module.recipe, world, f"{type(module).__name__}.{attr}", cast_dtype)
        if why is not None:
            name = type(module).__name__
            log.info("fsdp_mxfp8_all_gather: %s.%s gathers high precision: %s", name, attr, why)


def check_switches(options: MXOptions, where: str, part: str | None = None) -> None:
    """ValueError naming the options whose switches contradict each other or the converter `where`
    (`part`: the one MXOptions switch a one-part converter is, which must be on), as the 0.2
    converter and `mxmoe train` refuse them: each would be ignored without a word."""
    if part is not None and not getattr(options, part):
        raise ValueError(
            f"{where}: {part}=False, but this converter does nothing else: drop it from the converters "
            "(or use MXMoEConverter, which reads every switch of MXOptions)"
        )
    if options.expert_gemm == "bf16" and not options.convert_grouped_experts:
        raise ValueError(  # as mxmoe train and 0.2: the exchange is the MX experts', so neither applies
            f"{where}: expert_gemm='bf16' sets how the converted experts compute, but "
            "convert_grouped_experts=False leaves them unconverted (bf16 GEMMs and a bf16 exchange); "
            "drop one of the two"
        )


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
    bit for bit, to `mxmoe.nn.MXLinear` with the same recipe (`.recipe`).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Linear.Config, RecipeFields):
        pass

    def __init__(self, config: Config):
        super().__init__(config)
        self.recipe = recipe_of(config)
        self._mx_config = config

    def forward(self, x: Tensor) -> Tensor:
        y = mx_mm(x, _replicated(self.weight, "weight").t(), self.recipe)
        return y if self.bias is None else y + _replicated(self.bias, "bias").to(y.dtype)

    def parallelize(self, parallel_dims) -> None:
        _refuse_tensor_parallel(self, parallel_dims)
        super().parallelize(parallel_dims)
        _fsdp_mxfp8_all_gather(self, ("weight",), self._mx_config, parallel_dims)

    def extra_repr(self) -> str:
        r = self.recipe
        return f"{super().extra_repr()}, mx={r.elem_dtype}/{r.scaling_mode}/{r.block_size}"


_mx_experts_cache: dict[type, type] = {}


def mx_grouped_experts_cls(parent_cls: type) -> type:
    """The MX subclass of an experts class with torchtitan's `_grouped_mm(*, A, B_t, offs)` seam.

    Its `_grouped_mm` is `mxmoe.ops.mx_grouped_mm(A, B_t, offs)` (recipe `expert_gemm="mx"`): A (T, K)
    bf16 tokens grouped by expert (or an MXTensor blocked along K), B_t (E, K, N) the transposed
    expert weights, offs (E,) int32 group ends -> (T, N) in A's dtype; with `expert_gemm="bf16"` the
    parent's own bf16 GEMM on rows rounded to MX once (the exchange only). Its Config adds
    MXOptions' recipe fields; the module keeps its recipe as `.recipe`. One class per parent (cached).
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
        class Config(parent_config_cls, RecipeFields):
            pass

        ACCEPTS_MX_ROWS = accepts_mx_rows
        """forward takes the MXFP8 dispatcher's MXTensor rows (`link_mx_rows`)."""

        def __init__(self, config):
            super().__init__(config)
            self.recipe = recipe_of(config)
            self._mx_config = config

        def _grouped_mm(self, *, A: Tensor | MXTensor, B_t: Tensor, offs: Tensor) -> Tensor:
            if self.recipe.expert_gemm == "bf16":  # the rows are MX-rounded already (forward)
                return parent_cls._grouped_mm(self, A=A, B_t=B_t, offs=offs)
            return mx_grouped_mm(A, B_t, offs, self.recipe)

        def forward(self, x_RD: Tensor | MXTensor, num_tokens_per_expert_E: Tensor) -> Tensor:
            r = self.recipe
            if r.expert_gemm == "bf16":
                # the exchange only: the parent's bf16 GEMMs on MX-rounded rows; rows that did not
                # cross the MXFP8 exchange are rounded here, and their output's gradient too
                parent_forward = super().forward
                out = run_on_mx_rounded_rows(
                    x_RD, r, lambda rows: parent_forward(rows, num_tokens_per_expert_E), dtype=torch.bfloat16
                )
                return out if isinstance(x_RD, MXTensor) else out.type_as(x_RD)
            if not isinstance(x_RD, MXTensor):  # the parent's own forward, with the MX `_grouped_mm`
                return super().forward(x_RD, num_tokens_per_expert_E)
            # MXFP8 rows from the dispatcher (bf16 origin; only where accepts_mx_rows: torchtitan's
            # SwiGLU forward): the w1 / w3 GEMMs take them as they are; otherwise torchtitan's
            # GroupedExperts.forward, step for step.
            w1, w2, w3 = (_local(w).bfloat16() for w in (self.w1_EFD, self.w2_EDF, self.w3_EFD))
            offs = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
            h = F.silu(self._grouped_mm(A=x_RD, B_t=w1.transpose(-2, -1), offs=offs))
            h = h * self._grouped_mm(A=x_RD, B_t=w3.transpose(-2, -1), offs=offs)
            return self._grouped_mm(A=h, B_t=w2.transpose(-2, -1), offs=offs)

        def expert_rows(self) -> ExpertRows:
            """What these experts take from mxmoe's exchange: MX rows in their recipe."""
            return ExpertRows(self.recipe, as_mx=accepts_mx_rows)

        def parallelize(self, parallel_dims) -> None:
            _refuse_tensor_parallel(self, parallel_dims)
            super().parallelize(parallel_dims)
            weights = ("w1_EFD", "w2_EDF", "w3_EFD")  # the forward reads w.bfloat16()
            _fsdp_mxfp8_all_gather(self, weights, self._mx_config, parallel_dims, torch.bfloat16)

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


def convert_linears(model_config, options: MXOptions, report: ConversionReport, fqns: list[str] = ()):
    """Every plain `Linear.Config` of `model_config` not filtered (`options.filter_fqns`; only those
    matching `fqns` when given) -> `MXLinear.Config`, recorded in `report`. Returns the config."""
    bs = report.recipe.block_size
    for fqn, lin, parent, attr in list(model_config.traverse(Linear.Config)):
        if fqns and not any(f in fqn for f in fqns):
            continue
        if isinstance(lin, MXLinear.Config):  # converted before (a converter applied again)
            reconvert(fqn, lin, options, report)
            continue
        if type(lin) is not Linear.Config:  # subclasses (e.g. TP's scaled-bias rowwise) keep their forward
            continue
        hit = next((f for f in options.filter_fqns if f in fqn), None)
        if hit is not None:
            report.skipped.append((fqn, f"filter_fqns {hit!r}"))
            continue
        if lin.in_features % bs or lin.out_features % bs:
            report.skipped.append((fqn, f"dims {lin.in_features}x{lin.out_features} not divisible by {bs}"))
            continue
        new = MXLinear.Config(
            in_features=lin.in_features,
            out_features=lin.out_features,
            bias=lin.bias,
            param_init=lin.param_init,
            sharding_config=lin.sharding_config,
            **{name: getattr(options, name) for name in MODULE_FIELDS},
        )
        model_config = _replace(model_config, parent, attr, new)
        report.converted["Linear"].append(fqn)
    return model_config


def convert_experts(model_config, options: MXOptions, report: ConversionReport):
    """Every `GroupedExperts.Config` of `model_config` not filtered -> its MX subclass, recorded in
    `report`; the token dispatchers next to them learn whether they take MX rows. Returns the config."""
    bs = report.recipe.block_size
    for fqn, exp, parent, attr in list(model_config.traverse(GroupedExperts.Config)):
        report.experts.append(fqn)
        base_cls = type(exp)._owner
        if base_cls in _mx_experts_cache.values():  # converted before (a converter applied again)
            reconvert(fqn, exp, options, report)
            if hasattr(parent, "token_dispatcher"):
                link_mx_rows(parent)
            continue
        hit = next((f for f in options.filter_fqns if f in fqn), None)
        if hit is not None:
            report.skipped.append((fqn, f"filter_fqns {hit!r}"))
            continue
        if exp.dim % bs or exp.hidden_dim % bs:
            report.skipped.append((fqn, f"dims {exp.dim}x{exp.hidden_dim} not divisible by {bs}"))
            continue
        new_cls = mx_grouped_experts_cls(base_cls).Config
        new = new_cls(
            **{f.name: getattr(exp, f.name) for f in fields(exp)},
            **{name: getattr(options, name) for name in MODULE_FIELDS},
        )
        model_config = _replace(model_config, parent, attr, new)
        if hasattr(parent, "token_dispatcher"):  # parent: the RoutedExperts.Config
            link_mx_rows(parent)
        report.converted["GroupedExperts"].append(fqn)
    return model_config


class MXMoEConverter(ModelConfigConverter):
    """mxmoe in a torchtitan 0.3 model ("mxmoe", also exported as `MXConverter`): MX Linear layers,
    MX experts and mxmoe's exchange for expert parallelism, all from one option set (its Config is
    `mxmoe.MXOptions`); logs one line of what it converted and skipped."""

    @dataclass(kw_only=True, slots=True)
    class Config(ModelConfigConverter.Config, MXOptions):
        pass

    def __init__(self, config: Config):
        self.config = config
        self.options = options_of(config)
        check_kernels(self.options, type(self).__name__)  # a kernel this machine cannot run: now
        check_switches(self.options, type(self).__name__)
        self.recipe = self.options.to_recipe()  # bad options fail now, not at build time

    def convert(self, model_config):
        opts, report = self.options, ConversionReport(self.recipe)
        if opts.convert_linears:
            model_config = convert_linears(model_config, opts, report)
        model_config = convert_dispatchers(model_config, opts, report)
        if opts.convert_grouped_experts:
            model_config = convert_experts(model_config, opts, report)
        finish_conversion(model_config, opts, report, type(self).__name__)
        return model_config


MXConverter = MXMoEConverter
"""The same converter by the other name mxmoe's converter has in every front end ("mx")."""


class MXLinearConverter(QuantizationConverter):
    """Replace matching `Linear.Config` with `MXLinear.Config` (mxmoe MX GEMMs; Hopper and CPU)."""

    @dataclass(kw_only=True, slots=True)
    class Config(QuantizationConverter.Config, MXOptions):
        fqns: list[str] = field(default_factory=list)
        """Include list (as torchtitan's MXFP8LinearConverter): only Linear configs whose FQN
        contains one of these substrings are converted; empty = every Linear not filtered."""

    def __init__(self, config: Config):
        self.config = config
        self.options = options_of(config)
        f = config.fqns
        if isinstance(f, str) or not isinstance(f, (list, tuple)) or not all(isinstance(s, str) for s in f):
            hint = f" (use fqns=[{f!r}])" if isinstance(f, str) else ""
            raise TypeError(f"{type(self).__name__}: fqns must be a list of strings, got {f!r}{hint}")
        check_kernels(self.options, type(self).__name__)  # a kernel this machine cannot run: now
        check_switches(self.options, type(self).__name__, "convert_linears")
        self.recipe = self.options.to_recipe()  # checks the options now, not at build time

    def convert(self, model_config):
        report = ConversionReport(self.recipe, converted={"Linear": []})
        model_config = convert_linears(model_config, self.options, report, self.config.fqns)
        finish_conversion(model_config, self.options, report, type(self).__name__, self.config.fqns)
        return model_config


class MXGroupedExpertsConverter(QuantizationConverter):
    """Replace every `GroupedExperts.Config` (and subclasses with the `_grouped_mm` seam, e.g.
    GPT-OSS's experts) with its MX subclass: the expert grouped GEMMs run on MX operands (or, with
    expert_gemm="bf16", in bf16 on MX-rounded rows), forward and backward. Token groups of any size."""

    @dataclass(kw_only=True, slots=True)
    class Config(QuantizationConverter.Config, MXOptions):
        pass

    def __init__(self, config: Config):
        self.config = config
        self.options = options_of(config)
        check_kernels(self.options, type(self).__name__)  # a kernel this machine cannot run: now
        check_switches(self.options, type(self).__name__, "convert_grouped_experts")
        self.recipe = self.options.to_recipe()

    def convert(self, model_config):
        report = ConversionReport(self.recipe, converted={"GroupedExperts": []})
        model_config = convert_experts(model_config, self.options, report)
        finish_conversion(model_config, self.options, report, type(self).__name__)
        return model_config
