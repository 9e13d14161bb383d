"""mxmoe in torchtitan 0.2.x: `--model.converters mxmoe` (or `mx`) with an `[mx]` section.

torchtitan 0.2 converts a model in place after building it on the meta device and before
parallelizing it (`ModelConverter(job_config, parallel_dims).convert(model)`, chosen by name in
`model.converters`). `MXMoEConverter`, registered as "mxmoe" and as "mx" (a name torchtitan 0.2
leaves free: its own torchao converters are "quantize.linear.mx" / "quantize.grouped_mm.mx"):

* swaps `nn.Linear` for `mxmoe.nn.MXLinear` (`mxmoe.convert`: forward, dgrad and wgrad GEMMs on MX
  operands), except modules whose FQN contains a `filter_fqns` substring (default: the output head,
  the MoE router gate and attention: the dense and shared-expert feed-forward layers are MX);
* turns torchtitan's `GroupedExperts` into `MXGroupedExperts`: the same module and parameters
  (w1 / w3 (E, hidden, dim), w2 (E, dim, hidden)), its SwiGLU grouped GEMMs on MX operands
  (`mxmoe.ops`), or, with `expert_gemm = "bf16"`, bf16 GEMMs on MX-rounded rows (the exchange only);
  token groups of any size (no padding to 8/16/32);
* with expert parallelism (`--parallelism.expert_parallel_degree N`, N > 1), makes torchtitan's
  parallelize function give these experts mxmoe's exchange (`v0_2.expert_parallel`): MXFP8 rows
  for the dispatch and the combine's gradient (`mxfp8_a2a`, default true; false: bf16 rows), on
  the transport `a2a_transport` names;
* logs one line: what it converted and what it skipped, grouped by why (`ConversionReport.summary`).

The options are `mxmoe.MXOptions`, merged into torchtitan's job config as the `[mx]` section:

    --job.custom_config_module mxmoe.integrations.torchtitan --model.converters mxmoe \\
        --mx.recipe_name mxfp8_rceil --mx.expert_gemm bf16 --mx.no-convert-linears

or the same in TOML (`[job] custom_config_module = "mxmoe.integrations.torchtitan"`, `[model]
converters = ["mxmoe"]`, `[mx] expert_gemm = "bf16"`, `convert_linears = false`). Booleans are
flags on torchtitan's command line (`--mx.no-mxfp8-a2a`: expert parallelism exchanges bf16), and
take a value as in `mxmoe train` too (`--mx.mxfp8_a2a=false`; `v0_2.spellings`).
Importing the module named by custom_config_module registers the converters, so that one line
does both.

Tensor parallelism is refused when the converter is built (a ValueError naming
parallelism.tensor_parallel_degree), and so is a cast kernel this machine cannot run (`triton` on a
CPU without the Triton interpreter: a ValueError naming the option). MX asked and not given is an error unless
`--mx.allow-unconverted`: `--mx.*` options asking for MX (beyond the TOML's `[mx]`, a template
the bf16 runs share) with no mxmoe converter named, when the job config is parsed
(`check_mx_asked`), and a conversion that converts nothing (`ConversionReport.finish`).
"""

# No `from __future__ import annotations`: torchtitan merges `JobConfig` into its own with
# dataclasses.make_dataclass and tyro resolves the field types, which string annotations would
# leave unresolvable outside this module.
import tomllib
from dataclasses import dataclass, field, fields

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torchtitan.config import manager as _manager
from torchtitan.models.moe.moe import GroupedExperts
from torchtitan.protocols.model_converter import _registry_model_converter_cls, register_model_converter
from torchtitan.tools.logging import logger

import mxmoe
from mxmoe.comm.dispatch import ExpertRows, RowsFromAnchor
from mxmoe.integrations.torchtitan.common import check_kernels, tensor_parallel_error
from mxmoe.nn.converter import asked_options, unconverted_error
from mxmoe.nn.experts import grouped_mm
from mxmoe.nn.mx_experts import _RoundGrad, _RoundRows
from mxmoe.ops import mx_grouped_mm, mx_grouped_mm_shared
from mxmoe.options import MXOptions
from mxmoe.quant.mx_tensor import MXTensor
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

    forward(x, num_tokens_per_expert (E,) counts, float or int) -> (T, dim): x is (T, dim) tokens
    grouped by expert (out: x's dtype), or a 2D MXTensor blocked along dim (the MXFP8 exchange's
    rows, bf16 origin; out: bf16). silu(x @ w1[e].T) * (x @ w3[e].T) @ w2[e].T for the rows of
    expert e, computed in bf16 as torchtitan's `_run_experts_grouped_mm` (x and weights cast to
    bf16): every GEMM through `mx_grouped_mm` (w1 and w3 sharing one cast of x); with the recipe's
    `expert_gemm = "bf16"`, bf16 grouped GEMMs on the rows rounded to MX once (an MXTensor's rows
    dequantized: they are rounded already; a tensor's rounded here, and its output's gradient too,
    as the MXFP8 exchange would). Rows after the last group give zeros. Made by `MXMoEConverter`
    (a class swap: same parameters), which also sets `recipe`, `mxfp8_a2a` and `a2a_transport`.
    """

    recipe: MXRecipe = DEFAULT_RECIPE
    mxfp8_a2a: bool = True
    a2a_transport: str = "auto"

    def forward(self, x: Tensor | MXTensor, num_tokens_per_expert: Tensor) -> Tensor:
        w1, w2, w3 = (_local(w).bfloat16().transpose(-2, -1) for w in (self.w1, self.w2, self.w3))
        offs = torch.cumsum(num_tokens_per_expert, dim=0, dtype=torch.int32)
        r = self.recipe
        if r.expert_gemm == "bf16":
            if isinstance(x, MXTensor):
                rows = x.dequantize(torch.bfloat16, recipe=r)  # exact: the rows are MX-rounded
                if x.grad_anchor is not None:  # the exchange sends this gradient back
                    rows = RowsFromAnchor.apply(x.grad_anchor, rows)
                return _swiglu_bf16(rows, w1, w3, w2, offs)
            out = _swiglu_bf16(_RoundRows.apply(x.bfloat16(), r), w1, w3, w2, offs)
            return _RoundGrad.apply(out, r).type_as(x)
        xb = x if isinstance(x, MXTensor) else x.bfloat16()
        g, u = mx_grouped_mm_shared(xb, (w1, w3), offs, r)
        out = mx_grouped_mm(F.silu(g) * u, w2, offs, r)
        return out if isinstance(x, MXTensor) else out.type_as(x)

    def expert_rows(self) -> ExpertRows:
        """What these experts take from mxmoe's exchange: MX rows in their recipe, as an MXTensor."""
        return ExpertRows(self.recipe)

    def extra_repr(self) -> str:
        c = self.recipe
        gemm = ", expert_gemm=bf16" if c.expert_gemm == "bf16" else ""
        return f"num_experts={self.num_experts}, mx={c.elem_dtype}/{c.scaling_mode}/{c.block_size}{gemm}"


def _swiglu_bf16(x: Tensor, w1_t: Tensor, w3_t: Tensor, w2_t: Tensor, offs: Tensor) -> Tensor:
    """torchtitan's SwiGLU experts in bf16: x (T, dim) bf16 grouped by expert, w*_t (E, K, N) bf16."""
    h = F.silu(grouped_mm(x, w1_t, offs)) * grouped_mm(x, w3_t, offs)
    return grouped_mm(h, w2_t, offs)


class MXMoEConverter:
    """torchtitan 0.2 model converter "mxmoe" (also "mx"): MX Linear layers and MX grouped experts,
    one recipe from the `[mx]` section, and mxmoe's exchange for expert parallelism (module
    docstring)."""

    def __init__(self, job_config, parallel_dims):
        # Without custom_config_module (converters registered through --experimental.custom_import)
        # the job config has no [mx] section: the defaults apply.
        self.options: MXOptions = getattr(job_config, "mx", None) or MXOptions()
        tp = int(getattr(parallel_dims, "tp", 1) or 1)
        if tp > 1:
            raise tensor_parallel_error("model.converters mxmoe", tp)
        self.ep = int(getattr(parallel_dims, "ep", 1) or 1)
        self.options.check("mx.")
        self.recipe = self.options.to_recipe()  # bad options fail here, naming the option
        check_kernels(self.options, "model.converters mxmoe")  # a kernel this machine cannot run, too

    def convert(self, model: nn.Module) -> None:
        """Swap the Linear layers and the experts of `model` in place (on the meta device before
        parallelization, as torchtitan calls it); logs one line of what it did."""
        opts, r = self.options, self.recipe
        mxmoe.convert(model, opts, log_summary=False)
        report = model.mx_conversion
        experts = report.converted["GroupedExperts"]
        for fqn, mod in model.named_modules():
            if not isinstance(mod, GroupedExperts):
                continue
            report.experts.append(fqn)
            if isinstance(mod, MXGroupedExperts):  # converted before (a converter applied again)
                (report.already if mod.recipe == r else report.reconfigured).append(fqn)
                mod.recipe, mod.mxfp8_a2a, mod.a2a_transport = r, opts.mxfp8_a2a, opts.a2a_transport
                continue
            hit = next((f for f in opts.filter_fqns if f in fqn), None)
            hidden, dim = mod.w1.shape[1], mod.w1.shape[2]
            if type(mod) is not GroupedExperts:  # subclasses (GPT-OSS) have their own forward
                report.skipped.append((fqn, f"{type(mod).__name__}: not torchtitan's SwiGLU experts"))
            elif not opts.convert_grouped_experts:
                report.skipped.append((fqn, "convert_grouped_experts=false"))
            elif hit is not None:
                report.skipped.append((fqn, f"filter_fqns {hit!r}"))
            elif dim % r.block_size or hidden % r.block_size:
                report.skipped.append((fqn, f"dims {dim}x{hidden} not divisible by {r.block_size}"))
            else:
                mod.__class__ = MXGroupedExperts  # same module, parameters and hooks
                mod.recipe, mod.mxfp8_a2a, mod.a2a_transport = r, opts.mxfp8_a2a, opts.a2a_transport
                experts.append(fqn)
        if self.ep > 1 and experts:
            from mxmoe.integrations.torchtitan.v0_2.expert_parallel import install

            install()
        logger.info("%s", report.summary())
        report.finish(opts)

    def post_optimizer_hook(self, model: nn.Module | list[nn.Module]) -> None:
        """Nothing to do after an optimizer step (scales are computed per GEMM call)."""


NAMES = ("mxmoe", "mx")
"""The names MXMoEConverter is registered under; "mx" only where torchtitan left it free."""


def _toml_mx(path: str) -> MXOptions:
    """The `[mx]` section of the job's TOML file as MXOptions (the defaults without one)."""
    try:
        with open(path, "rb") as f:
            section = tomllib.load(f).get("mx", {})
        names = {fl.name for fl in fields(MXOptions)}
        return MXOptions(**{k: v for k, v in section.items() if k in names})
    except (OSError, tomllib.TOMLDecodeError, TypeError, ValueError, AttributeError):
        return MXOptions()  # torchtitan reports a file it cannot read; a bad value, the converter


def check_mx_asked(job_config) -> None:
    """ValueError when `--mx.*` options ask for MX (`mxmoe.nn.converter.ASKING_OPTIONS` differing
    from the TOML's `[mx]`) while `model.converters` names no mxmoe converter, unless
    `mx.allow_unconverted`: run when torchtitan parses the job config (after its own checks)."""
    mx = getattr(job_config, "mx", None)
    if not isinstance(mx, MXOptions) or mx.allow_unconverted:
        return
    converters = list(job_config.model.converters)
    if any(c in NAMES for c in converters):
        return
    file = job_config.job.config_file
    asked = asked_options(mx, _toml_mx(file) if file else None)
    if asked:
        raise unconverted_error(asked, converters, "--model.converters mxmoe")


if not getattr(_manager.ConfigManager._validate_config, "mxmoe_checks", False):
    _validate_config = _manager.ConfigManager._validate_config

    def _validate_and_check_mx(self) -> None:
        _validate_config(self)
        check_mx_asked(self.config)

    _validate_and_check_mx.mxmoe_checks = True
    _manager.ConfigManager._validate_config = _validate_and_check_mx

for _name in NAMES:
    # Registered once per process (torchtitan's registry asserts on a second registration).
    if _registry_model_converter_cls.get(_name) is None:
        register_model_converter(MXMoEConverter, _name)
    elif _name == "mxmoe" and _registry_model_converter_cls[_name].__module__ != __name__:
        raise ImportError(
            f"torchtitan already has a model converter named {_name!r} "
            f"({_registry_model_converter_cls[_name].__module__})"
        )
