"""mxmoe in torchtitan 0.2.x: `--model.converters mxmoe` (or `mx`) with an `[mx]` section.

torchtitan 0.2 converts a model in place after building it on the meta device and before
parallelizing it (`ModelConverter(job_config, parallel_dims).convert(model)`, chosen by name in
`model.converters`). `MXMoEConverter`, registered as "mxmoe" and as "mx" (a name torchtitan 0.2
leaves free: its own torchao converters are "quantize.linear.mx" / "quantize.grouped_mm.mx"):

* swaps `nn.Linear` for `mxmoe.nn.MXLinear` (`mxmoe.convert`: forward, dgrad and wgrad GEMMs on MX
  operands), except modules whose FQN contains a `filter_fqns` substring (default: the output head,
  the MoE router gate and attention: the dense and shared-expert feed-forward layers are MX); a
  `FeedForward` whose w1 and w3 are MX becomes `MXFeedForward` (one cast of x for the two);
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
from torch import nn
from torchtitan.config import manager as _manager
from torchtitan.models.moe.moe import FeedForward, GroupedExperts
from torchtitan.protocols.model_converter import _registry_model_converter_cls, register_model_converter
from torchtitan.tools.logging import logger

import mxmoe
from mxmoe.integrations.torchtitan.common import check_kernels, tensor_parallel_error
from mxmoe.integrations.torchtitan.v0_2.experts import MXFeedForward, MXGroupedExperts
from mxmoe.nn import MXLinear
from mxmoe.nn.converter import asked_options, unconverted_error
from mxmoe.options import MXOptions

MX = MXOptions
"""The `[mx]` section of the job config (`--mx.<option>` on the command line): mxmoe's one option set."""


@dataclass
class JobConfig:
    """What `--job.custom_config_module mxmoe.integrations.torchtitan` adds to torchtitan's JobConfig."""

    mx: MXOptions = field(default_factory=MXOptions)


class MXMoEConverter:
    """torchtitan 0.2 model converter "mxmoe" (also "mx"): MX Linear layers and MX grouped experts,
    one recipe from the `[mx]` section, and mxmoe's exchange for expert parallelism (module
    docstring)."""

    def __init__(self, job_config, parallel_dims):
        # Without custom_config_module (converters registered through --experimental.custom_import)
        # the job config has no [mx] section: the defaults apply.
        self.options: MXOptions = getattr(job_config, "mx", None) or MXOptions()
        if not isinstance(self.options, MXOptions):
            raise TypeError(
                f"model.converters mxmoe: job_config.mx must be an mxmoe.MXOptions (the [mx] section "
                f"--job.custom_config_module mxmoe.integrations.torchtitan adds), got "
                f"{type(self.options).__name__} {self.options!r}"
            )
        tp = int(getattr(parallel_dims, "tp", 1) or 1)
        if tp > 1:
            raise tensor_parallel_error("model.converters mxmoe", tp)
        self.ep = int(getattr(parallel_dims, "ep", 1) or 1)
        # FSDP's shard degree of the dense weights (torchtitan's "fsdp" mesh: dp_shard x cp)
        dp_shard, cp = (int(getattr(parallel_dims, k, 1) or 1) for k in ("dp_shard", "cp"))
        self.fsdp = dp_shard * cp
        self.options.check("mx.")
        if self.options.expert_gemm == "bf16" and not self.options.convert_grouped_experts:
            raise ValueError(  # as mxmoe train: the exchange is the MX experts', so neither would apply
                "mx.expert_gemm='bf16' sets how the converted experts compute, but "
                "mx.convert_grouped_experts=false leaves them unconverted (bf16 GEMMs and a bf16 exchange); "
                "drop one of the two"
            )
        self.recipe = self.options.to_recipe()  # bad options fail here, naming the option
        check_kernels(self.options, "model.converters mxmoe")  # a kernel this machine cannot run, too

    def convert(self, model: nn.Module) -> None:
        """Swap the Linear layers and the experts of `model` in place (on the meta device before
        parallelization, as torchtitan calls it); logs one line of what it did."""
        opts, r = self.options, self.recipe
        mxmoe.convert(model, opts, log_summary=False)
        report = model.mx_conversion
        experts = report.converted["GroupedExperts"]
        for mod in model.modules():  # feed-forward layers whose w1 and w3 are MX: one cast of x for both
            if type(mod) is FeedForward and isinstance(mod.w1, MXLinear) and isinstance(mod.w3, MXLinear):
                mod.__class__ = MXFeedForward
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
        if opts.fsdp_mxfp8_all_gather:
            from mxmoe.nn.fsdp import enable_mxfp8_all_gather

            # under EP the experts become DTensors of the ep mesh first: MXExpertParallel wraps their
            # local tensors then, for FSDP over the rest of the ranks ("efsdp": fsdp / ep), when
            # torchtitan shards them on dim 0 (efsdp x ep <= experts; else on dim 1: as before)
            enable_mxfp8_all_gather(  # the experts' forward casts w.bfloat16() before its MX casts
                model, self.fsdp, skip_experts=self.ep > 1, expert_types=(MXGroupedExperts,),
                expert_cast_dtype=torch.bfloat16,
            )
            efsdp = max(self.fsdp // self.ep, 1)
            for fqn, mod in model.named_modules():
                if self.ep > 1 and isinstance(mod, MXGroupedExperts) and r.expert_gemm == "mx":
                    if efsdp * self.ep <= mod.num_experts:
                        mod._mx_fsdp_gather_world = efsdp
                    else:
                        logger.info("fsdp_mxfp8_all_gather: %s gathers high precision: FSDP shards "
                                    "its experts on dim 1 (efsdp %d x ep %d > %d experts)", fqn, efsdp,
                                    self.ep, mod.num_experts)

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
    if not isinstance(mx, MXOptions):
        return
    converters = list(job_config.model.converters)
    if any(c in NAMES for c in converters):
        return
    if mx.fsdp_mxfp8_all_gather:  # not an error: a TOML shared with bf16 runs may hold it
        logger.warning("mx.fsdp_mxfp8_all_gather=true, but model.converters=%r names no mxmoe converter: "
                       "no weight is MX, every weight gathers as before", converters)
    if mx.allow_unconverted:
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
