"""Input data for the MX cast tests (NumPy only): fp32 arrays made of blocks of special classes.

Every array is float32 (R, C) holding values representable in the input dtype ('float32' or
'bfloat16'), with the classes laid out as blocks of `block_size` consecutive elements along the last
axis (transpose it to test casts along another axis). Classes: normal data with per-block magnitudes
over the whole range, zero blocks and signed zeros, fp32/bf16 subnormals (whole blocks and mixed),
round-to-even ties at the element grid of the block's scale, amax at and next to 448*2^k and
57344*2^k and at powers of two, both ends of the E8M0 range, RCEIL blocks around the subnormal-descale
thresholds, NaN and +-Inf blocks.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from tests.quant import oracle as O

DTYPES = ("float32", "bfloat16")
FMT = {"float32": O.FP32, "bfloat16": O.BF16}
STEP = {"float32": 1, "bfloat16": 1 << 16}  # fp32 bit-pattern distance between neighbours
EXP_RANGE = {"float32": (-149, 127), "bfloat16": (-133, 127)}  # smallest subnormal .. top binade
NAN_BITS = {
    "float32": (0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFFFFFFF, 0x7FBFFFFF),
    "bfloat16": (0x7FC00000, 0xFFC00000, 0x7F810000, 0xFFFF0000),
}
POS_INF = np.float32(np.inf)
_SIGNS = np.array([-1.0, 1.0])


def bits(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float32).view(np.uint32)


def from_bits(b) -> np.ndarray:
    return np.asarray(b, dtype=np.uint32).view(np.float32)


def representable(v: float, dtype: str) -> bool:
    """v is a finite value of the dtype: `O.round_binary` of v is v (written for one float: the data
    builders ask this hundreds of thousands of times)."""
    v = float(v)
    if not math.isfinite(v):
        return False
    if v == 0:
        return True
    p, emin, emax = FMT[dtype]
    a = abs(v)
    q = max(math.frexp(a)[1] - 1, emin) - (p - 1)  # exponent of the unit in the last place
    return math.ldexp(a, -q).is_integer() and a < 2.0 ** (emax + 1)


def next_up(v: float, dtype: str) -> float:
    return float(from_bits(bits(np.float32(v)) + STEP[dtype]))


def next_down(v: float, dtype: str) -> float:
    return float(from_bits(bits(np.float32(v)) - STEP[dtype]))


def round_down(v: float, dtype: str) -> float:
    """Largest value of the dtype <= v (v > 0, finite)."""
    r = float(O.round_binary(np.float64(v), FMT[dtype]))
    return r if r <= v else next_down(r, dtype)


def max_finite(dtype: str) -> float:
    return float(from_bits(0x7F7FFFFF if dtype == "float32" else 0x7F7F0000))


class BlockBuilder:
    """Collects blocks (rows of `bs` fp32 values representable in `dtype`)."""

    def __init__(self, bs: int, dtype: str, rng: np.random.Generator):
        self.bs, self.dtype, self.rng = bs, dtype, rng
        self.blocks: list[np.ndarray] = []

    def rnd(self, v) -> np.ndarray:
        return O.round_binary(np.asarray(v, dtype=np.float64), FMT[self.dtype])

    def signs(self, n) -> np.ndarray:
        # what rng.choice([-1.0, 1.0], n) returns (n: a count or a shape), at half its cost
        return _SIGNS[self.rng.integers(0, 2, n)]

    def add(self, block) -> None:
        b = np.asarray(block, dtype=np.float64)
        assert b.shape == (self.bs,)
        self.blocks.append(b.astype(np.float32))

    def around(self, amax, span=20.0, zeros: float = 0.0) -> None:
        """Per amax (a value, or several: one block each), a block whose largest magnitude is
        exactly amax (random sign and position); the others spread over `span` binades below it
        (a value, or one per block; some flush to the element's subnormals or to zero), a fraction
        `zeros` of them signed zeros. All blocks in one draw: the data sets are built from
        thousands of them."""
        amax = np.atleast_1d(np.asarray(amax, dtype=np.float64))[:, None]
        n, bs, rng = len(amax), self.bs, self.rng
        span = np.broadcast_to(np.asarray(span, dtype=np.float64).reshape(-1, 1), (n, 1))
        v = amax * np.exp2(-rng.uniform(0.0, 1.0, (n, bs)) * span) * rng.uniform(0.5, 1.0, (n, bs))
        v = np.minimum(self.rnd(v), amax) * self.signs((n, bs))
        if zeros:
            z = rng.random((n, bs)) < zeros
            v[z] = np.copysign(0.0, self.signs((n, bs)))[z]
        v[np.arange(n), rng.integers(bs, size=n)] = amax[:, 0] * self.signs(n)
        self.blocks.extend(v.astype(np.float32))

    def around_all(self, amaxes, **kw) -> None:
        keep = [a for a in amaxes if a > 0 and representable(a, self.dtype)]
        if keep:
            self.around(keep, **kw)

    def with_neighbours(self, values) -> list[float]:
        out = []
        for v in values:
            if v > 0 and representable(v, self.dtype):
                out += [next_down(v, self.dtype), v]
                up = next_up(v, self.dtype)
                if representable(up, self.dtype):
                    out.append(up)
        return out

    def pack(self, amax: float, members: list[float]) -> None:
        """Blocks holding `amax` plus as many `members` (|m| <= amax) as fit, random signs."""
        n = self.bs - 1
        for i in range(0, len(members), max(n, 1)):
            chunk = list(members[i : i + n])
            chunk += [0.0] * (n - len(chunk))
            v = np.array([amax, *chunk]) * self.signs(self.bs)
            self.add(self.rng.permutation(v))


@functools.cache
def special_blocks(bs: int, mode: str, elem, dtype: str, level: str = "full", seed: int = 0) -> np.ndarray:
    """All special classes as blocks: float32 (n, bs), read-only. level 'full' sweeps every binade;
    'small' keeps every class but samples the sweeps (for the slow Triton interpreter). Built once
    per process and arguments (a third of a second each; the tests ask for the same ones in many
    shapes)."""
    assert dtype in DTYPES and level in ("full", "small")
    E = O.get_elem(elem)
    rng = np.random.default_rng(seed)
    b = BlockBuilder(bs, dtype, rng)
    kmin, kmax = EXP_RANGE[dtype]
    stride = 1 if level == "full" else 11
    ks = list(range(kmin, kmax + 1, stride)) + [kmax, -127, -126, -125]
    small = level == "small"

    # normal data, per-block magnitudes over 2^-140..2^120 (fp32) / the bf16 range
    lo = -140 if dtype == "float32" else kmin
    n_rand = 16 if small else 96
    k = rng.integers(lo, 121, n_rand)
    b.around(b.rnd(rng.uniform(1, 2, n_rand) * np.exp2(k)), span=rng.uniform(0, 24, n_rand))
    # powers of two, 448*2^k and 57344*2^k, each with its neighbours
    b.around_all(b.with_neighbours([2.0**k for k in ks]))
    b.around_all(b.with_neighbours([m * 2.0**k for m in (448.0, 57344.0) for k in ks]))
    # top of the range (E8M0 clamp end). In CEIL/RCEIL/EVEN an amax >= 1.9375*2^127 (e4m3) or
    # >= 1.875*2^127 (e5m2) rounds to q = 2^emax at e = 128 - emax: it dequantizes to 2^128 = inf
    top = [max_finite(dtype), 2.0**127, 1.5 * 2.0**127, 1.75 * 2.0**127, 1.875 * 2.0**127, 1.9375 * 2.0**127]
    b.around_all(b.with_neighbours(top), span=4)
    b.around_all(b.with_neighbours(top), span=200)
    # bottom: smallest subnormals, largest subnormal, smallest normal
    tiny = 2.0**kmin
    b.around_all(b.with_neighbours([tiny, 2 * tiny, 3 * tiny, 2.0**-126, 2.0**-126 - tiny]), span=30)
    # RCEIL subnormal-descale thresholds of both element formats, and max*2^-127, max*2^-126
    for other in O.ELEMS.values():
        ts = [float(from_bits(t)) for t in O.rceil_thresholds(other)]
        b.around_all(b.with_neighbours([round_down(t, dtype) for t in ts]), span=6)
        b.around_all(b.with_neighbours([other.max * 2.0**k for k in (-128, -127, -126, -125)]), span=6)
    # zero blocks, signed zeros, zeros mixed into normal blocks
    b.add(np.zeros(bs))
    b.add(-np.zeros(bs))
    b.add(np.copysign(0.0, b.signs(bs)))
    b.around(b.rnd(1.3 * np.exp2(rng.integers(-130, 120, 2 if small else 6))), zeros=0.4)
    # fp32/bf16 subnormals: whole blocks (random patterns, all-smallest), mixed with small normals
    mant_bits = 23 if dtype == "float32" else 7
    step = STEP[dtype]
    for _ in range(2 if small else 6):
        pat = rng.integers(1, 1 << mant_bits, bs, dtype=np.uint64).astype(np.uint32) * np.uint32(step)
        b.add(from_bits(pat).astype(np.float64) * b.signs(bs))
    b.add(np.full(bs, tiny) * b.signs(bs))
    b.add(np.full(bs, 2.0**-126 - tiny) * b.signs(bs))
    for _ in range(2 if small else 6):
        v = b.rnd(rng.uniform(1, 2, bs) * np.exp2(rng.integers(kmin + 4, -119, bs).astype(np.float64)))
        b.add(v * b.signs(bs))
    # round-to-even ties (and their neighbours) at the element grid of the block's scale
    g = E.grid
    mids = (g[:-1] + g[1:]) / 2
    tie_amax = [E.max * 2.0**-3, 2.0**-122, 1.4 * 2.0**-100, 1.1 * 2.0**40]
    tie_amax += [float(b.rnd(rng.uniform(1, 2) * 2.0**k)) for k in rng.integers(-120, 110, 2)]
    cap = 4 if small else 24  # tie blocks per amax
    for a in tie_amax:
        a = float(b.rnd(a))
        e = int(O.scale_exponent(np.array([a]), mode, E)[0])
        vals = b.with_neighbours(list(mids * 2.0**e))
        vals = [v for v in vals if v < a]
        rng.shuffle(vals)
        b.pack(a, vals[: cap * max(bs - 1, 1)])
    # NaN and +-Inf blocks
    nans = [float(from_bits(p)) for p in NAN_BITS[dtype]]
    for p in NAN_BITS[dtype]:
        b.around(1.5 * 2.0**10)
        b.blocks[-1][rng.integers(bs)] = from_bits(p)
    for special in (POS_INF, -POS_INF):
        b.around(max_finite(dtype), span=2)
        b.blocks[-1][rng.integers(bs)] = special
        b.add(np.zeros(bs))
        b.blocks[-1][rng.integers(bs)] = special
        pat = rng.integers(1, 1 << mant_bits, bs, dtype=np.uint64).astype(np.uint32) * np.uint32(step)
        b.add(from_bits(pat))
        b.blocks[-1][rng.integers(bs)] = special
    b.add(np.full(bs, np.nan))
    blk = np.full(bs, POS_INF)
    blk[rng.integers(bs)] = nans[1]
    b.add(blk)
    b.add(-np.zeros(bs))
    b.blocks[-1][rng.integers(bs)] = from_bits(NAN_BITS[dtype][2])
    out = np.stack(b.blocks)
    _check_dtype(out, dtype)
    out.setflags(write=False)
    return out


def random_blocks(n: int, bs: int, dtype: str, rng: np.random.Generator, kmin: int = -140, kmax: int = 120):
    """n blocks of normal data, block magnitude 2^k with k uniform in [kmin, kmax]: float32 (n, bs)."""
    k = rng.integers(kmin, kmax + 1, (n, 1)).astype(np.float64)
    spread = rng.uniform(0, 16, (n, 1))
    v = rng.uniform(-2, 2, (n, bs)) * np.exp2(k - rng.uniform(0, 1, (n, bs)) * spread)
    out = O.round_binary(v, FMT[dtype]).astype(np.float32)
    _check_dtype(out, dtype)
    return out


def arrange(blocks: np.ndarray, rows: int, seed: int = 0, dtype: str = "float32", nb: int = 1) -> np.ndarray:
    """Shuffle blocks (n, bs) into a float32 (rows, nb * bs) matrix, nb at least ceil(n / rows),
    padding with random normal blocks."""
    rng = np.random.default_rng(seed + 1)
    n, bs = blocks.shape
    nb = max(nb, math.ceil(n / rows))
    pad = random_blocks(rows * nb - n, bs, dtype, rng)
    allb = np.concatenate([blocks, pad])[rng.permutation(rows * nb)]
    return np.ascontiguousarray(allb.reshape(rows, nb * bs))


def dataset(
    rows: int, bs: int, mode: str, elem, dtype: str, level: str = "full", seed: int = 0, nb: int = 1
) -> np.ndarray:
    """float32 (rows, C): every special class, blocks along the last axis (at least nb per row)."""
    return arrange(special_blocks(bs, mode, elem, dtype, level, seed), rows, seed, dtype, nb)


def _check_dtype(x: np.ndarray, dtype: str) -> None:
    if dtype == "bfloat16":
        assert np.all(bits(x) & 0xFFFF == 0), "value not representable in bfloat16"
