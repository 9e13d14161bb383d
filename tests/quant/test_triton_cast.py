"""The `triton` cast backend against `torch_cast`, bit for bit.

On a machine without a GPU the kernels run under the Triton interpreter (tests/conftest.py sets
TRITON_INTERPRET=1), in software-rounding mode. Tests marked `gpu` run the compiled kernels on a
CUDA device (hardware rounding) against torch_cast on the CPU.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from conftest import assert_same_bits, recipe_for

from mxmoe.formats import make_spec
from mxmoe.quant import to_mx, torch_cast, triton_cast
from mxmoe.quant.backends import triton_interpret

pytestmark = [
    pytest.mark.skipif(
        not (torch.cuda.is_available() or triton_interpret()), reason="needs a GPU or TRITON_INTERPRET=1"
    ),
    # the interpreter runs numpy: Inf results (448 * 2^127, blocks overwritten by NaN) warn
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
]

MODES = ("floor", "rceil", "ceil", "even")
ELEMS = (torch.float8_e4m3fn, torch.float8_e5m2)
DTYPES = (torch.bfloat16, torch.float32)
# compiled kernels on a GPU box, the interpreter elsewhere; references always on the CPU
DEV = "cuda" if torch.cuda.is_available() and not triton_interpret() else "cpu"


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def special_values(dtype: torch.dtype) -> torch.Tensor:
    """Values that stress the rounding: ties at every element binade, 448 * 2^k, max-ish, subnormal
    elements and subnormal inputs, signed zeros. Each row is one 32-element block."""
    rows = []
    # a block with amax 448 (scale 1 in most modes) and element ties / near-ties
    ties = [448.0, 1.0625, 1.1875, -1.0625, 0.5 + 1 / 32, 2.0**-10, 3 * 2.0**-10, -(2.0**-10),
            5 * 2.0**-10, 2.0**-9 * 1.5, 2.0**-7 + 2.0**-11, 464.0, 240.0 + 8, -0.0, 0.0, 2.0**-11,
            7 * 2.0**-10, 13.0, 15.0, 17.0, 0.75 + 1 / 16, 1.0, 2.0**-6 + 2.0**-10, 3.0, 5.0,
            56.0 + 4, 96.0 + 8, 112.0 + 8, 2.0**-8 * 1.25, 2.0**-8 * 1.375, 25.0, -27.0]
    rows.append(ties)
    for k in (-133, -127, -126, -120, -100, -10, 0, 7, 9, 16, 100, 119):
        rows.append([math.ldexp(448.0 * (1 + i / 64) * (-1) ** i, k) for i in range(32)])
        rows.append([math.ldexp(1.0 + i / 16, k) * (1 - 2 * (i % 3 == 0)) for i in range(32)])
    # FLOOR overflow: amax just under 2^(emax+1) after scaling
    rows.append([math.ldexp(511.0, -3)] + [math.ldexp(1.5, i % 7) for i in range(31)])
    rows.append([0.0] * 16 + [-0.0] * 16)
    rows.append([math.ldexp(1.0, -149 + (i % 23)) * (-1) ** i for i in range(32)])  # fp32 subnormals
    rows.append([math.ldexp(1.0, -133 + (i % 7)) * (1 + (i % 4) / 4) for i in range(32)])  # bf16 subn.
    rows.append([math.ldexp(1.0, -126)] * 31 + [math.ldexp(1.0, -140)])
    x = torch.tensor(rows, dtype=torch.float64).to(dtype)
    return x


def random_input(shape, dtype, seed: int = 0, specials: bool = True, lo: int = -150) -> torch.Tensor:
    """Normal samples with a random exponent per 32-element run along the last dim and per row
    (so both cast directions see very different block ranges), plus NaN / Inf / subnormals."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    ex = torch.randint(lo, 60, (*shape[:-1], 1), generator=g).double()
    ey = torch.randint(-20, 20, (*shape[:-2], 1, shape[-1]), generator=g).double() if len(shape) > 1 else 0
    x = x * torch.exp2(ex + ey)
    if specials:
        flat = x.view(-1)
        n = flat.numel()
        idx = torch.randint(0, n, (4,), generator=g)
        flat[idx[0]] = float("nan")
        flat[idx[1]] = float("inf")
        flat[idx[2]] = float("-inf")
        flat[idx[3]] = -0.0
    return x.to(dtype)


def _dim0(x, spec):
    return triton_cast.quantize_dim0(x.to(DEV), spec)


@pytest.mark.parametrize("mode,elem,dtype", list(itertools.product(MODES, ELEMS, DTYPES)))
def test_dim0_special_values(mode, elem, dtype):
    spec = make_spec(32, mode, elem)
    x = special_values(dtype)
    x = torch.cat([x, x * 2.0**-7, -x * 2.0**30 if dtype == torch.float32 else x * 2.0**30])
    want = torch_cast.quantize_dim0(x, spec)
    got = _dim0(x, spec)
    assert_same_bits(got[0], want[0], "q")
    assert_same_bits(got[1], want[1], "scale")


@pytest.mark.parametrize("mode,elem,dtype", list(itertools.product(MODES, ELEMS, DTYPES)))
def test_dim0_random_odd_rows(mode, elem, dtype):
    spec = make_spec(32, mode, elem)
    x = random_input((37, 96), dtype, seed=1)
    for got, want in zip(_dim0(x, spec), torch_cast.quantize_dim0(x, spec), strict=True):
        assert_same_bits(got, want, "dim0")


@pytest.mark.parametrize("mode,elem", list(itertools.product(MODES, ELEMS)))
def test_normal_range_tiles(mode, elem):
    """Tiles whose blocks all have large exponents take the kernels' fast branch (plain multiply)."""
    spec = make_spec(32, mode, elem)
    x = random_input((64, 128), torch.bfloat16, seed=4, lo=-60)
    x[3, :32] = special_values(torch.bfloat16)[0]  # the ties block
    got = (*_dim0(x, spec), *triton_cast.quantize_dim0_dim1(x.to(DEV), spec))
    want = (*torch_cast.quantize_dim0(x, spec), *torch_cast.quantize_dim0_dim1(x, spec))
    for g, w in zip(got, want, strict=True):
        assert_same_bits(g, w, "normal range")


@pytest.mark.parametrize("mode,elem,dtype", list(itertools.product(MODES, ELEMS, DTYPES)))
def test_dim1_3d(mode, elem, dtype):
    spec = make_spec(32, mode, elem)
    x = random_input((2, 96, 40), dtype, seed=2)  # R not a multiple of the row tile, C odd-sized
    for got, want in zip(triton_cast.quantize_dim1(x.to(DEV), spec), torch_cast.quantize_dim1(x, spec),
                         strict=True):
        assert_same_bits(got, want, "dim1")


@pytest.mark.parametrize("mode,elem,dtype", list(itertools.product(MODES, ELEMS, DTYPES)))
def test_dim0_dim1_fused(mode, elem, dtype):
    spec = make_spec(32, mode, elem)
    x = random_input((96, 160), dtype, seed=3)  # neither dim a multiple of the 64 x 64 tile
    got = triton_cast.quantize_dim0_dim1(x.to(DEV), spec)
    want = torch_cast.quantize_dim0_dim1(x, spec)
    for g, w, name in zip(got, want, ("q0", "s0", "q1", "s1"), strict=True):
        assert_same_bits(g, w, name)


@pytest.mark.parametrize("elem", ELEMS)
def test_dim1_special_blocks_transposed(elem):
    """Each special block (ties, subnormals, 448 * 2^k) as a column: blocks along R."""
    spec = make_spec(32, "rceil", elem)
    x = special_values(torch.float32).t().contiguous().unsqueeze(0)  # (1, 32, n_blocks)
    for got, want in zip(triton_cast.quantize_dim1(x.to(DEV), spec), torch_cast.quantize_dim1(x, spec),
                         strict=True):
        assert_same_bits(got, want, "dim1 specials")
    for mode in MODES:
        spec = make_spec(32, mode, elem)
        x2 = torch.cat([x[0], x[0]], dim=0)  # (64, n)
        x2 = torch.cat([x2, x2[:, : -x2.shape[1] % 32]], dim=1).contiguous()  # (64, multiple of 32)
        got = triton_cast.quantize_dim0_dim1(x2.to(DEV), make_spec(32, mode, elem))
        want = torch_cast.quantize_dim0_dim1(x2, spec)
        for g, w in zip(got, want, strict=True):
            assert_same_bits(g, w, f"fused specials {mode}")


@pytest.mark.parametrize("bs", [2, 4, 8, 64, 256])
def test_other_block_sizes(bs):
    spec = make_spec(bs, "rceil", torch.float8_e4m3fn)
    x = random_input((2 * bs if bs > 8 else 24, 2 * bs if bs > 8 else 40), torch.bfloat16, seed=bs)
    for got, want in zip(_dim0(x, spec), torch_cast.quantize_dim0(x, spec), strict=True):
        assert_same_bits(got, want, f"dim0 bs={bs}")
    x3 = x.unsqueeze(0)
    for got, want in zip(triton_cast.quantize_dim1(x3.to(DEV), spec), torch_cast.quantize_dim1(x3, spec),
                         strict=True):
        assert_same_bits(got, want, f"dim1 bs={bs}")
    if x.shape[0] % bs == 0:
        for got, want in zip(triton_cast.quantize_dim0_dim1(x.to(DEV), spec),
                             torch_cast.quantize_dim0_dim1(x, spec),
                             strict=True):
            assert_same_bits(got, want, f"fused bs={bs}")


def test_nonfinite_blocks():
    """A NaN or +-Inf makes the whole block NaN (scale 0xFF, every byte 0x7F), whatever the other
    elements are: zeros, subnormals, normals; in both directions and both element formats."""
    rows = []
    for special in (float("nan"), float("inf"), float("-inf")):
        for fill in ([0.0] * 31, [math.ldexp(1.0 + i / 32, -140) for i in range(31)],
                     [math.ldexp(1.0 + i / 32, i % 9) for i in range(31)]):
            rows.append(fill[:7] + [special] + fill[7:])
    rows += [[1.5] * 32] * (64 - len(rows))  # (64, 32): also a whole dim1 block per column pair
    x = torch.tensor(rows, dtype=torch.float32)
    x = torch.cat([x, x.flip(0)], dim=1).contiguous()  # (64, 64)
    for elem in ELEMS:
        spec = make_spec(32, "rceil", elem)
        xt = x.t().contiguous()  # non-finite blocks along dim1 as well
        for xx in (x, xt):
            got = (*_dim0(xx, spec), *triton_cast.quantize_dim0_dim1(xx.to(DEV), spec),
                   *triton_cast.quantize_dim1(xx.unsqueeze(0).to(DEV), spec))
            want = (*torch_cast.quantize_dim0(xx, spec), *torch_cast.quantize_dim0_dim1(xx, spec),
                    *torch_cast.quantize_dim1(xx.unsqueeze(0), spec))
            for g, w in zip(got, want, strict=True):
                assert_same_bits(g, w, f"non-finite blocks {elem}")
        q, s = _dim0(x, spec)
        assert (s.view(torch.uint8)[:9, 0] == 255).all()
        assert (q.view(torch.uint8)[:9, :32] == 0x7F).all()


def test_casts_agree_partial_tiles():
    spec = make_spec(32, "floor", torch.float8_e4m3fn)
    x = random_input((160, 224), torch.bfloat16, seed=5)
    xd = x.to(DEV)
    got = triton_cast.quantize_dim0_dim1(xd, spec)
    got1 = triton_cast.quantize_dim1(xd.unsqueeze(0), spec)
    got0 = triton_cast.quantize_dim0(xd, spec)
    want = torch_cast.quantize_dim0_dim1(x, spec)
    for g, w in zip((*got, *got0, got1[0][0], got1[1][0]), (*want, want[0], want[1], want[2], want[3]),
                    strict=True):
        assert_same_bits(g, w, "partial tiles")


@pytest.mark.parametrize("elem,out_dtype", list(itertools.product(ELEMS, DTYPES)))
def test_dequantize_every_byte_and_scale(elem, out_dtype):
    """All 256 element bytes against all 256 scale bytes (NaN, Inf, subnormal results)."""
    q = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(elem).repeat(256).view(256, 256)
    s = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat_interleave(8).view(256, 8)
    s = s.view(torch.float8_e8m0fnu)
    want = torch_cast.dequantize(q, s, 32, out_dtype)
    assert_same_bits(triton_cast.dequantize(q.to(DEV), s.to(DEV), 32, out_dtype), want, "dequant, all scales")
    # rows with safe scales only take the fast path
    q2, s2 = q[20:250].contiguous(), s[20:250].contiguous()
    assert_same_bits(triton_cast.dequantize(q2.to(DEV), s2.to(DEV), 32, out_dtype),
                torch_cast.dequantize(q2, s2, 32, out_dtype), "dequant, fast path")


def test_dequantize_roundtrip_odd_shape():
    spec = make_spec(16, "rceil", torch.float8_e4m3fn)
    x = random_input((19, 48), torch.float32, seed=7)
    q, s = triton_cast.quantize_dim0(x.to(DEV), spec)
    for dt in DTYPES:
        got = triton_cast.dequantize(q, s, 16, dt)
        assert_same_bits(got, torch_cast.dequantize(q.cpu(), s.cpu(), 16, dt), "roundtrip")


def test_empty_inputs():
    """Empty tensors never reach a kernel: the public API returns empty storage."""
    mx = to_mx(torch.empty(0, 64, dtype=torch.bfloat16, device=DEV), -1, recipe=recipe_for("triton"))
    assert mx.qdata_blocked.shape == (0, 64) and mx.scale_blocked.shape == (0, 2)
    mx = to_mx(torch.empty(2, 32, 0, dtype=torch.bfloat16, device=DEV), -2, recipe=recipe_for("triton"))
    assert mx.qdata_blocked.shape == (2, 0, 32) and mx.scale_blocked.shape == (2, 0, 1)


# ------------------------------------------------------------------------------------------------
# GPU: compiled kernels (hardware rounding), larger shapes
# ------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("mode,elem,dtype", list(itertools.product(MODES, ELEMS, DTYPES)))
def test_gpu_all_casts(mode, elem, dtype):
    spec = make_spec(32, mode, elem)
    x = torch.cat([random_input((1000, 1088), dtype, seed=11),
                   special_values(dtype).repeat(1, 34)[:, :1088]])[:1024].contiguous()
    xc = x.cuda()
    got0 = triton_cast.quantize_dim0(xc, spec)
    got1 = triton_cast.quantize_dim1(xc.view(2, 512, 1088), spec)
    gotf = triton_cast.quantize_dim0_dim1(xc, spec)
    deq = {dt: triton_cast.dequantize(got0[0], got0[1], 32, dt) for dt in DTYPES}
    want0 = torch_cast.quantize_dim0(x, spec)
    want1 = torch_cast.quantize_dim1(x.view(2, 512, 1088), spec)
    wantf = torch_cast.quantize_dim0_dim1(x, spec)
    for g, w in zip((*got0, *got1, *gotf), (*want0, *want1, *wantf), strict=True):
        assert_same_bits(g, w, f"hw rounding {mode}")
    for dt in DTYPES:
        assert_same_bits(deq[dt], torch_cast.dequantize(want0[0], want0[1], 32, dt), f"dequant {dt}")


@pytest.mark.gpu
def test_gpu_big_shape():
    """A shape with a partial last tile in both dims, 3D expert weights."""
    spec = make_spec(32, "rceil", torch.float8_e4m3fn)
    x = random_input((4, 1056, 544), torch.bfloat16, seed=12)
    xc = x.cuda()
    got1 = triton_cast.quantize_dim1(xc, spec)
    got0 = triton_cast.quantize_dim0(xc.view(-1, 544), spec)
    gotf = triton_cast.quantize_dim0_dim1(xc[0], spec)
    for g, w in zip((*got1, *got0, *gotf),
                    (*torch_cast.quantize_dim1(x, spec), *torch_cast.quantize_dim0(x.view(-1, 544), spec),
                     *torch_cast.quantize_dim0_dim1(x[0].contiguous(), spec)), strict=True):
        assert_same_bits(g, w, "big shape")


@pytest.mark.gpu
def test_gpu_dequantize_every_byte_and_scale():
    for elem, dt in itertools.product(ELEMS, DTYPES):
        q = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(elem).repeat(256).view(256, 256)
        s = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat_interleave(8).view(256, 8)
        s = s.view(torch.float8_e8m0fnu)
        want = torch_cast.dequantize(q, s, 32, dt)
        for rows in (slice(0, 256), slice(20, 250)):
            got = triton_cast.dequantize(q[rows].contiguous().cuda(), s[rows].contiguous().cuda(), 32, dt)
            assert_same_bits(got, want[rows], f"dequant {elem} {dt}")
