"""Hypothesis property tests of the MX casts: random shapes, block sizes and magnitudes match the
oracle bit for bit, and the round trip stays within the format's error bound for every magnitude.

Error bound of dequant(to_mx(x)) - x for finite x, per element, with f = floor(log2(amax)) of its
block and e the block exponent (derived in the docstring of `round_trip_bound`)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import recipe_for
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mxmoe
from mxmoe.quant import to_mx, to_mx_dim0_dim1
from tests.quant import cases as D
from tests.quant import oracle as O
from tests.quant.helpers import DTYPES, ELEMS, MODES, check_dequant, check_quant, dname, to_torch, ubytes

KERNELS = mxmoe.available_kernels("cpu")
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")


def _settings(kernel: str, device: str, n: int):
    slow = kernel == "triton" and device == "cpu"  # the Triton interpreter: fewer examples
    return settings(
        max_examples=max(4, n // 6) if slow else n,
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


@st.composite
def problems(draw, finite: bool):
    """(x32 float32 (rows, nb*bs) blocks along the last axis, bs, mode, elem, dtype, cast)."""
    bs = draw(st.sampled_from([2, 4, 8, 16, 32, 64]))
    rows = draw(st.integers(1, 6))
    nb = draw(st.integers(1, 5))
    mode = draw(st.sampled_from(MODES))
    elem = draw(st.sampled_from(ELEMS))
    dtype = draw(st.sampled_from(DTYPES))
    cast = draw(st.sampled_from(["dim0", "dim1", "3d-2", "fused"]))
    lo = draw(st.integers(-160, 127))
    hi = draw(st.integers(lo, 127))
    spread = draw(st.floats(0, 40))
    zeros = draw(st.sampled_from([0.0, 0.0, 0.3, 1.0]))
    seed = draw(st.integers(0, 2**32 - 1))
    if cast == "fused":
        rows = bs * draw(st.integers(1, 2))
    rng = np.random.default_rng(seed)
    k = rng.integers(lo, hi + 1, (rows, nb, 1)).astype(np.float64)
    v = rng.uniform(-2, 2, (rows, nb, bs)) * np.exp2(k - rng.uniform(0, 1, (rows, nb, bs)) * spread)
    v[rng.random((rows, nb, bs)) < zeros] = -0.0
    x = O.round_binary(v, D.FMT[dname(dtype)])
    if finite:
        top = D.max_finite(dname(dtype))
        x = np.clip(x, -top, top)
    elif draw(st.booleans()):  # sprinkle non-finite values
        specials = [np.nan, np.inf, -np.inf]
        for _ in range(draw(st.integers(1, 3))):
            x[rng.integers(rows), rng.integers(nb), rng.integers(bs)] = specials[rng.integers(3)]
    return x.astype(np.float32).reshape(rows, nb * bs), bs, mode, elem, dtype, cast


def _quantize(kernel, device, x32, bs, mode, elem, dtype, cast):
    """Quantize per `cast`; returns [(scale_blocked, qdata_blocked, float32 blocks matrix, MXTensor)]."""
    kw = dict(recipe=recipe_for(kernel, scaling_mode=mode, elem_dtype=elem, block_size=bs))
    R, C = x32.shape
    if cast == "dim0":
        mx = to_mx(to_torch(x32, dtype, device), axis=-1, **kw)
        return [(mx.scale_blocked, mx.qdata_blocked, x32, mx)]
    if cast == "dim1":
        mx = to_mx(to_torch(x32.T, dtype, device), axis=0, **kw)
        return [(mx.scale_blocked, mx.qdata_blocked, x32, mx)]
    if cast == "3d-2":
        E = 2 if R % 2 == 0 else 1
        x3 = to_torch(x32.reshape(E, R // E, C).transpose(0, 2, 1), dtype, device)
        mx = to_mx(x3, axis=-2, **kw)
        return [(mx.scale_blocked.reshape(R, -1), mx.qdata_blocked.reshape(R, C), x32, mx)]
    m0, m1 = to_mx_dim0_dim1(to_torch(x32, dtype, device), **kw)
    return [
        (m0.scale_blocked, m0.qdata_blocked, x32, m0),
        (m1.scale_blocked, m1.qdata_blocked, np.ascontiguousarray(x32.T), m1),
    ]


def check_random_problems(kernel: str, device: str, n: int) -> None:
    """n random problems (with non-finite values sometimes) match the oracle, cast and dequantize."""

    @_settings(kernel, device, n)
    @given(problems(finite=False))
    def run(p):
        x32, bs, mode, elem, dtype, cast = p
        for s, q, blocks, mx in _quantize(kernel, device, x32, bs, mode, elem, dtype, cast):
            check_quant(s, q, blocks, bs, mode, elem, f"{cast} {mode} {dname(elem)} {kernel}")
            for out in (torch.float32, torch.bfloat16):
                y = mx.dequantize(out, recipe=recipe_for(kernel)).movedim(mx.axis, -1).reshape(blocks.shape)
                check_dequant(y, ubytes(s), ubytes(q).reshape(blocks.shape), bs, elem, f"dequant {kernel}")

    run()


@pytest.mark.parametrize("kernel", KERNELS)
def test_random_problems_match_oracle(kernel):
    check_random_problems(kernel, "cpu", 150)


def round_trip_bound(amax: np.ndarray, mode: str, elem) -> np.ndarray:
    """Largest |q*2^e - x| over a block with amax (finite, float64) for the given mode.

    Let f = floor(log2 amax) and Y = amax * 2^-e the block's scaled amax, so floor(log2 Y) = f - e.
    An element that does not saturate is off by at most half an element ulp at its own binade, at
    most 2^(max(f - e, emin) - mbits - 1) in scaled units, i.e. 2^(max(f, e + emin) - mbits - 1)
    absolute. For every mode e <= f - emax + 2 < f - emin unless e is clamped at -127, so this is
    max(2^(f - mbits - 1), 2^(-127 + emin - mbits - 1)) (the second: element-subnormal underflow in
    blocks whose exponent clamps at the bottom of E8M0).
    Saturation (|y| > max, clamped to max): CEIL has Y <= 2^emax <= max, none. RCEIL: 2^e >= descale
    = amax*c(1+d), so Y <= max(1 + 2^-22): at most max*2^-22 scaled, far below the half ulp.
    FLOOR: Y < 2^(emax+1), error < (2^(emax+1) - max) scaled = (2 - max/2^emax) * 2^f absolute.
    EVEN: amax not rounded up to the next binade has a significand < 2 - 2^-(mbits+1), so error
    < (2 - 2^-(mbits+1) - max/2^emax) * 2^f.
    """
    E = O.get_elem(elem)
    top = E.max / 2.0**E.emax  # significand of max (1.75 for both formats)
    half_ulp = 2.0 ** -(E.mbits + 1)
    S = {
        "rceil": half_ulp,
        "ceil": half_ulp,
        "floor": max(half_ulp, 2.0 - top),
        "even": max(half_ulp, 2.0 - 2.0 ** -(E.mbits + 1) - top),
    }[mode]
    f = np.where(amax > 0, np.frexp(np.where(amax > 0, amax, 1.0))[1] - 1, -1000)
    return np.maximum(S * np.exp2(f.astype(np.float64)), 2.0 ** (-127 + E.emin - E.mbits - 1))


def check_round_trip(kernel: str, device: str, n: int) -> None:
    """|dequant(to_mx(x)) - x| <= round_trip_bound for finite x of every magnitude (exact values
    from the bytes, so blocks at the top of fp32 are checked too), and dequantize(fp32) returns those
    exact values (inf where they exceed the fp32 range: CEIL/RCEIL/EVEN blocks with amax near
    FLT_MAX round their amax element up to 2^128)."""

    @_settings(kernel, device, n)
    @given(problems(finite=True))
    def run(p):
        x32, bs, mode, elem, dtype, cast = p
        for s, q, blocks, mx in _quantize(kernel, device, x32, bs, mode, elem, dtype, cast):
            sb, qb = ubytes(s), ubytes(q)
            exact = O.exact_values(sb, qb, bs, elem)
            R, C = blocks.shape
            xb = blocks.astype(np.float64)
            amax = np.abs(xb.reshape(R, C // bs, bs)).max(-1)
            bound = np.repeat(round_trip_bound(amax, mode, elem), bs, axis=-1)
            err = np.abs(exact - xb)
            assert np.all(err <= bound), (
                f"{cast} {mode} {dname(elem)}: worst err/bound {np.max(err / bound)} at "
                f"{np.unravel_index(np.argmax(err / bound), err.shape)}"
            )
            y = mx.dequantize(torch.float32, recipe=recipe_for(kernel))
            y = y.movedim(mx.axis, -1).reshape(R, C)
            with np.errstate(over="ignore"):
                assert np.array_equal(y.cpu().numpy().astype(np.float64), O.round_binary(exact, O.FP32))

    run()


@pytest.mark.parametrize("kernel", KERNELS)
def test_round_trip_error_bound(kernel):
    check_round_trip(kernel, "cpu", 150)


def test_round_trip_bound_is_attained_by_floor_saturation():
    """The FLOOR bound is not loose: an amax just under 2^(emax+1) * 2^e saturates by nearly it."""
    for elem in ELEMS:
        E = O.get_elem(elem)
        amax = float(np.nextafter(np.float32(2.0 ** (E.emax + 1)), np.float32(0)))
        x = np.array([[amax, 1.0]], dtype=np.float32)
        s, q = O.oracle_quantize(x, 2, "floor", elem)
        err = abs(O.exact_values(s, q, 2, elem)[0, 0] - amax)
        b = round_trip_bound(np.array([amax]), "floor", elem)[0]
        assert 0.99 * b < err <= b
        assert math.isclose(b, 2.0 ** (E.emax - 2))
