"""An independent oracle for the MX casts of docs/mx-format.md: NumPy, float64 and Python ints only.

It imports neither mxmoe nor torch. The element formats are built by decoding every bit pattern from
the format definitions; elements are rounded by searching that value grid (round to nearest, ties to
the even code, i.e. the even mantissa); scale exponents come from floor/ceil of log2 computed exactly
(`np.frexp` of float64 values, which holds every fp32 value exactly) and, for RCEIL, from an IEEE
binary32 product rounded by `round_binary` below (exact float64 product, then one rounding with
gradual underflow).

Arrays in: `x` float32 (R, C), quantized along the last axis in blocks of `block_size`.
Arrays out: scale bytes uint8 (R, C // block_size) (E8M0: 2^(s - 127), 0xFF = NaN) and element bytes
uint8 (R, C) (the raw float8 bit patterns).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

MODES = ("floor", "rceil", "ceil", "even")
SCALE_MIN, SCALE_MAX = -127, 127
FP32 = (24, -126, 127)  # (significant bits, min normal exponent, max exponent)
BF16 = (8, -126, 127)


@dataclass(frozen=True)
class Elem:
    """An element format, built from its bit layout."""

    name: str
    mbits: int
    values: np.ndarray  # float64 (256,): value of each byte (NaN codes -> nan, e5m2 Inf codes -> inf)
    grid: np.ndarray  # float64: non-negative finite values in byte order; grid[i] is byte i
    max: float
    emax: int  # floor(log2(max))
    emin: int  # exponent of the smallest normal
    min_sub: float  # smallest positive (subnormal) value

    @property
    def nan_byte(self) -> int:
        return 0x7F


def _decode(byte: int, ebits: int, mbits: int, bias: int, finite_top: bool) -> float:
    """Value of one float8 bit pattern. finite_top: e4m3fn style (the all-ones exponent holds
    normal numbers except S.1111.111, which is NaN); otherwise IEEE style (Inf and NaNs)."""
    sign = -1.0 if byte >> 7 else 1.0
    exp = (byte >> mbits) & ((1 << ebits) - 1)
    man = byte & ((1 << mbits) - 1)
    top = (1 << ebits) - 1
    if exp == top:
        if finite_top and man == (1 << mbits) - 1:
            return math.nan
        if not finite_top:
            return math.nan if man else sign * math.inf
    if exp == 0:
        v = Fraction(man, 1 << mbits) * Fraction(2) ** (1 - bias)
    else:
        v = (1 + Fraction(man, 1 << mbits)) * Fraction(2) ** (exp - bias)
    return sign * float(v)  # at most 4 significant bits: exact


def _make_elem(name: str, ebits: int, mbits: int, bias: int, finite_top: bool) -> Elem:
    values = np.array([_decode(b, ebits, mbits, bias, finite_top) for b in range(256)], dtype=np.float64)
    pos = values[:128]
    n_finite = int(np.isfinite(pos).sum())
    grid = pos[:n_finite].copy()
    assert np.all(np.isfinite(grid)) and np.all(np.diff(grid) > 0), name  # codes ascend with values
    vmax = float(grid[-1])
    min_normal = float(grid[1 << mbits])  # first code with exponent field 1
    return Elem(
        name=name,
        mbits=mbits,
        values=values,
        grid=grid,
        max=vmax,
        emax=math.frexp(vmax)[1] - 1,
        emin=math.frexp(min_normal)[1] - 1,
        min_sub=float(grid[1]),
    )


ELEMS = {
    "float8_e4m3fn": _make_elem("float8_e4m3fn", 4, 3, 7, finite_top=True),
    "float8_e5m2": _make_elem("float8_e5m2", 5, 2, 15, finite_top=False),
}


def get_elem(elem) -> Elem:
    """An Elem from a name ('float8_e4m3fn', 'float8_e5m2'), a torch dtype or an Elem."""
    if isinstance(elem, Elem):
        return elem
    return ELEMS[str(elem).removeprefix("torch.")]


def round_binary(v, fmt: tuple[int, int, int]) -> np.ndarray:
    """Round float64 values (taken as exact) to a binary format `fmt = (p, emin, emax)`: p significant
    bits, normal exponents emin..emax, gradual underflow, round to nearest with ties to even, overflow
    to +-inf. Returns float64 (every result is exactly representable). NaN/inf pass through."""
    p, emin, emax = fmt
    v = np.asarray(v, dtype=np.float64)
    out = v.copy()
    m = np.isfinite(v) & (v != 0)
    a = np.abs(v[m])
    _, ex = np.frexp(a)  # a = f * 2^ex, f in [0.5, 1): floor(log2 a) = ex - 1
    q = np.maximum(ex - 1, emin) - (p - 1)  # exponent of the unit in the last place
    r = np.ldexp(np.rint(np.ldexp(a, -q)), q)  # np.rint rounds half to even
    r[r >= 2.0 ** (emax + 1)] = np.inf
    out[m] = np.copysign(r, v[m])
    return out


def _fraction_to_f32(fr: Fraction, rounding: str) -> float:
    """A positive rational rounded to fp32 ('nearest': ties to even, or 'down'), normal range."""
    k = fr.numerator.bit_length() - fr.denominator.bit_length()
    if Fraction(2) ** k > fr:
        k -= 1
    ulp = Fraction(2) ** (max(k, -126) - 23)
    n = round(fr / ulp) if rounding == "nearest" else math.floor(fr / ulp)  # round(): ties to even
    return float(n * ulp)


def rceil_constant(elem) -> float:
    """c = fp32(1 / max), the correctly rounded reciprocal (computed from the exact rational)."""
    return _fraction_to_f32(1 / Fraction(get_elem(elem).max), "nearest")


def rceil_descale(amax_f32, elem) -> np.ndarray:
    """fp32(amax * c) as float64: the exact product (48 significant bits fit float64) rounded once
    to binary32 with subnormals kept."""
    a = np.asarray(amax_f32, dtype=np.float32).astype(np.float64)
    return round_binary(a * rceil_constant(elem), FP32)


def rceil_thresholds(elem) -> tuple[int, int]:
    """fp32 bit patterns (T127, T126): the largest fp32 amax whose RCEIL descale is <= 2^-127,
    resp. <= 2^-126. Derived in closed form: the descale quantum below 2^-125 is 2^-149, both limits
    are even multiples of it, so fp32(a*c) <= L  <=>  a*c <= L + 2^-150 (the tie goes down to L)."""
    c = Fraction(rceil_constant(elem))
    out = []
    for k in (-127, -126):
        bound = (Fraction(2) ** k + Fraction(2) ** -150) / c
        t = _fraction_to_f32(bound, "down")
        out.append(int(np.float32(t).view(np.uint32)))
    return out[0], out[1]


def _floor_log2(a: np.ndarray) -> np.ndarray:
    f, ex = np.frexp(a)
    return ex.astype(np.int64) - 1, f


def scale_exponent(amax, mode: str, elem) -> np.ndarray:
    """Unbiased block exponent e (int64, clamped to [-127, 127]) for finite amax values (fp32 values
    as float64, >= 0), from the mathematical definitions of docs/mx-format.md."""
    E = get_elem(elem)
    amax = np.asarray(amax, dtype=np.float64)
    e = np.full(amax.shape, SCALE_MIN - 1000, dtype=np.int64)  # log2(0) = -inf: clamps to -127
    if mode == "rceil":
        d = rceil_descale(amax, E)
        pos = d > 0
        fl, f = _floor_log2(d[pos])
        e[pos] = fl + (f != 0.5)  # ceil(log2 d)
    else:
        pos = amax > 0
        fl, f = _floor_log2(amax[pos])
        if mode == "floor":
            e[pos] = fl - E.emax
        elif mode == "ceil":
            e[pos] = fl + (f != 0.5) - E.emax
        elif mode == "even":
            # significand 2f in [1, 2) rounded to mbits fraction bits, half-way up (exact in float64)
            n = np.floor(f * 2.0 ** (E.mbits + 1) + 0.5)
            e[pos] = fl + (n == 2.0 ** (E.mbits + 1)) - E.emax
        else:
            raise ValueError(f"unknown mode {mode!r}")
    return np.clip(e, SCALE_MIN, SCALE_MAX)


def round_to_elem(y, elem) -> np.ndarray:
    """Codes (uint8, sign bit clear) of |y| rounded to the element grid: nearest, ties to the even
    code. y: float64, |y| <= max (already clamped)."""
    E = get_elem(elem)
    a = np.abs(np.asarray(y, dtype=np.float64))
    assert np.all(a <= E.max)
    g = E.grid
    hi = np.searchsorted(g, a, side="left")  # g[hi] >= a > g[hi - 1]
    lo = np.maximum(hi - 1, 0)
    mid = (g[lo] + g[hi]) / 2  # exact: grid values have <= 4 significant bits
    code = np.where(a < mid, lo, np.where(a > mid, hi, np.where(lo % 2 == 0, lo, hi)))
    code = np.where(g[hi] == a, hi, code)
    return code.astype(np.uint8)


def oracle_quantize(x, block_size: int, mode: str, elem) -> tuple[np.ndarray, np.ndarray]:
    """x: float32 (R, C) -> (scale bytes uint8 (R, C // bs), element bytes uint8 (R, C)); blocks of
    `block_size` consecutive elements along the last axis."""
    E = get_elem(elem)
    x = np.asarray(x)
    assert x.dtype == np.float32 and x.ndim == 2 and x.shape[1] % block_size == 0, (x.dtype, x.shape)
    R, C = x.shape
    with np.errstate(invalid="ignore"):  # signalling NaNs widen quietly
        xb = x.astype(np.float64).reshape(R, C // block_size, block_size)
    finite = np.isfinite(xb)
    nonfinite = ~finite.all(axis=-1)  # the block holds a NaN or +-Inf
    xb = np.where(finite, xb, 0.0)
    amax = np.abs(xb).max(axis=-1)
    e = scale_exponent(amax, mode, E)
    y = xb * np.ldexp(1.0, -e)[..., None]  # exact in float64
    y = np.clip(y, -E.max, E.max)
    codes = round_to_elem(y, E) | (np.signbit(xb).astype(np.uint8) << 7)
    codes[nonfinite] = E.nan_byte
    scale = (e + 127).astype(np.uint8)
    scale[nonfinite] = 0xFF
    return scale, codes.reshape(R, C)


def exact_values(scale_bytes, elem_bytes, block_size: int, elem) -> np.ndarray:
    """The exact dequantized values q * 2^(s - 127) as float64 (every one is representable), shape of
    elem_bytes; NaN for NaN codes or scale 0xFF, +-inf for e5m2 Inf codes."""
    E = get_elem(elem)
    q = E.values[np.asarray(elem_bytes, dtype=np.uint8)]
    s = np.asarray(scale_bytes, dtype=np.uint8)
    R, C = q.shape
    sv = np.where(s == 0xFF, np.nan, np.ldexp(1.0, s.astype(np.int64) - 127))
    return (q.reshape(R, C // block_size, block_size) * sv[..., None]).reshape(R, C)


def oracle_dequantize(scale_bytes, elem_bytes, block_size: int, elem, out_dtype: str) -> np.ndarray:
    """Dequantized values (float64 holding values of `out_dtype`, 'float32' or 'bfloat16'): the exact
    product rounded once (nearest even, subnormals kept, overflow to inf)."""
    fmt = {"float32": FP32, "bfloat16": BF16}[str(out_dtype).removeprefix("torch.")]
    return round_binary(exact_values(scale_bytes, elem_bytes, block_size, elem), fmt)


def value_bits(v, out_dtype: str) -> np.ndarray:
    """Bit patterns of float64 values exactly representable in out_dtype: uint32 for float32, uint16
    for bfloat16 (NaN payloads are not meaningful: compare NaN masks separately)."""
    b = np.asarray(v, dtype=np.float64).astype(np.float32).view(np.uint32)
    if str(out_dtype).removeprefix("torch.") == "bfloat16":
        assert np.all((b & 0xFFFF)[~np.isnan(v)] == 0)
        return (b >> 16).astype(np.uint16)
    return b
