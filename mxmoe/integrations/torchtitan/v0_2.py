"""mxmoe in torchtitan 0.2.x: the seed's interface, `--model.converters mxmoe` with an `[mx]` section.

torchtitan 0.2 converts a model in place after building it on the meta device and before
parallelizing it (`ModelConverter(job_config, parallel_dims).convert(model)`, chosen by name in
`model.converters`). `MXMoEConverter`, registered as "mxmoe" (and as "mx", a name torchtitan 0.2
leaves free: its own torchao converters are "quantize.linear.mx" / "quantize.grouped_mm.mx"):

* swaps `nn.Linear` for `mxmoe.nn.MXLinear` (`mxmoe.convert`: forward, dgrad and wgrad GEMMs on MX
  operands), except modules whose FQN contains a `filter_fqns` substring (default: the output head,
  the MoE router gate and attention: the dense and shared-expert feed-forward layers are MX);
* turns torchtitan's `GroupedExperts` into `MXGroupedExperts`: the same module and parameters
  (w1 / w3 (E, hidden, dim), w2 (E, dim, hidden)), its SwiGLU grouped GEMMs run by
  `mxmoe.ops.mx_grouped_mm`, which takes token groups of any size (no padding to 8/16/32).

The options come from torchtitan's job config, extended with `JobConfig` below:

    --job.custom_config_module mxmoe.integrations.torchtitan --model.converters mxmoe \\
        --mx.recipe_name mxfp8_rceil --mx.mxfp8_dim1_cast_kernel_choice triton \\
        --mx.filter_fqns output,router,attention

or the same in TOML (`[job] custom_config_module = "mxmoe.integrations.torchtitan"`, `[model]
converters = ["mxmoe"]`, `[mx] recipe_name = "mxfp8_rceil"`). Importing the module named by
custom_config_module registers the converters, so that one line does both.

Tensor parallelism is refused when the converter is built (a ValueError naming
parallelism.tensor_parallel_degree). Expert parallelism runs with torchtitan's own (bf16)
all-to-all: the MX experts take its padded, expert-sharded token groups as they are.
"""

# No `from __future__ import annotations`: torchtitan merges `JobConfig` into its own with
# dataclasses.make_dataclass and tyro resolves the field types, which string annotations would
# leave unresolvable outside this module.
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torchtitan.models.moe.moe import GroupedExperts
from torchtitan.protocols.model_converter import _registry_model_converter_cls, register_model_converter
from torchtitan.tools.logging import logger

import mxmoe
from mxmoe.integrations.torchtitan.common import tensor_parallel_error
from mxmoe.nn.converter import recipe_name
from mxmoe.ops import mx_grouped_mm, mx_grouped_mm_shared
from mxmoe.options import MXOptions
from mxmoe.recipe import DEFAULT_RECIPE, MXRecipe

MX = MXOptions
"""The `[mx]` section of the job config (`--mx.<option>` on the command line): mxmoe's one option set."""


@dataclass
class JobConfig:
    """What `--job.custom_config_module mxmoe.integrations.torchtitan` adds to torchtitan's JobConfig."""

    mx: MXOptions = field(default_factory=MXOptions)


def _local(t: Tensor) -> Tensor:
    # Expert- / data-parallel shards reach the GEMMs as local tensors (as torchtitan's experts).
    return t.to_local() if isinstance(t, DTensor) else t


class MXGroupedExperts(GroupedExperts):
    """torchtitan 0.2's `GroupedExperts` with its grouped GEMMs on MX operands (`mx_grouped_mm`).

    forward(x (T, dim), num_tokens_per_expert (E,) counts, float or int) -> (T, dim) in x's dtype:
    silu(x @ w1[e].T) * (x @ w3[e].T) @ w2[e].T for the rows of expert e, computed in bf16 as
    torchtitan's `_run_experts_grouped_mm` (x and weights cast to bf16), every GEMM through
    `mx_grouped_mm` (w1 and w3 sharing one cast of x). Rows after the last group (expert
    parallelism's padding) give zeros. Made by `MXMoEConverter` (a class swap: same parameters).
    """

    recipe: MXRecipe = DEFAULT_RECIPE

    def forward(self, x: Tensor, num_tokens_per_expert: Tensor) -> Tensor:
        w1, w2, w3 = (_local(w).bfloat16() for w in (self.w1, self.w2, self.w3))
        offs = torch.cumsum(num_tokens_per_expert, dim=0, dtype=torch.int32)
        xb = x.bfloat16()
        g, u = mx_grouped_mm_shared(xb, (w1.transpose(-2, -1), w3.transpose(-2, -1)), offs, self.recipe)
        out = mx_grouped_mm(F.silu(g) * u, w2.transpose(-2, -1), offs, self.recipe)
        return out.type_as(x)

    def extra_repr(self) -> str:
        c = self.recipe
        return f"num_experts={self.num_experts}, mx={c.elem_dtype}/{c.scaling_mode}/{c.block_size}"


class MXMoEConverter:
    """torchtitan 0.2 model converter "mxmoe": MX Linear layers and MX grouped experts, one recipe
    from the `[mx]` section (module docstring)."""

    def __init__(self, job_config, parallel_dims):
        # Without custom_config_module (converters registered through --experimental.custom_import)
        # the job config has no [mx] section: the defaults apply.
        self.options: MXOptions = getattr(job_config, "mx", None) or MXOptions()
        tp = int(getattr(parallel_dims, "tp", 1) or 1)
        if tp > 1:
            raise tensor_parallel_error("model.converters mxmoe", tp)
        self.convert_options = self.options
        self.recipe = self.options.to_recipe()  # bad options fail here, naming the option

    def convert(self, model: nn.Module) -> None:
        """Swap the Linear layers and the experts of `model` in place (on the meta device before
        parallelization, as torchtitan calls it); logs what it did."""
        mxmoe.convert(model, self.convert_options)
        r, bs = self.recipe, self.recipe.block_size
        converted, skipped = [], []
        for fqn, mod in model.named_modules():
            if type(mod) is not GroupedExperts:  # subclasses (GPT-OSS) have their own forward
                if isinstance(mod, GroupedExperts) and not isinstance(mod, MXGroupedExperts):
                    skipped.append(f"{fqn} ({type(mod).__name__}: not torchtitan's SwiGLU experts)")
                continue
            hit = next((f for f in self.convert_options.filter_fqns if f in fqn), None)
            hidden, dim = mod.w1.shape[1], mod.w1.shape[2]
            if hit is not None:
                skipped.append(f"{fqn} (filter_fqns {hit!r})")
            elif dim % bs or hidden % bs:
                skipped.append(f"{fqn} (dim {dim}, hidden {hidden} not divisible by {bs})")
            else:
                mod.__class__ = MXGroupedExperts  # same module, parameters and hooks
                mod.recipe = r
                converted.append(fqn)
        logger.info(
            "mxmoe: %d GroupedExperts -> MXGroupedExperts (recipe %s); skipped: %s",
            len(converted),
            recipe_name(r),
            ", ".join(skipped) or "none",
        )

    def post_optimizer_hook(self, model: nn.Module | list[nn.Module]) -> None:
        """Nothing to do after an optimizer step (scales are computed per GEMM call)."""


NAMES = ("mxmoe", "mx")
"""The names MXMoEConverter is registered under; "mx" only where torchtitan left it free."""

for _name in NAMES:
    # Registered once per process (torchtitan's registry asserts on a second registration).
    if _registry_model_converter_cls.get(_name) is None:
        register_model_converter(MXMoEConverter, _name)
    elif _name == "mxmoe" and _registry_model_converter_cls[_name].__module__ != __name__:
        raise ImportError(
            f"torchtitan already has a model converter named {_name!r} "
            f"({_registry_model_converter_cls[_name].__module__})"
        )
