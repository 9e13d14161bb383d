"""Checks of the oracle itself, and of mxmoe.formats' constants and RCEIL thresholds against it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import recipe_for

import mxmoe
from mxmoe import formats as F
from tests.quant import cases as D
from tests.quant import oracle as O
from tests.quant.helpers import ELEMS, MODES, dname, to_torch, ubytes

KERNELS = mxmoe.available_kernels("cpu")


def test_element_grids_from_the_definitions():
    e4, e5 = O.ELEMS["float8_e4m3fn"], O.ELEMS["float8_e5m2"]
    assert (e4.max, e4.emax, e4.emin, e4.min_sub, e4.mbits) == (448.0, 8, -6, 2.0**-9, 3)
    assert (e5.max, e5.emax, e5.emin, e5.min_sub, e5.mbits) == (57344.0, 15, -14, 2.0**-16, 2)
    assert len(e4.grid) == 127 and len(e5.grid) == 124  # +0 and the positive finite values
    assert np.isnan(e4.values[[0x7F, 0xFF]]).all() and np.isfinite(np.delete(e4.values, [0x7F, 0xFF])).all()
    assert e5.values[0x7C] == np.inf and e5.values[0xFC] == -np.inf
    assert np.isnan(e5.values[[0x7D, 0x7E, 0x7F, 0xFD, 0xFE, 0xFF]]).all()
    assert np.signbit(e4.values[0x80]) and e4.values[0x80] == 0


@pytest.mark.parametrize("elem", ELEMS, ids=dname)
def test_formats_constants_match_oracle(elem):
    f, o = F.ELEM_FORMATS[elem], O.get_elem(elem)
    got = (f.max_normal, f.emax, f.mbits, f.min_normal_exp, f.nan_byte)
    assert got == (o.max, o.emax, o.mbits, o.emin, 0x7F)
    assert F.rceil_constant(f) == O.rceil_constant(o)


@pytest.mark.parametrize("elem", ELEMS, ids=dname)
def test_decode_table_matches_torch(elem):
    """The oracle's decoded values agree with torch's float8 -> float64 conversion (a decode, exact)."""
    t = torch.arange(256, dtype=torch.uint8).view(elem).double().numpy()
    assert np.array_equal(t, O.get_elem(elem).values, equal_nan=True)


@pytest.mark.parametrize("elem", ELEMS, ids=dname)
def test_element_rounding_matches_torch_in_range(elem):
    """Cross-check of the grid search against torch's own fp32 -> float8 conversion for |y| <= max
    (midpoints, their fp32 neighbours, random values, subnormals, signed zeros)."""
    E = O.get_elem(elem)
    rng = np.random.default_rng(0)
    mids = ((E.grid[:-1] + E.grid[1:]) / 2).astype(np.float32)
    y = np.concatenate([
        mids, np.nextafter(mids, np.float32(0)), np.nextafter(mids, np.float32(np.inf)),
        E.grid.astype(np.float32), rng.uniform(0, E.max, 4000).astype(np.float32),
        (rng.uniform(0, 1, 1000) * E.min_sub * 4).astype(np.float32),
    ])
    y = np.minimum(y, np.float32(E.max))
    y = np.concatenate([y, -y, np.float32([0.0, -0.0])])
    want = O.round_to_elem(y.astype(np.float64), E) | (np.signbit(y).astype(np.uint8) << 7)
    got = ubytes(torch.from_numpy(y).to(elem))
    assert np.array_equal(got, want)


def test_round_binary_matches_ieee_conversions():
    rng = np.random.default_rng(1)
    v = rng.standard_normal(20000) * np.exp2(rng.integers(-160, 130, 20000))
    v = np.concatenate([v, [2.0**-150, 3 * 2.0**-151, 2.0**-149 * 1.5, 2.0**128 * (1 - 2.0**-25), 2.0**128]])
    with np.errstate(over="ignore"):
        assert np.array_equal(O.round_binary(v, O.FP32), v.astype(np.float32).astype(np.float64))
    f32 = v.astype(np.float32)
    bf = torch.from_numpy(f32).to(torch.bfloat16).float().numpy().astype(np.float64)
    assert np.array_equal(O.round_binary(f32.astype(np.float64), O.BF16), bf)


@pytest.mark.parametrize("elem", ELEMS, ids=dname)
def test_rceil_descale_is_the_ieee_fp32_product(elem):
    """The exact-product-then-round descale equals numpy's IEEE float32 multiply, subnormals kept."""
    rng = np.random.default_rng(2)
    a = rng.integers(0, 0x7F800000, 100000, dtype=np.uint32)
    a[:20000] = rng.integers(0, 0x06000000, 20000, dtype=np.uint32)  # descales in the subnormal range
    a = D.from_bits(a)
    c = np.float32(O.rceil_constant(elem))
    assert np.array_equal(O.rceil_descale(a, elem), (a * c).astype(np.float64))


@pytest.mark.parametrize("elem", ELEMS, ids=dname)
def test_rceil_subnormal_thresholds(elem):
    """mxmoe.formats.rceil_subnormal_thresholds == the oracle's closed form, and the documented
    exponents hold at T127, T127+1, T126, T126+1 (and the descale limits at those amax)."""
    t127, t126 = F.rceil_subnormal_thresholds(F.ELEM_FORMATS[elem])
    assert (t127, t126) == O.rceil_thresholds(elem)
    amax = D.from_bits(np.array([t127 - 1, t127, t127 + 1, t126 - 1, t126, t126 + 1], dtype=np.uint32))
    d = O.rceil_descale(amax, elem)
    assert d[1] <= 2.0**-127 < d[2] and d[4] <= 2.0**-126 < d[5]
    e = O.scale_exponent(amax.astype(np.float64), "rceil", elem)
    assert e.tolist() == [-127, -127, -126, -126, -126, -125]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("elem", ELEMS, ids=dname)
def test_rceil_thresholds_in_kernels(kernel, elem):
    """Blocks whose amax is T127, T126, their neighbours and max*2^-127 / max*2^-126 get the
    documented RCEIL scale bytes in every kernel."""
    t127, t126 = O.rceil_thresholds(elem)
    mx_ = O.get_elem(elem).max
    amax = np.concatenate([
        D.from_bits(np.array([t127 - 1, t127, t127 + 1, t126 - 1, t126, t126 + 1], dtype=np.uint32)),
        np.float32([mx_ * 2.0**-127, mx_ * 2.0**-126, mx_ * 2.0**-125]),
    ])
    x = np.zeros((1, 32 * len(amax)), dtype=np.float32)
    x[0, ::32] = amax
    x[0, 5::32] = -amax / 3
    r = recipe_for(kernel, scaling_mode="rceil", elem_dtype=elem)
    mx = mxmoe.to_mx(to_torch(x, torch.float32), recipe=r)
    want = (O.scale_exponent(amax.astype(np.float64), "rceil", elem) + 127).tolist()
    assert want[:6] == [0, 0, 1, 1, 1, 2]
    assert ubytes(mx.scale_blocked)[0].tolist() == want
    assert np.array_equal(ubytes(mx.qdata_blocked), O.oracle_quantize(x, 32, "rceil", elem)[1])


@pytest.mark.parametrize("elem", ELEMS, ids=dname)
@pytest.mark.parametrize("mode", MODES)
def test_scale_exponent_matches_doc_bit_arithmetic(mode, elem):
    """The oracle's log2 definitions agree with the doc's 'as bit arithmetic' column on random fp32
    amax bit patterns (the two columns of the spec table are the same function)."""
    E = O.get_elem(elem)
    rng = np.random.default_rng(3)
    A = np.concatenate([rng.integers(0, 0x7F800000, 50000, dtype=np.int64), [0, 1, 0x7F7FFFFF, 0x00800000]])
    amax = D.from_bits(A.astype(np.uint32)).astype(np.float64)
    Ex, M = A >> 23, A & 0x7FFFFF
    if mode == "floor":
        e = Ex - 127 - E.emax
    elif mode == "ceil":
        e = Ex - 127 + (M != 0) - E.emax
    elif mode == "even":
        e = ((A + (1 << (22 - E.mbits))) >> 23) - 127 - E.emax
    else:
        Dd = D.bits(O.rceil_descale(amax, E).astype(np.float32)).astype(np.int64)
        e = (Dd >> 23) - 127 + ((Dd & 0x7FFFFF) != 0)
        t127, t126 = O.rceil_thresholds(E)
        e = np.where(A <= t126, -126, e)
        e = np.where(A <= t127, -127, e)
    assert np.array_equal(O.scale_exponent(amax, mode, E), np.clip(e, -127, 127))
