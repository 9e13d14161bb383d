"""The MX format: element formats, scale modes, the registered format values and argument checks
(docs/mx-format.md).

Everything here is plain Python; every cast backend reads its constants from this module so the
numerics are defined in exactly one place. A block-scaled format is one frozen value, `MXFormat`,
registered by name in `FORMATS`: the recipe holds it (`MXRecipe.fmt`), an `MXTensor` carries it,
custom ops take it by its registered name, and the exchange and the GEMMs read it. A new format is
one `register_format` call (and, for a new element type, its `ElemFormat`) plus whatever kernels
it needs: the `torch` cast backend and the emulated GEMM read everything from the value.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import StrEnum

import torch

E8M0_BIAS = 127
E8M0_NAN = 0xFF
SCALE_DTYPE = torch.float8_e8m0fnu
"""The scale dtype of every MX format: E8M0, a biased power-of-two exponent per block."""


class ScalingMode(StrEnum):
    """How a block's shared exponent is chosen from its amax (docs/mx-format.md)."""

    FLOOR = "floor"
    RCEIL = "rceil"
    CEIL = "ceil"
    EVEN = "even"


@dataclass(frozen=True)
class ElemFormat:
    """An MX element format."""

    dtype: torch.dtype
    max_normal: float  # largest finite magnitude
    emax: int  # exponent of max_normal: floor(log2(max_normal))
    mbits: int  # explicit mantissa bits
    min_normal_exp: int  # exponent of the smallest normal
    nan_byte: int  # canonical NaN bit pattern we write

    @property
    def name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


ELEM_FORMATS: dict[torch.dtype, ElemFormat] = {
    torch.float8_e4m3fn: ElemFormat(torch.float8_e4m3fn, 448.0, 8, 3, -6, 0x7F),
    torch.float8_e5m2: ElemFormat(torch.float8_e5m2, 57344.0, 15, 2, -14, 0x7F),
}

KERNEL_ELEM_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
"""The element dtypes the Triton and CUDA cast kernels are written for; a format registered with
another one casts with the torch kernel only (`MXRecipe` says so)."""

INPUT_DTYPES = (torch.bfloat16, torch.float32)
OUTPUT_DTYPES = (torch.bfloat16, torch.float32)


def f32_bits(x: float) -> int:
    """The IEEE binary32 bit pattern of x rounded to fp32 (round to nearest even, subnormals kept)."""
    return struct.unpack("<I", struct.pack("<f", x))[0]


def f32_from_bits(b: int) -> float:
    return struct.unpack("<f", struct.pack("<I", b))[0]


def _round_f32(x: float) -> float:
    return f32_from_bits(f32_bits(x))


def rceil_constant(fmt: ElemFormat) -> float:
    """fp32(1 / max_normal): the RCEIL descale multiplier, as an fp32 value."""
    return _round_f32(1.0 / fmt.max_normal)


def _rceil_descale(amax_bits: int, c: float) -> float:
    # amax (24 significant bits) * c (24 bits) is exact in float64; struct rounds it to fp32
    # with round-to-nearest-even and keeps subnormals, as IEEE binary32 multiplication does.
    return _round_f32(f32_from_bits(amax_bits) * c)


def rceil_subnormal_thresholds(fmt: ElemFormat) -> tuple[int, int]:
    """fp32 bit patterns (T127, T126) of the largest amax whose RCEIL descale is <= 2^-127 and
    <= 2^-126. Blocks with amax_bits <= T126 have a subnormal (or exactly 2^-126) descale; the
    kernels decide those with integer compares so that no backend depends on how its hardware
    treats fp32 subnormals. Above T126 the fp32 product is normal and computed directly.
    """
    c = rceil_constant(fmt)
    out = []
    for k in (-127, -126):
        limit = 2.0**k
        lo, hi = 0, 0x7F7FFFFF  # invariant: descale(lo) <= limit < descale(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if _rceil_descale(mid, c) <= limit:
                lo = mid
            else:
                hi = mid
        out.append(lo)
    return out[0], out[1]


@dataclass(frozen=True)
class CastSpec:
    """Everything a cast kernel needs, resolved once from user arguments."""

    block_size: int
    mode: ScalingMode
    elem: ElemFormat

    @property
    def rceil_c(self) -> float:
        return rceil_constant(self.elem)

    @property
    def rceil_t127(self) -> int:
        return _RCEIL_T[self.elem.dtype][0]

    @property
    def rceil_t126(self) -> int:
        return _RCEIL_T[self.elem.dtype][1]


_RCEIL_T = {d: rceil_subnormal_thresholds(f) for d, f in ELEM_FORMATS.items()}


def register_elem_format(elem: ElemFormat) -> ElemFormat:
    """Make `elem` an MX element format (its RCEIL thresholds computed once); idempotent for the
    same value, ValueError for another value of an element dtype registered already."""
    have = ELEM_FORMATS.get(elem.dtype)
    if have is not None and have != elem:
        raise ValueError(f"element dtype {elem.dtype} is registered already as {have}")
    ELEM_FORMATS[elem.dtype] = elem
    _RCEIL_T[elem.dtype] = rceil_subnormal_thresholds(elem)
    return elem


MODE_IDS = {ScalingMode.FLOOR: 0, ScalingMode.RCEIL: 1, ScalingMode.CEIL: 2, ScalingMode.EVEN: 3}


def check_scaling_mode(scaling_mode: str | ScalingMode) -> ScalingMode:
    if isinstance(scaling_mode, ScalingMode):
        return scaling_mode
    if isinstance(scaling_mode, str):
        try:
            return ScalingMode(scaling_mode.lower())
        except ValueError:
            pass
    raise ValueError(
        f"scaling_mode={scaling_mode!r} is not a scale mode; expected one of "
        f"{[m.value for m in ScalingMode]}"
    )


def check_elem_dtype(elem_dtype: torch.dtype) -> ElemFormat:
    if elem_dtype not in ELEM_FORMATS:
        raise TypeError(
            f"elem_dtype={elem_dtype} is not an MX element dtype; expected one of "
            f"{[str(d) for d in ELEM_FORMATS]}"
        )
    return ELEM_FORMATS[elem_dtype]


def check_block_size(block_size: int) -> int:
    if (
        not isinstance(block_size, int)
        or isinstance(block_size, bool)
        or block_size < 2
        or block_size & (block_size - 1)
    ):
        raise ValueError(
            f"block_size={block_size!r} is not supported; expected a power of two >= 2 (MX uses 32)"
        )
    return block_size


def check_input_dtype(name: str, t: torch.Tensor, allowed=INPUT_DTYPES) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in allowed:
        raise TypeError(f"{name} has dtype {t.dtype}; expected one of {[str(d) for d in allowed]}")


def make_spec(block_size: int, scaling_mode: str | ScalingMode, elem_dtype: torch.dtype) -> CastSpec:
    return CastSpec(
        check_block_size(block_size), check_scaling_mode(scaling_mode), check_elem_dtype(elem_dtype)
    )



# --------------------------------------------------------------------------------------------
# The format as one value, registered by name
# --------------------------------------------------------------------------------------------


class _SpecOnce:
    """`MXFormat.spec`: made on first access and kept in the format's __dict__, where later reads find
    it with no call (a non-data descriptor, as functools.cached_property, without the lock that
    torch.compile's dynamo cannot enter on Python 3.11: a graph break in every cast)."""

    def __get__(self, fmt: MXFormat | None, owner: type | None = None):
        if fmt is None:
            return self
        spec = CastSpec(fmt.block_size, fmt.scaling_mode, fmt.elem)
        object.__setattr__(fmt, "spec", spec)  # (a frozen dataclass)
        return spec


@dataclass(frozen=True)
class MXFormat:
    """A block-scaled format: everything the casts, the exchange and the GEMMs read of one, as one
    frozen value registered by `name` (`register_format`; `FORMATS`)."""

    name: str
    """The registered name (what custom ops take), e.g. "mxfp8_e4m3_rceil"."""
    elem_dtype: torch.dtype
    """Element dtype (an `ELEM_FORMATS` key), e.g. torch.float8_e4m3fn."""
    block_size: int
    """Elements per scale along the quantized axis (a power of two >= 2; MX: 32)."""
    scaling_mode: ScalingMode
    """The scale rule: how a block's exponent comes from its amax."""
    scale_dtype: torch.dtype = SCALE_DTYPE
    """Scale dtype (E8M0: the only one the casts write)."""
    elem_bits: int = 8
    """Bits per element."""
    elems_per_byte: int = 1
    """Elements packed per byte of storage (1: unpacked; 2 would be FP4)."""
    per_tensor_scale: bool = False
    """A second, per-tensor fp32 scale on top of the block scales (NVFP4's kind; none shipped)."""

    def __post_init__(self) -> None:
        if not isinstance(self.elem_dtype, torch.dtype) or not self.elem_dtype.is_floating_point:
            raise TypeError(f"MXFormat {self.name}: elem_dtype={self.elem_dtype!r}; expected a float dtype")
        check_block_size(self.block_size)
        object.__setattr__(self, "scaling_mode", check_scaling_mode(self.scaling_mode))
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise ValueError(f"MXFormat name={self.name!r}: expected an identifier (it names custom-op args)")
        unsupported = {
            "scale_dtype": (self.scale_dtype, SCALE_DTYPE),
            "elems_per_byte": (self.elems_per_byte, 1),
            "per_tensor_scale": (self.per_tensor_scale, False),
        }
        for field_name, (value, only) in unsupported.items():
            if value != only:
                raise ValueError(
                    f"MXFormat {self.name}: {field_name}={value!r} has no cast kernel yet; expected {only!r}"
                )
        if self.elem_bits != torch.finfo(self.elem_dtype).bits:
            raise ValueError(
                f"MXFormat {self.name}: elem_bits={self.elem_bits}, but {self.elem_dtype} has "
                f"{torch.finfo(self.elem_dtype).bits}"
            )

    def __hash__(self) -> int:  # by name (unique in the registry): a str hash, kept by Python
        return hash(self.name)

    @property
    def elem(self) -> ElemFormat:
        """The element format's constants."""
        return ELEM_FORMATS[self.elem_dtype]

    spec = _SpecOnce()
    """What a cast kernel takes: one object per format, made on first use and kept (the kernels'
    caches find it by identity); made when the format is registered."""

    @property
    def key(self) -> tuple[torch.dtype, int, ScalingMode]:
        """(elem_dtype, block_size, scaling_mode): what tells registered formats apart."""
        return (self.elem_dtype, self.block_size, self.scaling_mode)


FORMATS: dict[str, MXFormat] = {}
"""The registered formats by name."""
_BY_KEY: dict[tuple, MXFormat] = {}


def register_format(fmt: MXFormat, elem: ElemFormat | None = None) -> MXFormat:
    """Register `fmt` (and `elem`, the constants of a new element dtype, first); returns it.
    Idempotent for the same value; ValueError for a name or (elem_dtype, block_size, scaling_mode)
    taken by another format."""
    if elem is not None:
        register_elem_format(elem)
    if not isinstance(fmt, MXFormat):
        raise TypeError(f"register_format: expected an MXFormat, got {type(fmt).__name__}")
    check_elem_dtype(fmt.elem_dtype)  # its constants (ElemFormat) registered first
    for have in (FORMATS.get(fmt.name), _BY_KEY.get(fmt.key)):
        if have is not None and have != fmt:
            raise ValueError(f"register_format: {fmt} clashes with the registered {have}")
    FORMATS[fmt.name] = _BY_KEY[fmt.key] = fmt
    fmt.spec  # noqa: B018 (made now, not while torch.compile traces a cast)
    return fmt


def get_format(name: str) -> MXFormat:
    """The registered format called `name`, or the one whose fields `format_name` spells so
    (registered now: a cast traced by torch.compile passes its custom ops the name of a format no
    eager call may have made yet); ValueError naming the registered ones otherwise."""
    try:
        return FORMATS[name]
    except (KeyError, TypeError):
        fmt = _format_named(name)
        if fmt is not None:
            return fmt
        raise ValueError(f"format {name!r} is not registered; expected one of {list(FORMATS)}") from None


def _format_named(name) -> MXFormat | None:
    """The format whose fields `format_name` spells as `name` (registered now if it was not), or None
    when `name` is no such name."""
    if not isinstance(name, str):
        return None
    stem, _, block = name.rpartition("_b")
    if not (stem and block.isdigit() and block == str(int(block)) and block != "32"):
        stem, block = name, "32"
    for dtype in ELEM_FORMATS:
        for mode in ScalingMode:
            if stem == format_name(dtype, 32, mode):
                try:
                    fmt = format_of(dtype, int(block), mode)
                except ValueError:  # a block size that is not one
                    return None
                return fmt  # (registered under this name, or under another by register_format)
    return None


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.float8_").removesuffix("fn")


def format_of(elem_dtype: torch.dtype, block_size: int, scaling_mode: str | ScalingMode) -> MXFormat:
    """The registered format with these (checked) fields; one not registered yet is registered
    under the name mx<bits>_<elem>_<mode>[_b<block>] (the block only when it is not 32)."""
    fmt = _BY_KEY.get((elem_dtype, block_size, scaling_mode))  # a registered one: one dict lookup
    if fmt is not None:
        return fmt
    key = (check_elem_dtype(elem_dtype).dtype, check_block_size(block_size), check_scaling_mode(scaling_mode))
    fmt = _BY_KEY.get(key)
    if fmt is None:
        fmt = register_format(MXFormat(format_name(*key), *key, elem_bits=torch.finfo(key[0]).bits))
    return fmt


def format_name(elem_dtype: torch.dtype, block_size: int, scaling_mode: ScalingMode) -> str:
    """The name `format_of` registers a format under: mx<bits>_<elem>_<mode>[_b<block>] (the block
    only when it is not 32), from checked fields, without reading the registry (`get_format` finds
    the format by this name even where it is not registered yet or was registered under another)."""
    block = "" if block_size == 32 else f"_b{block_size}"
    return f"mxfp{torch.finfo(elem_dtype).bits}_{_short(elem_dtype)}_{scaling_mode.value}{block}"


for _elem in ELEM_FORMATS:  # the shipped formats: e4m3 / e5m2 elements, every scale rule, blocks of 32
    for _mode in ScalingMode:
        format_of(_elem, 32, _mode)
DEFAULT_FORMAT = format_of(torch.float8_e4m3fn, 32, ScalingMode.RCEIL)
"""MXFP8 as cuBLAS and torchao make it: e4m3 elements, E8M0 scales per 32, RCEIL ("mxfp8_e4m3_rceil")."""
