"""`MXRecipe`: the one object that says how mxmoe quantizes, read by every layer.

Casts (`mxmoe.quant`), the MXFP8 exchange (`mxmoe.comm`), the MX GEMMs (`mxmoe.ops`), the modules
and converter (`mxmoe.nn`) and the trainer all take an `MXRecipe`; `DEFAULT_RECIPE` is the one
default everywhere (`MXRecipe()` == `recipe("mxfp8_rceil")`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from mxmoe.formats import (
    KERNEL_ELEM_DTYPES,
    MXFormat,
    check_block_size,
    check_scaling_mode,
    format_of,
    get_format,
)

CAST_KERNELS = ("torch", "triton", "cuda")
"""Concrete cast kernels; a recipe may also name "auto" (the fastest available per cast)."""
GEMM_BACKENDS = ("auto", "emulated", "native")
"""GEMMs on MX operands (docs/training-ops.md)."""
REMOVED_GEMM_BACKENDS = {
    "fp8": "the Hopper fp8 GEMM backend was removed: it ran at 0.48-0.69x bf16 forward, slower than "
    "the emulated GEMM (0.82-0.94x); why, and where its measurements are: "
    "the training-ops page of mxmoe's documentation, 'Why there is no fp8 GEMM on Hopper'",
}
"""Backends that are gone, with the reason a config naming one is told."""
GEMM_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
}
"""The emulated GEMM's operand dtype, by its option spelling ("auto": bf16 on CUDA, fp32 elsewhere)."""
EXPERT_GEMMS = ("mx", "bf16")
"""How the routed experts (`MXGroupedExperts`) multiply: MX GEMMs, or in the compute dtype (bf16
under autocast) on MX-rounded rows."""
RENAMED_EXPERT_GEMMS = {"hp": "bf16"}
"""Old expert_gemm spellings, refused with the new one named."""


def check_expert_gemm(value: str, name: str = "expert_gemm") -> None:
    """ValueError naming `name`, `value` and the accepted values unless `value` is in EXPERT_GEMMS."""
    if value in EXPERT_GEMMS:
        return
    new = RENAMED_EXPERT_GEMMS.get(value) if isinstance(value, str) else None
    renamed = f" ({name}={value!r} is now {name}={new!r})" if new else ""
    raise ValueError(
        f"{name}={value!r} is not an expert GEMM mode; expected one of {list(EXPERT_GEMMS)}{renamed}"
    )


def check_gemm_backend(value: str, name: str = "gemm_backend") -> None:
    """ValueError naming `name` and `value` unless `value` is in GEMM_BACKENDS; for a removed
    backend the error says why it went."""
    if value in GEMM_BACKENDS:
        return
    why = REMOVED_GEMM_BACKENDS.get(value) if isinstance(value, str) else None
    expected = f"expected one of {list(GEMM_BACKENDS)}"
    raise ValueError(f"{name}={value!r}: {why or 'not a GEMM backend'}; {expected}")


@dataclass(frozen=True)
class MXRecipe:
    """How every MX operand is made and multiplied (hashable, immutable; checked on creation)."""

    elem_dtype: torch.dtype = torch.float8_e4m3fn
    """Element format: torch.float8_e4m3fn (MXFP8, default) or torch.float8_e5m2."""
    block_size: int = 32
    """Elements per scale along the reduction axis: a power of two >= 2 (MX uses 32)."""
    scaling_mode: str = "rceil"
    """Block exponent rule: "rceil" (cuBLAS round-up, never saturates; default), "floor" (OCP),
    "ceil", "even"."""
    dim0_kernel: str = "auto"
    """Kernel for casts along the last dim and for dequantizing: "auto" | "torch" | "triton" | "cuda"
    (the only way to pick one; `mxmoe.quant.backends.cast_kernel` resolves it per device)."""
    dim1_kernel: str = "auto"
    """Kernel for every cast producing a dim1 (transposed) result, the fused dim0+dim1 cast
    included: "auto" | "torch" | "triton" | "cuda"."""
    gemm_backend: str = "auto"
    """GEMM on MX operands. "auto" (default): "native" on compute capability 10.x where torch runs
    it, else "emulated" (CPU, sm_90), with one log line saying why. "emulated": dequantize both
    operands exactly and run a high-precision GEMM with fp32 accumulation (sm_90 has no
    block-scaled MMA). "native": torch's block-scaled MXFP8 GEMMs on Blackwell (sm_100; e4m3,
    block 32; an error elsewhere)."""
    gemm_dtype: torch.dtype | None = None
    """Operand dtype of the emulated GEMM. None: bf16 on CUDA, fp32 elsewhere. bf16 holds every
    dequantized e4m3 value exactly unless its block scale byte is < 3 (e5m2: < 10), i.e. blocks
    with amax below ~2^-116; fp32 holds all of them exactly."""
    expert_gemm: str = "mx"
    """The routed experts' grouped GEMMs (`MXGroupedExperts`; other modules ignore it). "mx" (default):
    on MX operands (`gemm_backend`). "bf16": the exchange only (docs/comm.md): the GEMMs run in the
    compute dtype (bf16 under autocast, as `GroupedExperts`) on the experts' input rows rounded to MX
    once, exactly the values the MXFP8 dispatch delivers; under expert parallelism the dispatch
    (forward) and the combine's gradient go in MXFP8, the dispatch's gradient and the combine in
    high precision. For Hopper, whose MX GEMMs are emulated: the exchange's bytes without MX GEMMs."""
    wgrad_with_hp: bool = False
    """torchao's `wgrad_with_hp`: True runs every weight-gradient GEMM (dW = dYᵀ X, per expert for
    the grouped ones) in high precision, on the unquantized operands as the op received them (X in
    the compute dtype of the forward, bf16 under autocast; an MX activation's exact values), while
    the forward and input-gradient GEMMs stay MX. Nothing is cast along the tokens (no dim1 cast of
    X or dY). False (default): every GEMM on MX operands."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "scaling_mode", check_scaling_mode(self.scaling_mode).value)
        # checked before format_of, whose registry lookup takes any key equal to a registered one
        # (32.0 or a numpy int would find the block-32 format and stay in the recipe as they are)
        check_block_size(self.block_size)
        # The format as one value (not a field: it follows elem_dtype, block_size and scaling_mode)
        object.__setattr__(self, "fmt", format_of(self.elem_dtype, self.block_size, self.scaling_mode))
        if self.elem_dtype not in KERNEL_ELEM_DTYPES:  # a registered format the kernels do not know
            for name in ("dim0_kernel", "dim1_kernel"):
                if getattr(self, name) != "torch":
                    raise ValueError(
                        f"{name}={getattr(self, name)!r}: format {self.fmt.name} ({self.elem_dtype}) casts "
                        f"with the torch kernel only; expected {name}='torch'"
                    )
        for name in ("dim0_kernel", "dim1_kernel"):
            value = getattr(self, name)
            if value != "auto" and value not in CAST_KERNELS:
                raise ValueError(
                    f"{name}={value!r} is not a cast kernel; expected 'auto' or one of {list(CAST_KERNELS)}"
                )
        check_gemm_backend(self.gemm_backend)
        if self.gemm_dtype not in GEMM_DTYPES.values():
            raise TypeError(
                f"gemm_dtype={self.gemm_dtype} is not supported; expected None, torch.bfloat16 or "
                "torch.float32"
            )
        check_expert_gemm(self.expert_gemm)
        if not isinstance(self.wgrad_with_hp, bool):
            raise TypeError(f"wgrad_with_hp={self.wgrad_with_hp!r}: expected a bool")

    fmt: MXFormat = field(init=False, repr=False, compare=False)
    """The registered format (`mxmoe.formats.MXFormat`) of elem_dtype, block_size and scaling_mode:
    what the casts, the exchange and the GEMMs read."""

    @classmethod
    def from_format(cls, fmt: MXFormat | str, **changes) -> MXRecipe:
        """The recipe of a registered format (the value or its name), other fields `changes`."""
        f = get_format(fmt) if isinstance(fmt, str) else fmt
        if not isinstance(f, MXFormat):
            raise TypeError(f"fmt must be an MXFormat or a registered name, got {type(fmt).__name__}")
        mode = f.scaling_mode.value
        return cls(elem_dtype=f.elem_dtype, block_size=f.block_size, scaling_mode=mode, **changes)

    def compute_dtype(self, device: torch.device) -> torch.dtype:
        """The emulated GEMM's operand dtype on `device`."""
        if self.gemm_dtype is not None:
            return self.gemm_dtype
        return torch.bfloat16 if device.type == "cuda" else torch.float32

    def replace(self, **changes) -> MXRecipe:
        """A copy with some fields changed (checked again)."""
        return replace(self, **changes)


RECIPES: dict[str, MXRecipe] = {
    "mxfp8_rceil": MXRecipe(scaling_mode="rceil"),
    "mxfp8": MXRecipe(scaling_mode="floor"),
    "mxfp8_rceil_wgrad_with_hp": MXRecipe(scaling_mode="rceil", wgrad_with_hp=True),
    "mxfp8_emulated_rceil": MXRecipe(scaling_mode="rceil", gemm_backend="emulated"),
}
"""Named recipes (torchao's names): "mxfp8_rceil" (RCEIL scales; the default), "mxfp8" (FLOOR
scales, the OCP rule: a block's max can saturate to 448), "mxfp8_rceil_wgrad_with_hp" (RCEIL, the
weight-gradient GEMMs in high precision: `MXRecipe.wgrad_with_hp`) and "mxfp8_emulated_rceil"
(RCEIL, every GEMM on exactly dequantized operands, also on Blackwell)."""
DEFAULT_RECIPE_NAME = "mxfp8_rceil"
DEFAULT_RECIPE = RECIPES[DEFAULT_RECIPE_NAME]
assert DEFAULT_RECIPE == MXRecipe()


def recipe(name: str = DEFAULT_RECIPE_NAME, **changes) -> MXRecipe:
    """The named recipe, with `changes` applied (e.g. `recipe("mxfp8", dim1_kernel="cuda")`)."""
    if not isinstance(name, str) or name not in RECIPES:
        raise ValueError(f"recipe name {name!r} is not an MX recipe; expected one of {list(RECIPES)}")
    return RECIPES[name].replace(**changes) if changes else RECIPES[name]


def recipe_from_options(
    recipe_name: str = DEFAULT_RECIPE_NAME,
    mxfp8_dim1_cast_kernel_choice: str = "auto",
    mxfp8_dim0_cast_kernel_choice: str = "auto",
    gemm_backend: str = "auto",
    gemm_dtype: str = "auto",
    expert_gemm: str = "mx",
    *,
    option_prefix: str = "",
) -> MXRecipe:
    """The one MXRecipe that front-end options describe (strings, as a CLI, a TOML file or torchtitan
    give them; the spellings are torchtitan's). Every front end builds its recipe here: the trainer
    (`--mx.*`), `mxmoe.MXOptions.to_recipe` and the torchtitan adapters.

    recipe_name: a name in RECIPES.
    mxfp8_dim1_cast_kernel_choice / mxfp8_dim0_cast_kernel_choice: the recipe's dim1_kernel /
    dim0_kernel, "auto" | "torch" | "triton" | "cuda".
    gemm_backend: one of GEMM_BACKENDS ("auto" keeps the named recipe's own, e.g. the emulated GEMM of
    "mxfp8_emulated_rceil"). gemm_dtype: a key of GEMM_DTYPES. expert_gemm: one of EXPERT_GEMMS.
    option_prefix: put before each option's name in errors (e.g. "mx." for the trainer's options).
    Raises ValueError naming the option, the value and what is accepted.
    """
    if not isinstance(recipe_name, str) or recipe_name not in RECIPES:
        raise ValueError(
            f"{option_prefix}recipe_name={recipe_name!r} is not an MX recipe; expected one of {list(RECIPES)}"
        )
    for name, value in (
        ("mxfp8_dim1_cast_kernel_choice", mxfp8_dim1_cast_kernel_choice),
        ("mxfp8_dim0_cast_kernel_choice", mxfp8_dim0_cast_kernel_choice),
    ):
        if value != "auto" and value not in CAST_KERNELS:
            raise ValueError(
                f"{option_prefix}{name}={value!r} is not a cast kernel; expected 'auto' or one of "
                f"{list(CAST_KERNELS)}"
            )
    check_gemm_backend(gemm_backend, f"{option_prefix}gemm_backend")
    check_expert_gemm(expert_gemm, f"{option_prefix}expert_gemm")
    if gemm_dtype not in GEMM_DTYPES:
        raise ValueError(
            f"{option_prefix}gemm_dtype={gemm_dtype!r} is not supported; expected one of {list(GEMM_DTYPES)}"
        )
    base = RECIPES[recipe_name]
    return base.replace(
        dim0_kernel=mxfp8_dim0_cast_kernel_choice,
        dim1_kernel=mxfp8_dim1_cast_kernel_choice,
        gemm_backend=base.gemm_backend if gemm_backend == "auto" else gemm_backend,
        gemm_dtype=GEMM_DTYPES[gemm_dtype],
        expert_gemm=expert_gemm,
    )


def as_recipe(recipe: MXRecipe | None, name: str = "recipe") -> MXRecipe:
    """`recipe`, or DEFAULT_RECIPE for None; a TypeError naming the argument for anything else."""
    if recipe is None:
        return DEFAULT_RECIPE
    if not isinstance(recipe, MXRecipe):
        raise TypeError(
            f"{name} must be an mxmoe.MXRecipe (e.g. mxmoe.recipe('mxfp8')) or None, got "
            f"{type(recipe).__name__}"
        )
    return recipe
