"""The MX format: element formats, scale modes and argument checks (docs/mx-format.md).

Everything here is plain Python; every cast backend reads its constants from this module so the
numerics are defined in exactly one place.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import StrEnum

import torch

E8M0_BIAS = 127
E8M0_NAN = 0xFF


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

