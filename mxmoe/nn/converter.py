"""`mxmoe.convert(model, MXOptions(...))`: swap a model's Linear and GroupedExperts modules for
their MX versions in place (torchtitan's MX converter, for Hopper).

`mxmoe.MXOptions` (the one option set of every front end) says what to convert and names one
`mxmoe.recipe.MXRecipe` (`MXOptions().to_recipe() == DEFAULT_RECIPE`); every swapped module gets
that recipe, and the MXFP8 exchange of expert parallelism reads it from the experts. `convert` also
accepts an `MXRecipe` directly (with the default filter).
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import nn

from mxmoe.nn.experts import GroupedExperts
from mxmoe.nn.linear import MXLinear
from mxmoe.nn.mx_experts import MXGroupedExperts
from mxmoe.options import MXOptions
from mxmoe.quant.backends import why_unavailable
from mxmoe.recipe import RECIPES, MXRecipe

log = logging.getLogger("mxmoe")

def recipe_name(r: MXRecipe) -> str:
    """A short description of `r`: its name in RECIPES when it is one, else the named recipe of its
    format with the fields that differ listed (e.g. "mxfp8_rceil (dim1_kernel=cuda)")."""
    fields = ("dim0_kernel", "dim1_kernel", "gemm_backend", "gemm_dtype", "expert_gemm", "wgrad_with_hp")
    best = None
    for name, base in RECIPES.items():
        fmt = (base.elem_dtype, base.block_size, base.scaling_mode)
        if fmt == (r.elem_dtype, r.block_size, r.scaling_mode):
            extra = [f"{k}={getattr(r, k)}" for k in fields if getattr(r, k) != getattr(base, k)]
            if best is None or len(extra) < len(best[1]):
                best = (name, extra)
    if best is None:
        return repr(r)
    name, extra = best
    return name + (f" ({', '.join(extra)})" if extra else "")


@dataclass
class ConversionReport:
    """What one conversion did (also kept as `model.mx_conversion`); every front end logs it as one
    line, `summary()`: `mxmoe.convert`, the trainer, and the torchtitan adapters."""

    recipe: MXRecipe
    converted: dict[str, list[str]] = field(default_factory=lambda: {"Linear": [], "GroupedExperts": []})
    """FQNs swapped for MX modules, by kind (what was swapped: a key of `MX_NAMES`, or any other)."""
    skipped: list[tuple[str, str]] = field(default_factory=list)
    """(FQN, why) of the candidate modules left high precision."""
    reconfigured: list[str] = field(default_factory=list)
    """FQNs already MX with another recipe, now given this one."""

    MX_NAMES: ClassVar[dict[str, str]] = {"Linear": "MXLinear", "GroupedExperts": "MXGroupedExperts"}
    """What each kind becomes, for `summary` (another kind k reads "k -> MX k")."""

    @property
    def num_converted(self) -> int:
        return sum(len(v) for v in self.converted.values())

    @property
    def is_mx(self) -> bool:
        """True when some module now computes in MX (converted now or before)."""
        return self.num_converted + len(self.reconfigured) > 0

    def summary(self) -> str:
        """One line: what was converted (counts per kind) and what was skipped, grouped by why: a
        reason shared by several modules is counted ("24 by filter_fqns 'attention'"), a module
        skipped for a reason of its own is named ("odd (dims 64x40 not divisible by 32)")."""
        if self.is_mx:
            kinds = ", ".join(
                f"{len(fqns)} {kind} -> {self.MX_NAMES.get(kind, 'MX ' + kind)}"
                for kind, fqns in self.converted.items()
            )
            head = f"MXFP8 recipe {recipe_name(self.recipe)}: {kinds}"
            if self.reconfigured:
                head += f", {len(self.reconfigured)} MX modules re-given this recipe"
        else:
            head = "nothing converted, the model stays high precision"
        by_reason: dict[str, list[str]] = {}
        for fqn, why in self.skipped:
            by_reason.setdefault(why, []).append(fqn)
        skipped = ", ".join(
            f"{fqns[0]} ({why})" if len(fqns) == 1 else f"{len(fqns)} by {why}"
            for why, fqns in by_reason.items()
        )
        return f"mxmoe.convert: {head}; skipped {len(self.skipped)}: {skipped or 'none'}"


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


def convert(
    model: nn.Module,
    recipe: MXOptions | MXRecipe | None = None,
    parallel_dims=None,
    *,
    log_summary: bool = True,
) -> nn.Module:
    """Swap matching modules of `model` in place for their MX versions; returns `model`.

    nn.Linear -> MXLinear and GroupedExperts -> MXGroupedExperts (sharing the Parameter objects,
    so state-dict keys and optimizer state are unchanged), all with one recipe
    (`recipe` itself when it is an MXRecipe, `recipe.to_recipe()` for MXOptions; default DEFAULT_RECIPE),
    except modules whose FQN contains a `filter_fqns` substring and modules with a dim not
    divisible by the block size (both skipped). Modules already MX with another recipe get the new
    one, with a warning. Convert before applying FSDP (`fully_shard`) or torch.compile.

    Logs one line (`ConversionReport.summary`; not with log_summary=False: a front end that converts
    more adds to the report and logs it) and keeps the report as `model.mx_conversion`.
    Raises ValueError for an unknown recipe/choice, tensor parallelism (tp > 1), or a cast kernel
    that cannot run on the model's device (meta counts as CUDA).
    """
    if recipe is None:
        recipe = MXOptions()
    if isinstance(recipe, MXRecipe):
        r, filter_fqns, do_lin, do_exp = recipe, MXOptions().filter_fqns, True, True
    elif isinstance(recipe, MXOptions):
        r, filter_fqns = recipe.to_recipe(), list(recipe.filter_fqns)  # to_recipe checks every field
        do_lin, do_exp = recipe.convert_linears, recipe.convert_grouped_experts
    else:
        raise TypeError(f"recipe must be an MXRecipe or mxmoe.MXOptions, got {type(recipe).__name__}")
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
    if log_summary:
        log.info("%s", report.summary())
    return model
