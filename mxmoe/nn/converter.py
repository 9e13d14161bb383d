"""`mxmoe.convert(model, MXConfig(...))`: swap a model's Linear and GroupedExperts modules for
their MX versions in place (torchtitan's MX converter, for Hopper).

`MXConfig` keeps torchtitan's option spellings and maps them to one `mxmoe.recipe.MXRecipe`
(`MXConfig().to_recipe() == DEFAULT_RECIPE`); every swapped module gets that recipe, and the
MXFP8 exchange of expert parallelism reads it from the experts. `convert` also accepts an
`MXRecipe` directly.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, field

import torch
from torch import nn

from mxmoe.nn.experts import GroupedExperts
from mxmoe.nn.linear import MXLinear
from mxmoe.nn.mx_experts import MXGroupedExperts
from mxmoe.quant.backends import why_unavailable
from mxmoe.recipe import DEFAULT_RECIPE_NAME, RECIPES, MXRecipe, recipe_from_options

log = logging.getLogger("mxmoe")

@dataclass
class MXConfig:
    """What `convert` swaps and how the swapped modules quantize (one `MXRecipe`, see `to_recipe`)."""

    recipe_name: str = DEFAULT_RECIPE_NAME
    """A name in `mxmoe.RECIPES`: "mxfp8_rceil" (RCEIL scales, cuBLAS round-up, never saturates;
    default) | "mxfp8" (FLOOR scales, OCP; the block max can saturate to 448)."""
    filter_fqns: list[str] = field(default_factory=lambda: ["output", "router"])
    """Modules whose fully qualified name contains any of these substrings stay high precision
    (a list of strings). Default: the output projection (as torchtitan) and the MoE router (its
    routing decisions and tiny out dim E are precision-sensitive)."""
    convert_linears: bool = True
    """Swap nn.Linear for MXLinear."""
    convert_grouped_experts: bool = True
    """Swap mxmoe.nn.GroupedExperts for MXGroupedExperts."""
    mxfp8_dim1_cast_kernel_choice: str = "auto"
    """The recipe's dim1_kernel (casts producing a dim1 result): "auto" | "triton" | "cuda" | "torch"."""
    mxfp8_dim0_cast_kernel_choice: str = "auto"
    """The recipe's dim0_kernel (dim0 casts, dequantize): "auto" | "triton" | "cuda" | "torch"."""
    gemm_backend: str = "auto"
    """GEMM on MX operands: "auto" (default: "native" on Blackwell sm_100 where torch runs it, else
    "emulated") | "emulated" (dequantize exactly, bf16/fp32 GEMM) | "native" (torch's block-scaled
    MXFP8 GEMMs, sm_100 only)."""
    gemm_dtype: str = "auto"
    """The recipe's gemm_dtype: "auto" (bf16 on CUDA, fp32 on CPU) | "bfloat16" | "float32"."""
    expert_gemm: str = "mx"
    """The recipe's expert_gemm: "mx" (MX grouped GEMMs; default) | "hp" (the exchange only: bf16
    grouped GEMMs on rows rounded to MX, MXFP8 dispatch and combine gradient under expert
    parallelism; with convert_linears=False no GEMM is MX)."""

    def __post_init__(self) -> None:
        f = self.filter_fqns
        if isinstance(f, str) or not isinstance(f, (list, tuple)) or not all(isinstance(s, str) for s in f):
            hint = f" (use filter_fqns=[{f!r}])" if isinstance(f, str) else ""
            raise TypeError(f"filter_fqns must be a list of strings, got {f!r}{hint}")

    def to_recipe(self) -> MXRecipe:
        """The one MXRecipe these options describe (`mxmoe.recipe.recipe_from_options`; ValueError
        naming the option that is wrong)."""
        return recipe_from_options(
            self.recipe_name,
            self.mxfp8_dim1_cast_kernel_choice,
            self.mxfp8_dim0_cast_kernel_choice,
            self.gemm_backend,
            self.gemm_dtype,
            self.expert_gemm,
        )


def recipe_name(r: MXRecipe) -> str:
    """A short description of `r`: its name in RECIPES when it is one (with changed kernels listed)."""
    for name, base in RECIPES.items():
        if (base.elem_dtype, base.block_size, base.scaling_mode) == (
            r.elem_dtype,
            r.block_size,
            r.scaling_mode,
        ):
            extra = [
                f"{k}={getattr(r, k)}"
                for k in ("dim0_kernel", "dim1_kernel", "gemm_backend", "gemm_dtype", "expert_gemm")
                if getattr(r, k) != getattr(base, k)
            ]
            return name + (f" ({', '.join(extra)})" if extra else "")
    return repr(r)


@dataclass
class ConversionReport:
    """What one `convert` call did (also kept as `model.mx_conversion`)."""

    recipe: MXRecipe
    converted: dict[str, list[str]] = field(default_factory=lambda: {"Linear": [], "GroupedExperts": []})
    """FQNs swapped for MX modules, by kind."""
    skipped: list[tuple[str, str]] = field(default_factory=list)
    """(FQN, why) of the candidate modules left high precision."""
    reconfigured: list[str] = field(default_factory=list)
    """FQNs already MX with another recipe, now given this one."""

    @property
    def num_converted(self) -> int:
        return sum(len(v) for v in self.converted.values())

    @property
    def is_mx(self) -> bool:
        """True when some module now computes in MX (converted now or before)."""
        return self.num_converted + len(self.reconfigured) > 0

    def summary(self) -> str:
        """One line: what was converted, what was skipped and why."""
        lin, exp = len(self.converted["Linear"]), len(self.converted["GroupedExperts"])
        if self.is_mx:
            head = (
                f"MXFP8 recipe {recipe_name(self.recipe)}: {lin} Linear -> MXLinear, "
                f"{exp} GroupedExperts -> MXGroupedExperts"
            )
            if self.reconfigured:
                head += f", {len(self.reconfigured)} MX modules re-given this recipe"
        else:
            head = "nothing converted, the model stays high precision"
        skipped = ", ".join(f"{fqn} ({why})" for fqn, why in self.skipped) or "none"
        return f"mxmoe.convert: {head}; skipped {len(self.skipped)}: {skipped}"


def _tp_degree(parallel_dims) -> int:
    if parallel_dims is None:
        return 1
    if isinstance(parallel_dims, dict):
        return int(parallel_dims.get("tp", 1) or 1)
    if hasattr(parallel_dims, "tp_enabled") and not hasattr(parallel_dims, "tp"):
        return 2 if parallel_dims.tp_enabled else 1
    if hasattr(parallel_dims, "tp"):
        return int(parallel_dims.tp or 1)
    raise TypeError(
        f"parallel_dims must be None, a dict like {{'dp_shard': 4, 'ep': 2, 'tp': 1}} or an object with "
        f"`tp` / `tp_enabled`; got {type(parallel_dims).__name__}"
    )


def _model_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return torch.device("cuda") if p.device.type == "meta" else p.device
    return torch.device("cpu")


def convert(model: nn.Module, recipe: MXConfig | MXRecipe | None = None, parallel_dims=None) -> nn.Module:
    """Swap matching modules of `model` in place for their MX versions; returns `model`.

    nn.Linear -> MXLinear and GroupedExperts -> MXGroupedExperts (sharing the Parameter objects,
    so state-dict keys and optimizer state are unchanged), all with one recipe
    (`recipe` itself when it is an MXRecipe, `recipe.to_recipe()` for an MXConfig; default DEFAULT_RECIPE),
    except modules whose FQN contains a `filter_fqns` substring and modules with a dim not
    divisible by the block size (both skipped). Modules already MX with another recipe get the new
    one, with a warning. Convert before applying FSDP (`fully_shard`) or torch.compile.

    Logs one line (`ConversionReport.summary`) and keeps the report as `model.mx_conversion`.
    Raises ValueError for an unknown recipe/choice, tensor parallelism (tp > 1), or a cast kernel
    that cannot run on the model's device (meta counts as CUDA).
    """
    if recipe is None:
        recipe = MXConfig()
    if isinstance(recipe, MXRecipe):
        r, filter_fqns, do_lin, do_exp = recipe, MXConfig().filter_fqns, True, True
    elif isinstance(recipe, MXConfig):
        recipe.__post_init__()  # fields may have been changed after construction
        r, filter_fqns = recipe.to_recipe(), list(recipe.filter_fqns)
        do_lin, do_exp = recipe.convert_linears, recipe.convert_grouped_experts
    else:
        raise TypeError(f"recipe must be an MXRecipe or an MXConfig, got {type(recipe).__name__}")
    tp = _tp_degree(parallel_dims)
    if tp > 1:
        raise ValueError(
            f"tensor parallelism with MX is not supported yet (parallel_dims has tp={tp}); "
            "use tp=1 with data/expert parallelism"
        )
    device = _model_device(model)
    for name, kernel in (("dim1_kernel", r.dim1_kernel), ("dim0_kernel", r.dim0_kernel)):
        if kernel != "auto":
            reason = why_unavailable(kernel, device)
            if reason is not None:
                raise ValueError(f"recipe {name}={kernel!r} cannot run for a model on {device}: {reason}")

    report = ConversionReport(r)

    def visit(parent: nn.Module, prefix: str) -> None:
        for child_name, child in list(parent.named_children()):
            fqn = f"{prefix}.{child_name}" if prefix else child_name
            if isinstance(child, (MXLinear, MXGroupedExperts)):
                if child.recipe != r:
                    report.reconfigured.append(fqn)
                    child.recipe = r
                continue
            if isinstance(child, nn.Linear) and do_lin:
                kind, dims = "Linear", (child.in_features, child.out_features)
            elif isinstance(child, GroupedExperts) and do_exp:
                kind, dims = "GroupedExperts", (child.dim, child.hidden_dim)
            else:
                visit(child, fqn)
                continue
            hit = next((f for f in filter_fqns if f in fqn), None)
            if hit is not None:
                report.skipped.append((fqn, f"filter_fqns {hit!r}"))
                continue
            if any(d % r.block_size for d in dims):
                report.skipped.append((fqn, f"dims {dims[0]}x{dims[1]} not divisible by {r.block_size}"))
                continue
            if kind == "Linear":
                new = MXLinear.from_linear(child, r)
            else:
                new = MXGroupedExperts.from_experts(child, r)
            setattr(parent, child_name, new)
            report.converted[kind].append(fqn)

    visit(model, "")
    if report.reconfigured:
        warnings.warn(
            f"mxmoe.convert: {len(report.reconfigured)} modules were already MX with another recipe "
            f"(e.g. {report.reconfigured[0]}); they now use {recipe_name(r)}",
            stacklevel=2,
        )
    model.mx_conversion = report
    log.info("%s", report.summary())
    return model
