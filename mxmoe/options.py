"""`MXOptions`: the one option set of every front end.

`mxmoe.convert(model, MXOptions(...))`, the trainer's `[mx]` section (`--mx.*`), torchtitan 0.2's
`[mx]` section and torchtitan 0.3's converter configs all read this dataclass: what to convert
(`filter_fqns`, `convert_linears`, `convert_grouped_experts`), how MX operands are made and
multiplied (`recipe_name` and the kernel / GEMM choices, turned into one `mxmoe.MXRecipe` by
`to_recipe`) and the expert-parallel exchange (`mxfp8_a2a`, `a2a_transport`). Field names are
torchtitan's spellings; choices are `Literal` types, so a CLI built from this class (tyro, as
torchtitan's) lists them in `--help` and refuses anything else when it parses.

No `from __future__ import annotations` here: torchtitan 0.2 merges this class into its job config
with `dataclasses.make_dataclass` and tyro resolves the field types, which string annotations would
leave unresolvable outside this module.
"""

import typing
from dataclasses import dataclass, field, fields
from typing import Literal

from mxmoe.recipe import (
    DEFAULT_RECIPE_NAME,
    REMOVED_GEMM_BACKENDS,
    RENAMED_EXPERT_GEMMS,
    MXRecipe,
    recipe_from_options,
)

RecipeName = Literal["mxfp8_rceil", "mxfp8", "mxfp8_rceil_wgrad_with_hp", "mxfp8_emulated_rceil"]
CastKernelChoice = Literal["auto", "torch", "triton", "cuda"]
GemmBackend = Literal["auto", "emulated", "native"]
GemmDtype = Literal["auto", "bfloat16", "float32"]
ExpertGemm = Literal["mx", "bf16"]
A2ATransport = Literal["auto", "nccl", "symm"]

DEFAULT_FILTER_FQNS = ("output", "lm_head", "router", "attention")
"""Modules kept in high precision by default, in every front end: the output head (`output` in
mxmoe's and torchtitan 0.2's models, `lm_head` in torchtitan 0.3's), the MoE router gates and the
attention projections (docs/training-ops.md says why)."""


# keyword-only, so that torchtitan 0.3's config classes (keyword-only) can inherit it
@dataclass(kw_only=True)
class MXOptions:
    """What to convert to MX, how (the recipe), and the expert-parallel exchange: mxmoe's one option
    set, the same in every front end."""

    recipe_name: RecipeName = DEFAULT_RECIPE_NAME
    """torchao's recipe names: mxfp8_rceil (RCEIL scales, never saturate; default) | mxfp8 (FLOOR
    scales, the OCP rule) | mxfp8_rceil_wgrad_with_hp (RCEIL, weight-gradient GEMMs in high
    precision) | mxfp8_emulated_rceil (RCEIL, GEMMs on exactly dequantized operands everywhere)."""
    mxfp8_dim0_cast_kernel_choice: CastKernelChoice = "auto"
    """Kernel of the casts along the last dim and of dequantizing: auto (the fastest available) |
    torch | triton | cuda."""
    mxfp8_dim1_cast_kernel_choice: CastKernelChoice = "auto"
    """Kernel of the casts producing a dim1 (transposed) result: auto | torch | triton | cuda."""
    gemm_backend: GemmBackend = "auto"
    """GEMM on MX operands: auto (native on Blackwell sm_100 where torch runs it, else emulated) |
    emulated (exact dequantize, high-precision GEMM) | native (torch's block-scaled GEMMs, sm_100)."""
    gemm_dtype: GemmDtype = "auto"
    """Operand dtype of the emulated GEMM: auto (bf16 on CUDA, fp32 on CPU) | bfloat16 | float32."""
    filter_fqns: list[str] = field(default_factory=lambda: list(DEFAULT_FILTER_FQNS))
    """Modules whose fully qualified name contains one of these substrings stay high precision
    (entries are stripped of spaces and empty ones dropped: `--mx.filter_fqns=` is no filter in
    every front end)."""
    convert_linears: bool = True
    """Swap nn.Linear layers for MXLinear (MX forward, dgrad and wgrad GEMMs)."""
    convert_grouped_experts: bool = True
    """Swap the routed experts for MX experts (their GEMMs per expert_gemm; the MXFP8 exchange)."""
    expert_gemm: ExpertGemm = "mx"
    """The routed experts' GEMMs: mx (on MX operands) | bf16 (in the compute dtype, bf16 under
    autocast, on the MX-rounded rows the exchange delivers: the exchange-only mode for Hopper)."""
    mxfp8_a2a: bool = True
    """Expert parallelism: send the dispatched rows (and the combine's gradient) as MXFP8; false
    sends them in the compute dtype."""
    a2a_transport: A2ATransport = "auto"
    """Transport of the expert-parallel exchange: auto (symmetric memory between GPUs of one host
    where it runs, else the process group) | nccl (the process group: NCCL, or gloo on CPU) | symm."""
    fsdp_mxfp8_all_gather: bool = False
    """FSDP2 all-gathers each MX linear's and MX experts' weight as MXFP8 (each rank casts its shard:
    1 + 1/32 bytes an element instead of bf16's 2; the GEMMs use it uncast), bit for bit the
    high-precision gather's result; weights whose shards do not hold whole 32-blocks gather as
    before (`mxmoe.nn.fsdp`, docs/training.md)."""
    allow_unconverted: bool = False
    """Train high precision where MX was asked and nothing is MX (no MX converter named, or a
    conversion that converts no module) instead of stopping with an error."""

    def __post_init__(self) -> None:
        self.check()

    def check(self, prefix: str = "") -> None:
        """ValueError / TypeError naming the field (after `prefix`, e.g. "mx."), the value and what is
        accepted (fields may be assigned after construction: the front ends call this before use)."""
        f = self.filter_fqns
        if isinstance(f, str) or not isinstance(f, (list, tuple)) or not all(isinstance(s, str) for s in f):
            hint = f" (use filter_fqns=[{f!r}])" if isinstance(f, str) else ""
            raise TypeError(f"{prefix}filter_fqns must be a list of strings, got {f!r}{hint}")
        if any(s != s.strip() or not s for s in f):
            # an empty entry is no entry (torchtitan 0.2 parses `--mx.filter_fqns=` as [""]), never
            # a substring of every FQN that keeps the whole model high precision; an FQN has no
            # spaces (`--mx.filter_fqns "output, router"` gives " router", which matched nothing)
            self.filter_fqns = [s.strip() for s in f if s.strip()]
        hints = typing.get_type_hints(MXOptions)  # its own fields (a subclass may add others)
        for fl in fields(MXOptions):
            value, tp = getattr(self, fl.name), hints[fl.name]
            if typing.get_origin(tp) is Literal and value not in typing.get_args(tp):
                why = why_not_accepted(fl.name, value, typing.get_args(tp))
                raise ValueError(f"{prefix}{fl.name}={value!r}: {why}")
            if tp is bool and not isinstance(value, bool):
                raise TypeError(f"{prefix}{fl.name}={value!r}: expected a bool")

    def to_recipe(self) -> MXRecipe:
        """The one MXRecipe these options describe (`mxmoe.recipe.recipe_from_options`)."""
        self.check()
        return recipe_from_options(
            self.recipe_name,
            self.mxfp8_dim1_cast_kernel_choice,
            self.mxfp8_dim0_cast_kernel_choice,
            self.gemm_backend,
            self.gemm_dtype,
            self.expert_gemm,
        )


RENAMED_VALUES = {("expert_gemm", old): new for old, new in RENAMED_EXPERT_GEMMS.items()}
"""(option, old value) -> the value that replaced it."""
REMOVED_VALUES = {("gemm_backend", old): why for old, why in REMOVED_GEMM_BACKENDS.items()}
"""(option, removed value) -> why it went."""


def why_not_accepted(name: str, value, accepted: tuple) -> str:
    """What an error says of a value of option `name` that is not in `accepted`."""
    key = (name, value) if isinstance(value, str) else None
    removed, new = REMOVED_VALUES.get(key), RENAMED_VALUES.get(key)
    return (
        (f"{removed}; " if removed else "")
        + f"expected one of {list(accepted)}"
        + (f" ({name}={value!r} is now {name}={new!r})" if new else "")
    )
