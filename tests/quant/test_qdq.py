"""The fused quantize-dequantize (mxmoe.quant.qdq) against the NumPy oracle: every scale mode,
element format, input and output dtype and input class of tests/quant/cases.py, along dim0, dim1
(2D and 3D), both from one read, and both with the dim1 half as the MX cast. On CPU: the torch
backend and the Triton kernel through the interpreter (smaller data); on the GPU (marked gpu): the
Triton kernel against the oracle and against the torch backend at larger shapes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mxmoe.quant.qdq import qdq, qdq_dim0_dim1, qdq_op
from mxmoe.recipe import MXRecipe
from tests.quant import oracle as O
from tests.quant.helpers import (
    COMBOS,
    DTYPES,
    check_dequant,
    check_quant,
    combos,
    data,
    dname,
    level,
    to_torch,
)

BS = 32
KERNELS = ["torch", "triton"]
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")


def combo_id(c) -> str:
    m, e, d = c
    return f"{m}-{dname(e).removeprefix('float8_')}-{dname(d)}"


def recipe(kernel: str, mode: str, elem, bs: int = BS) -> MXRecipe:
    return MXRecipe(scaling_mode=mode, elem_dtype=elem, block_size=bs, dim0_kernel=kernel, dim1_kernel=kernel)


def oracle(x32: np.ndarray, bs: int, mode: str, elem) -> tuple[np.ndarray, np.ndarray]:
    """(scale bytes, element bytes) of the oracle's cast of x32 along its last axis."""
    return O.oracle_quantize(np.ascontiguousarray(x32), bs, mode, dname(elem))


def run_combos(kernel: str):
    return COMBOS if kernel == "torch" else combos(kernel)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("cast", ["dim0", "dim1", "dim1_3d"])
def test_qdq_one_axis_matches_oracle(kernel, cast):
    """qdq(x, axis) == oracle dequantize of the oracle cast, bf16 and fp32 out, every combo; the
    dim1 result is the transposed view of a contiguous (.., C, R) tensor."""
    for mode, elem, dtype in run_combos(kernel):
        g32 = data(33 if cast != "dim1" else 64, BS, mode, elem, dtype, level(kernel))
        ws, wq = oracle(g32, BS, mode, elem)
        if cast == "dim0":
            x = to_torch(g32, dtype)
        elif cast == "dim1":
            x = to_torch(g32.T, dtype)  # (C, 64): blocks along dim -2 are the rows of g32
        else:  # (E=3, N=C, K=11) expert weights along N: g32's rows are (e, k)
            x = to_torch(g32.reshape(3, 11, -1).transpose(0, 2, 1), dtype)
        for out in DTYPES:
            y = qdq(x, -1 if cast == "dim0" else -2, recipe=recipe(kernel, mode, elem), out_dtype=out)
            assert y.dtype == out and y.shape == x.shape
            what = f"qdq {cast} {kernel} {mode} {dname(elem)} {dname(dtype)} -> {dname(out)}"
            if cast == "dim0":
                assert y.is_contiguous()
                check_dequant(y, ws, wq, BS, elem, what)
            else:
                stored = y.transpose(-2, -1)
                assert stored.is_contiguous()
                check_dequant(stored.reshape(g32.shape), ws, wq, BS, elem, what)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("orient", ["rows", "cols"])
def test_qdq_dim0_dim1_matches_oracle(kernel, orient):
    """Both directions from one read, as values, and with the dim1 half as the MX cast (its bytes
    == the oracle's cast along R); orient: along which axis the special blocks lie."""
    for mode, elem, dtype in run_combos(kernel):
        g32 = data(64, BS, mode, elem, dtype, level(kernel))
        x32 = np.ascontiguousarray(g32 if orient == "rows" else g32.T)
        x = to_torch(x32, dtype)
        s0, q0 = oracle(x32, BS, mode, elem)
        s1, q1 = oracle(x32.T, BS, mode, elem)
        r = recipe(kernel, mode, elem)
        for out in DTYPES:
            what = f"qdq dim0+dim1 {kernel} {mode} {dname(elem)} {dname(dtype)} -> {dname(out)}"
            y0, y1 = qdq_dim0_dim1(x, recipe=r, out_dtype=out)
            check_dequant(y0, s0, q0, BS, elem, what + " dim0")
            assert y1.shape == x.shape and y1.t().is_contiguous()
            check_dequant(y1.t(), s1, q1, BS, elem, what + " dim1")
            z0, zq, zs = qdq_dim0_dim1(x, recipe=r, out_dtype=out, dim1_mx=True)
            assert torch.equal(z0.view(torch.uint8), y0.view(torch.uint8))
            check_quant(zs, zq, np.ascontiguousarray(x32.T), BS, mode, elem, what + " mx", want=(s1, q1))


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("bs", [2, 16, 64])
def test_qdq_other_block_sizes_and_odd_rows(kernel, bs):
    """Block sizes other than 32, and dim0 with a row count that is no multiple of anything."""
    for mode, elem, dtype in (
        ("rceil", torch.float8_e4m3fn, torch.bfloat16),
        ("floor", torch.float8_e5m2, torch.float32),
    ):
        g32 = data(2 * bs if bs > 16 else 64, bs, mode, elem, dtype, level(kernel))
        ws, wq = oracle(g32, bs, mode, elem)
        r = recipe(kernel, mode, elem, bs)
        x = to_torch(g32, dtype)
        check_dequant(qdq(x, recipe=r, out_dtype=torch.bfloat16), ws, wq, bs, elem, f"bs={bs} dim0")
        odd = to_torch(g32[:7], dtype)
        y7 = qdq(odd, recipe=r, out_dtype=torch.float32)
        check_dequant(y7, ws[:7], wq[:7], bs, elem, f"bs={bs} 7 rows")
        y1 = qdq(to_torch(g32.T, dtype), -2, recipe=r, out_dtype=torch.bfloat16)
        check_dequant(y1.t(), ws, wq, bs, elem, f"bs={bs} dim1")


def test_qdq_equals_to_mx_dequantize_noncontiguous():
    """Any strides in: qdq of a transposed view == to_mx(...).dequantize() of it, same storage."""
    from mxmoe.quant.mx_tensor import to_mx

    r = recipe("torch", "rceil", torch.float8_e4m3fn)
    torch.manual_seed(0)
    base = torch.randn(64, 96, dtype=torch.bfloat16)
    for x in (base, base.t(), base[:, 32:]):
        for axis in (-1, -2):
            if x.shape[axis] % BS:
                continue
            y = qdq(x, axis, recipe=r, out_dtype=torch.bfloat16)
            ref = to_mx(x, axis, recipe=r).dequantize(torch.bfloat16)
            assert torch.equal(y.view(torch.int16), ref.view(torch.int16))


def test_qdq_errors():
    r = recipe("torch", "rceil", torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"x.shape\[2\]=40 .* block_size=32"):
        qdq(torch.randn(4, 40), recipe=r)
    with pytest.raises(ValueError, match="axis=0"):
        qdq(torch.randn(3, 32, 32), 0, recipe=r)
    with pytest.raises(TypeError, match="x has dtype torch.float16"):
        qdq(torch.randn(4, 32, dtype=torch.float16), recipe=r)
    with pytest.raises(TypeError, match="out_dtype=torch.float16"):
        qdq(torch.randn(4, 32), recipe=r, out_dtype=torch.float16)
    with pytest.raises(TypeError, match="recipe must be an mxmoe.MXRecipe"):
        qdq(torch.randn(4, 32), recipe="mxfp8")
    with pytest.raises(ValueError, match=r"x.shape\[1\]=4 .*block_size=32"):
        qdq_dim0_dim1(torch.randn(4, 32), recipe=r)


def test_qdq_fake_matches_real_and_compiles():
    """The fake implementation promises the real outputs' layout; qdq traces with fullgraph."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    x = torch.randn(2, 64, 96)
    for dim0, dim1 in ((True, 0), (False, 1), (True, 1), (True, 2)):
        args = (32, "rceil", torch.float8_e4m3fn, torch.bfloat16, dim0, dim1, "torch")
        real = [(t.shape, t.stride(), t.dtype) for t in qdq_op(x, *args)]
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fake = [(t.shape, t.stride(), t.dtype) for t in qdq_op(mode.from_tensor(x), *args)]
        assert real == fake, (dim0, dim1)
    r = recipe("torch", "floor", torch.float8_e4m3fn)

    def f(x):
        a, b = qdq_dim0_dim1(x[0], recipe=r, out_dtype=torch.float32)
        return a + b + qdq(x, -2, recipe=r, out_dtype=torch.float32)

    got = torch.compile(f, fullgraph=True, backend="inductor")(x)
    assert torch.equal(got, f(x))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.gpu
@pytest.mark.parametrize("combo", COMBOS, ids=[combo_id(c) for c in COMBOS])
def test_gpu_qdq_triton_matches_oracle_and_torch(combo):
    """On the GPU: the Triton qdq == the oracle on every input class (full level), and == the torch
    backend bit for bit on large random tensors of every shape class (dim0 odd rows, dim1 2D and 3D,
    both, both with the MX dim1)."""
    mode, elem, dtype = combo
    g32 = data(64, BS, mode, elem, dtype, "full")
    s0, q0 = oracle(g32, BS, mode, elem)
    s1, q1 = oracle(np.ascontiguousarray(g32.T), BS, mode, elem)
    rt, rg = recipe("triton", mode, elem), recipe("torch", mode, elem)
    x = to_torch(g32, dtype, "cuda")
    for out in DTYPES:
        check_dequant(qdq(x, recipe=rt, out_dtype=out), s0, q0, BS, elem, f"gpu dim0 -> {out}")
        y0, y1 = qdq_dim0_dim1(x, recipe=rt, out_dtype=out)
        check_dequant(y0, s0, q0, BS, elem, f"gpu fused dim0 -> {out}")
        check_dequant(y1.t(), s1, q1, BS, elem, f"gpu fused dim1 -> {out}")
    torch.manual_seed(0)
    scale = torch.logspace(-30, 30, 4096, device="cuda").view(-1, 1)
    for shape, fn in (
        ((4001, 1024), lambda t, r, o: [qdq(t, -1, recipe=r, out_dtype=o)]),
        ((2048, 1536), lambda t, r, o: [qdq(t, -2, recipe=r, out_dtype=o)]),
        ((8, 512, 768), lambda t, r, o: [qdq(t, -2, recipe=r, out_dtype=o)]),
        ((4096, 2048), lambda t, r, o: list(qdq_dim0_dim1(t, recipe=r, out_dtype=o))),
        ((4096, 2048), lambda t, r, o: list(qdq_dim0_dim1(t, recipe=r, out_dtype=o, dim1_mx=True))),
    ):
        t = (torch.randn(shape, device="cuda") * scale[: shape[-2]]).to(dtype)
        for out in DTYPES:
            for a, b in zip(fn(t, rt, out), fn(t, rg, out), strict=True):
                assert torch.equal(_bytes(a), _bytes(b)), (shape, out)


@pytest.mark.gpu
def test_gpu_qdq_fake_matches_real_triton():
    """The Triton backend's outputs have the layout the fake implementation promises."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    x = torch.randn(3, 96, 160, device="cuda", dtype=torch.bfloat16)
    for dim0, dim1 in ((True, 0), (False, 1), (True, 1), (True, 2)):
        args = (32, "rceil", torch.float8_e4m3fn, torch.bfloat16, dim0, dim1, "triton")
        real = [(t.shape, t.stride(), t.dtype) for t in qdq_op(x, *args)]
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fake = [(t.shape, t.stride(), t.dtype) for t in qdq_op(mode.from_tensor(x), *args)]
        assert real == fake, (dim0, dim1)
