"""The fused quantize-dequantize (mxmoe.quant.qdq) against the NumPy oracle: every scale mode,
element format, input and output dtype and input class of tests/quant/cases.py, along dim0, dim1
(2D, 3D with blocks per matrix, groups) and both from one read, every output in the input's
row-major layout, row counts that are no multiple of the block size against the oracle's padded
form (pad -> cast -> dequantize). On CPU: the torch backend and the Triton kernel through the
interpreter (smaller data); on the GPU (marked gpu): the Triton kernel against the oracle and
against the torch backend at larger shapes."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from conftest import assert_same_bits, assert_sm90_check

from mxmoe.quant.qdq import qdq, qdq_dim0_dim1, qdq_op
from mxmoe.recipe import MXRecipe
from tests.quant import oracle as O
from tests.quant.helpers import (
    COMBOS,
    DTYPES,
    check_dequant,
    combos,
    data,
    dname,
    level,
    to_f32_numpy,
    to_torch,
)

BS = 32
# on CPU tensors: Triton through the interpreter (off on a GPU host: the gpu tests below run it there)
KERNELS = ["torch", pytest.param("triton", marks=pytest.mark.interpreter)]
CPU_KERNELS = ["torch", "triton"] if os.environ.get("TRITON_INTERPRET") == "1" else ["torch"]
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
    result row-major contiguous in x's shape (dim1 too: the weights' layout along N)."""
    for mode, elem, dtype in run_combos(kernel):
        g32 = data({"dim0": 33, "dim1": 64, "dim1_3d": 96}[cast], BS, mode, elem, dtype, level(kernel))
        ws, wq = oracle(g32, BS, mode, elem)
        if cast == "dim0":
            x = to_torch(g32, dtype)
        elif cast == "dim1":
            x = to_torch(g32.T, dtype)  # (C, 64): blocks along dim -2 are the rows of g32
        else:  # (E=3, N=C, K=32) expert weights along N: g32's rows are (e, k)
            x = to_torch(g32.reshape(3, 32, -1).transpose(0, 2, 1), dtype)
        for out in DTYPES:
            y = qdq(x, -1 if cast == "dim0" else -2, recipe=recipe(kernel, mode, elem), out_dtype=out)
            assert y.dtype == out and y.shape == x.shape and y.is_contiguous()
            what = f"qdq {cast} {kernel} {mode} {dname(elem)} {dname(dtype)} -> {dname(out)}"
            if cast == "dim0":
                check_dequant(y, ws, wq, BS, elem, what)
            else:  # back to g32's arrangement (blocks along the last axis)
                check_dequant(y.transpose(-2, -1).reshape(g32.shape), ws, wq, BS, elem, what)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("orient", ["rows", "cols"])
def test_qdq_dim0_dim1_matches_oracle(kernel, orient):
    """Both directions from one read, both row-major; orient: along which axis the special blocks
    lie."""
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
            assert y0.is_contiguous() and y1.is_contiguous() and y1.shape == x.shape
            check_dequant(y1.t(), s1, q1, BS, elem, what + " dim1")


@pytest.mark.parametrize("kernel", KERNELS)
def test_qdq_dim0_dim1_3d_matches_oracle(kernel):
    """Expert weights (E, N, K) both ways from one read (what the grouped ops' forward makes of
    them, `keep_weight_casts`): along K, and along N within each matrix, both row-major."""
    for mode, elem, dtype in run_combos(kernel):
        g32 = data(96, BS, mode, elem, dtype, level(kernel))  # (rows, 32 * nb): (e, n) by k
        x32 = np.ascontiguousarray(g32.reshape(3, 32, -1))  # (E=3, N=32, K)
        x = to_torch(x32, dtype)
        s0, q0 = oracle(g32, BS, mode, elem)
        along_n = np.ascontiguousarray(x32.transpose(0, 2, 1)).reshape(-1, 32)  # (e, k) by n
        s1, q1 = oracle(along_n, BS, mode, elem)
        r = recipe(kernel, mode, elem)
        for out in DTYPES:
            what = f"qdq dim0+dim1 3D {kernel} {mode} {dname(elem)} {dname(dtype)} -> {dname(out)}"
            y0, y1 = qdq_dim0_dim1(x, recipe=r, out_dtype=out)
            assert y0.shape == y1.shape == x.shape and y0.is_contiguous() and y1.is_contiguous()
            check_dequant(y0.reshape(g32.shape), s0, q0, BS, elem, what + " along K")
            check_dequant(y1.transpose(-2, -1).reshape(-1, 32), s1, q1, BS, elem, what + " along N")
    with pytest.raises(ValueError, match=r"3D \(B, R, C\) without offs.*with offs"):
        qdq_dim0_dim1(torch.zeros(2, 32, 32), offs=torch.tensor([32], dtype=torch.int32))


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
    """Any strides in: qdq of a transposed view has the values of to_mx(...).dequantize() of it,
    row-major."""
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
            assert y.is_contiguous()
            assert torch.equal(y.view(torch.int16), ref.view(torch.int16))


def test_qdq_errors():
    r = recipe("torch", "rceil", torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"x.shape\[-1\]=40 \(x \(4, 40\)\) .* block_size=32"):
        qdq(torch.randn(4, 40), recipe=r)
    with pytest.raises(ValueError, match="axis=0"):
        qdq(torch.randn(3, 32, 32), 0, recipe=r)
    with pytest.raises(TypeError, match="x has dtype torch.float16"):
        qdq(torch.randn(4, 32, dtype=torch.float16), recipe=r)
    with pytest.raises(TypeError, match="out_dtype=torch.float16"):
        qdq(torch.randn(4, 32), recipe=r, out_dtype=torch.float16)
    with pytest.raises(TypeError, match="recipe must be an mxmoe.MXRecipe"):
        qdq(torch.randn(4, 32), recipe="mxfp8")
    with pytest.raises(ValueError, match=r"x.shape\[-1\]=48 \(x \(4, 48\)\) .*block_size=32"):
        qdq_dim0_dim1(torch.randn(4, 48), recipe=r)
    with pytest.raises(ValueError, match=r"x must have at least 2 dims for qdq, got shape \(32,\)"):
        qdq(torch.randn(32), recipe=r)


def test_qdq_refuses_what_it_cannot_take():
    """qdq names what is wrong: backward through it (it has no gradient: torch said "no autograd
    formula was registered"; the forward of a tensor that requires grad is fine), group ends on the
    host that decrease, are negative or pass x's rows (silently used), a bool axis (taken for 1)
    and a non-tensor x (an AttributeError)."""
    r = recipe("torch", "rceil", torch.float8_e4m3fn)
    x = torch.randn(64, 64)
    xg = x.clone().requires_grad_()
    assert torch.equal(qdq(xg, recipe=r), qdq(x, recipe=r))
    for y in (qdq(xg, recipe=r), qdq_dim0_dim1(xg, recipe=r)[1]):
        with pytest.raises(RuntimeError, match="backward through mxmoe.quant.qdq: an MX quantize-dequantize"):
            y.sum().backward()
    o = lambda ends: torch.tensor(ends, dtype=torch.int32)  # noqa: E731
    with pytest.raises(ValueError, match=r"offs\[1\]=16 < offs\[0\]=48: expected non-decreasing"):
        qdq(x, -2, recipe=r, offs=o([48, 16]))
    with pytest.raises(ValueError, match=r"offs\[-1\]=640 is past the 64 rows of x"):
        qdq(x, -1, recipe=r, offs=o([32, 640]))
    with pytest.raises(ValueError, match=r"offs\[0\]=-32: expected group ends >= 0"):
        qdq_dim0_dim1(x, recipe=r, offs=o([-32, 64]))
    with pytest.raises(ValueError, match="axis=True; expected -1 or -2"):
        qdq(x, True, recipe=r)
    with pytest.raises(TypeError, match="x must be a torch.Tensor, got list"):
        qdq([[1.0] * 32], recipe=r)
    with pytest.raises(TypeError, match="x must be a torch.Tensor, got list"):
        qdq_dim0_dim1([[1.0] * 32], recipe=r)


def test_qdq_fake_matches_real_and_compiles():
    """The fake implementation promises the real outputs' layout (3D x, a short last block along
    R); qdq traces with fullgraph."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    x = torch.randn(2, 45, 96)
    for dim0, dim1 in ((True, False), (False, True), (True, True)):
        args = ("mxfp8_e4m3_rceil", torch.bfloat16, dim0, dim1, "torch")
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


def test_qdq_ops_take_the_format_by_its_registered_name():
    """mxmoe::qdq, swiglu_qdq and swiglu_bwd_qdq take a registered format's name: its block size,
    scale rule and element dtype give the values (those of the recipe made from it); a name not
    registered is refused, naming it."""
    from mxmoe.formats import FORMATS
    from mxmoe.quant.mx_tensor import to_mx
    from mxmoe.quant.qdq import swiglu_bwd, swiglu_bwd_qdq_op, swiglu_qdq_op

    g, u, dh = (torch.randn(64, 32, generator=torch.Generator().manual_seed(i)) for i in range(3))
    r = recipe("torch", "floor", torch.float8_e5m2, 16)  # not shipped: registered by its fields
    assert r.fmt.name == "mxfp8_e5m2_floor_b16" and FORMATS[r.fmt.name] is r.fmt
    f32 = torch.float32
    y0, y1 = qdq_op(g, r.fmt.name, f32, True, True, "torch")
    assert_same_bits(y0, to_mx(g, -1, recipe=r).dequantize(f32), "dim0")
    assert_same_bits(y1, to_mx(g, -2, recipe=r).dequantize(f32), "dim1")
    h = torch.nn.functional.silu(g) * u
    want = qdq_dim0_dim1(h, recipe=r, out_dtype=f32)
    for got, w in zip(swiglu_qdq_op(g, u, r.fmt.name, f32, "torch"), want, strict=True):
        assert_same_bits(got, w, "swiglu")
    dg, du = swiglu_bwd(dh, g, u)
    want = [*qdq_dim0_dim1(dg, recipe=r, out_dtype=f32), *qdq_dim0_dim1(du, recipe=r, out_dtype=f32)]
    for got, w in zip(swiglu_bwd_qdq_op(dh, g, u, r.fmt.name, f32, "torch"), want, strict=True):
        assert_same_bits(got, w, "swiglu backward")
    with pytest.raises(ValueError, match=r"format 'mxfp8_e4m3_rceil_b7' is not registered; expected one of"):
        qdq_op(g, "mxfp8_e4m3_rceil_b7", f32, True, False, "torch")


# ---------------------------------------------------------------------------------------------
# dim1 in x's own layout: any row count, blocks per matrix (3D) or per group (offs)
# ---------------------------------------------------------------------------------------------

COUNTS = [0, 1, 31, 32, 33, 0, 45]  # groups: empty, 1, 31, 32, 33, empty, 45 rows
TAIL = 7  # rows after the last group (in no group)


def grouped_rows(src: np.ndarray, counts: list[int], tail: int, bs: int = BS) -> np.ndarray:
    """(sum(counts) + tail, C) rows of src (S, C), S a multiple of bs: each group (and the tail)
    starts at a whole block of src, so the special blocks of tests/quant/cases.py stay whole
    blocks of the groups (the last block of a group is a prefix of one)."""
    out, p = [], 0
    for n in [*counts, tail]:
        out.append(src[(p + np.arange(n)) % src.shape[0]])
        p = (p + -(-n // bs) * bs) % src.shape[0]
    return np.concatenate(out)


def oracle_rows(x32: np.ndarray, bs: int, mode: str, elem, out, ends: list[int] | None):
    """Expected (y0, y1) float64 values (NaN where NaN) of qdq_dim0_dim1(x, offs=ends) from the
    oracle, as the padded form defines them: y0 the cast along the columns;
    y1: each group (or all rows when ends is None) zero-padded to whole blocks of rows, cast along
    the rows, dequantized, its real rows taken; rows at or after ends[-1] zero in both."""
    T, C = x32.shape
    o, e = dname(out), dname(elem)
    y0 = O.oracle_dequantize(*oracle(x32, bs, mode, elem), bs, e, o)
    y1 = np.zeros((T, C))
    bounds = [(0, T)] if ends is None else list(zip([0, *ends[:-1]], ends, strict=True))
    for a, b in bounds:
        n = b - a
        if n:
            blk = np.zeros((-(-n // bs) * bs, C), np.float32)
            blk[:n] = x32[a:b]
            s, q = oracle(np.ascontiguousarray(blk.T), bs, mode, elem)
            y1[a:b] = O.oracle_dequantize(s, q, bs, e, o).T[:n]
    if ends is not None:
        y0[ends[-1]:] = 0
    return y0, y1


def check_values(got: torch.Tensor, want: np.ndarray, what: str) -> None:
    """got (bf16/fp32) == want (float64 values of got's dtype) bit for bit, NaN where NaN."""
    out = dname(got.dtype)
    g = got.detach().cpu().contiguous()
    gbits = (g.view(torch.int16).numpy().view(np.uint16) if out == "bfloat16"
             else g.view(torch.int32).numpy().view(np.uint32))
    gnan, wnan = np.isnan(to_f32_numpy(g)), np.isnan(want)
    assert g.shape == want.shape, f"{what}: shape {tuple(g.shape)}, expected {want.shape}"
    assert np.array_equal(gnan, wnan), f"{what}: NaN mask differs at {np.argwhere(gnan != wnan)[:8].tolist()}"
    bad = np.argwhere((gbits != O.value_bits(np.where(wnan, 0.0, want), out)) & ~wnan)
    assert not len(bad), f"{what}: {len(bad)} values differ, first at {bad[:8].tolist()}"


def offs_of(counts: list[int], device="cpu") -> torch.Tensor:
    return torch.tensor(np.cumsum(counts), dtype=torch.int32, device=device)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("grouped", [False, True])
def test_qdq_rows_matches_oracle(kernel, grouped):
    """y0 and y1 (T, C) row-major == the oracle's padded form (module helper
    oracle_rows), every scale mode, element, input and output dtype; T = 45 (a short last
    block) without groups; ragged groups with empty ones, sizes 1, 31, 32, 33, and rows after the
    last group with offs. qdq along one axis gives the same bits as the fused call."""
    for mode, elem, dtype in run_combos(kernel):
        src = np.ascontiguousarray(data(64, BS, mode, elem, dtype, level(kernel)).T)  # blocks along rows
        x32 = grouped_rows(src, COUNTS, TAIL) if grouped else src[:45]
        ends = np.cumsum(COUNTS).tolist() if grouped else None
        offs = offs_of(COUNTS) if grouped else None
        x = to_torch(x32, dtype)
        r = recipe(kernel, mode, elem)
        for out in DTYPES:
            what = f"rows {kernel} {mode} {dname(elem)} {dname(dtype)} -> {dname(out)} grouped={grouped}"
            w0, w1 = oracle_rows(x32, BS, mode, elem, out, ends)
            y0, y1 = qdq_dim0_dim1(x, recipe=r, out_dtype=out, offs=offs)
            assert y0.is_contiguous() and y1.is_contiguous() and y1.shape == x.shape
            check_values(y0, w0, what + " dim0")
            check_values(y1, w1, what + " dim1")
            z1 = qdq(x, -2, recipe=r, out_dtype=out, offs=offs)
            z0 = qdq(x, -1, recipe=r, out_dtype=out, offs=offs)
            assert torch.equal(_bytes(z1), _bytes(y1)) and torch.equal(_bytes(z0), _bytes(y0)), what


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("rows", [64, 45])
def test_qdq_3d_dim1_per_matrix_matches_oracle(kernel, rows):
    """3D x (E=3, N, K) (expert weights along N): qdq(x, -2) row-major == each matrix's padded form
    (oracle_rows of x[e]: blocks start at every matrix's first row, never across two; N = 45 has a
    short last block per matrix), every combo, bf16 and fp32 out; dim0 of the same x too."""
    E = 3
    for mode, elem, dtype in run_combos(kernel):
        src = np.ascontiguousarray(data(64, BS, mode, elem, dtype, level(kernel)).T)  # blocks along rows
        x32 = grouped_rows(src, [rows] * E, 0).reshape(E, rows, -1)  # each matrix starts at a block
        x = to_torch(x32, dtype)
        r = recipe(kernel, mode, elem)
        for out in DTYPES:
            what = f"3d rows={rows} {kernel} {mode} {dname(elem)} {dname(dtype)} -> {dname(out)}"
            y1 = qdq(x, -2, recipe=r, out_dtype=out)
            y0 = qdq(x, -1, recipe=r, out_dtype=out)
            assert y1.shape == x.shape and y1.is_contiguous() and y0.is_contiguous()
            for e in range(E):
                w0, w1 = oracle_rows(x32[e], BS, mode, elem, out, None)
                check_values(y1[e], w1, f"{what} dim1 matrix {e}")
                check_values(y0[e], w0, f"{what} dim0 matrix {e}")


@pytest.mark.parametrize("kernel", KERNELS)
def test_qdq_rows_edge_groups(kernel):
    """Groups that are all empty but one, one group of every row, a single row, offs[-1] == 0
    (every row in no group: zeros), groups and tail of 32k + 1 rows (the most blocks per row),
    block size 16 and fp32 in and out, against the padded form."""
    r16 = recipe(kernel, "floor", torch.float8_e5m2, 16)
    r = recipe(kernel, "rceil", torch.float8_e4m3fn)
    g = np.random.default_rng(3)
    for rr, counts, tail, dtype in (
        (r, [0, 0, 70, 0], 0, torch.bfloat16),
        (r, [70], 0, torch.float32),
        (r, [1], 0, torch.bfloat16),
        (r, [1], 1, torch.bfloat16),  # every group and the tail one row past whole blocks
        (r, [33, 1, 65], 1, torch.bfloat16),
        (r, [0, 0], 5, torch.bfloat16),
        (r16, [3, 17, 16, 0, 40], 9, torch.float32),
    ):
        T = sum(counts) + tail
        x32 = (g.standard_normal((T, 2 * rr.block_size)) * np.exp2(g.integers(-20, 20, (T, 1))))
        x = to_torch(x32.astype(np.float32), torch.float32).to(dtype)
        x32 = to_f32_numpy(x)
        ends = np.cumsum(counts).tolist()
        for out in DTYPES:
            w0, w1 = oracle_rows(x32, rr.block_size, rr.scaling_mode, rr.elem_dtype, out, ends)
            y0, y1 = qdq_dim0_dim1(x, recipe=rr, out_dtype=out, offs=offs_of(counts))
            check_values(y0, w0, f"{counts} {tail} dim0")
            check_values(y1, w1, f"{counts} {tail} dim1")


@pytest.mark.parametrize("elem", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_qdq_rows_gpu_dequantize_formula_is_exact(elem):
    """The arithmetic of the rows kernel's GPU element path (`_qdq_elems`, not run by the
    interpreter), done here with IEEE fp32 on CPU: the element value (exact in fp32) times the scale
    2^(s - 127) as one fp32 (the normal s << 23, the subnormal 2^-127 for s = 0, NaN for 255), then
    round to nearest even into bf16, equals the oracle's dequantize for every finite element byte
    and every scale byte, into bf16 and fp32."""
    q = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(elem)
    qf = q.float()
    finite = torch.isfinite(qf)
    sb = torch.arange(256, dtype=torch.int32)
    scale_bits = torch.where(sb == 255, 0x7FC00000, torch.where(sb == 0, 0x400000, sb << 23))
    prod = qf[None, finite] * scale_bits.view(torch.float32)[:, None]  # (256 scales, finite elements)
    qbytes = np.broadcast_to(q.view(torch.uint8)[finite].numpy(), prod.shape)
    sbytes = np.arange(256, dtype=np.uint8)[:, None]  # one block per element: block size 1
    for out, got in ((torch.float32, prod), (torch.bfloat16, prod.to(torch.bfloat16))):
        want = O.oracle_dequantize(sbytes.repeat(prod.shape[1], 1), np.ascontiguousarray(qbytes), 1,
                                   dname(elem), dname(out))
        check_values(got, want, f"{dname(elem)} -> {dname(out)}")


def test_qdq_rows_noncontiguous_offs():
    """offs may be any 1D view (the kernel gets a contiguous copy)."""
    x = torch.randn(50, 64)
    offs = torch.tensor([10, 99, 33, 99, 45], dtype=torch.int32)[::2]
    for k in CPU_KERNELS:
        r = recipe(k, "rceil", torch.float8_e4m3fn)
        got = qdq_dim0_dim1(x, recipe=r, offs=offs)
        want = qdq_dim0_dim1(x, recipe=r, offs=offs.contiguous())
        assert all(torch.equal(_bytes(a), _bytes(b)) for a, b in zip(got, want, strict=True))
        assert torch.equal(_bytes(qdq(x, -2, recipe=r, offs=offs)), _bytes(want[1]))


@pytest.mark.interpreter
def test_qdq_rows_kernel_writes_every_row():
    """The rows kernel's grid covers every block: outputs pre-filled with NaN are all overwritten
    (with the torch backend's values) for group sizes and a tail of 32k + 1 rows (the most blocks
    per row), for empty groups, and for 3D x of matrices of 32k + 1 rows (the most blocks per
    matrix) or 1 row."""
    from mxmoe.quant.checks import spec_of
    from mxmoe.quant.triton_qdq import qdq_rows as _triton_qdq_rows

    spec = spec_of(BS, "rceil", torch.float8_e4m3fn)
    rg = recipe("torch", "rceil", torch.float8_e4m3fn)
    torch.manual_seed(2)
    for counts, tail in (([1], 1), ([33, 1, 0, 65], 1), ([0, 0, 0], 33), ([1] * 9, 0)):
        T = sum(counts) + tail
        x = torch.randn(T, 64)
        offs = offs_of(counts)
        outs = [torch.full((1, T, 64), float("nan")) for _ in range(2)]
        _triton_qdq_rows(x.unsqueeze(0), spec, torch.float32, True, True, offs, outs)
        want = qdq_dim0_dim1(x, recipe=rg, offs=offs)
        for a, b in zip(outs, want, strict=True):
            assert torch.equal(_bytes(a[0]), _bytes(b)), (counts, tail)
    for shape in ((3, 33, 64), (5, 1, 64), (2, 64, 64)):
        x = torch.randn(shape)
        outs = [torch.full(shape, float("nan")) for _ in range(2)]
        _triton_qdq_rows(x, spec, torch.float32, True, True, None, outs)
        want = (qdq(x, -1, recipe=rg), qdq(x, -2, recipe=rg))
        for a, b in zip(outs, want, strict=True):
            assert torch.equal(_bytes(a), _bytes(b)), shape


@pytest.mark.interpreter
def test_qdq_rows_triton_interpreter_equals_torch_random():
    """The Triton rows kernel (interpreter) == the torch backend on random wide-range data, several
    column tiles per program (C = 1024) and ragged groups."""
    torch.manual_seed(0)
    counts = [40, 0, 3, 100, 1]
    T = sum(counts) + 2
    x = torch.randn(T, 1024) * torch.exp2(torch.randint(-60, 60, (T, 32)).float()).repeat_interleave(32, 1)
    rt, rg = (recipe(k, "rceil", torch.float8_e4m3fn) for k in ("triton", "torch"))
    for dtype in DTYPES:
        xd = x.to(dtype)
        for offs in (None, offs_of(counts)):
            got = qdq_dim0_dim1(xd, recipe=rt, offs=offs)
            want = qdq_dim0_dim1(xd, recipe=rg, offs=offs)
            for a, b in zip(got, want, strict=True):
                assert torch.equal(_bytes(a), _bytes(b)), (dtype, offs)


def test_qdq_rows_errors():
    r = recipe("torch", "rceil", torch.float8_e4m3fn)
    x = torch.randn(40, 64)
    offs = torch.tensor([10, 40], dtype=torch.int32)
    with pytest.raises(TypeError, match="offs must be a 1D torch.int32 .* got torch.int64 of shape"):
        qdq(x, -2, recipe=r, offs=offs.long())
    with pytest.raises(TypeError, match="offs must be a 1D torch.int32 tensor .* got \\[10, 40\\]"):
        qdq(x, -2, recipe=r, offs=[10, 40])
    with pytest.raises(ValueError, match="offs has 0 groups; expected 1 to"):
        qdq(x, -2, recipe=r, offs=offs[:0])
    with pytest.raises(ValueError, match="x must be 2D \\(T, C\\) with offs, got shape \\(2, 40, 64\\)"):
        qdq(torch.randn(2, 40, 64), -2, recipe=r, offs=offs)
    with pytest.raises(ValueError, match="offs is on meta but x on cpu"):
        qdq_dim0_dim1(x, recipe=r, offs=offs.to("meta"))
    with pytest.raises(ValueError, match=r"x.shape\[-1\]=48 .*block_size=32"):
        qdq(torch.randn(40, 48), -2, recipe=r)
    r256 = recipe("triton", "rceil", torch.float8_e4m3fn, 256)
    dev = "cpu" if "triton" in CPU_KERNELS else "cuda"  # where the Triton kernel runs
    with pytest.raises(ValueError, match="block_size=256: the Triton qdq kernel supports block sizes up to"):
        qdq(torch.randn(4, 256, device=dev), -2, recipe=r256)


def test_qdq_rows_fake_matches_real_and_compiles():
    """With groups, the fake outputs have the real ones' layout; a grouped qdq traces with
    fullgraph (offs a graph input: no host sync) and equals eager."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    x = torch.randn(1, 45, 96)
    offs = offs_of([5, 0, 30])
    for dim0, o in ((True, None), (False, None), (True, offs), (False, offs)):
        args = ("mxfp8_e4m3_rceil", torch.bfloat16, dim0, True, "torch", o)
        real = [(t.shape, t.stride(), t.dtype) for t in qdq_op(x, *args)]
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fo = None if o is None else mode.from_tensor(o)
            fake = [(t.shape, t.stride(), t.dtype) for t in qdq_op(mode.from_tensor(x), *args[:-1], fo)]
        assert real == fake, (dim0, o)
    r = recipe("torch", "floor", torch.float8_e4m3fn)

    def f(x, offs):
        a, b = qdq_dim0_dim1(x, recipe=r, out_dtype=torch.float32, offs=offs)
        return a + b + qdq(x, -2, recipe=r, out_dtype=torch.float32)

    got = torch.compile(f, fullgraph=True, backend="inductor")(x[0], offs)
    assert torch.equal(got, f(x[0], offs))


def test_qdq_rows_kernel_compiles_for_sm90(triton_sm90):
    """Ahead-of-time compile of the rows kernel for sm_90 with Triton's bundled ptxas (no GPU
    needed; tests/triton_sm90.py, run where the interpreter is off): 16-byte global
    loads and stores only, no local memory, and at most the registers measured when each variant
    was tuned (bf16 in: dim0 or dim1 alone 96, both 149, both grouped 150; fp32 in, dim1 alone,
    the fp32 master weights along N: 112; more costs CTAs per SM); the per-matrix 3D variant
    (MATRICES, only for 3D x with a short last block) may take more."""
    assert_sm90_check(triton_sm90, "qdq_rows_kernel")


@pytest.mark.parametrize("kernel", KERNELS)
def test_qdq_op_2d_input_equals_3d_and_fake(kernel):
    """The op takes a 2D x (what the public 2D calls pass, saving reshapes): the same values as the
    (1, R, C) form, 2D outputs of the layout the fake implementation promises."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    x = torch.randn(45, 64) * 4
    offs = offs_of([5, 0, 30])
    for dim0, dim1, o in ((True, False, None), (True, False, offs), (False, True, None), (True, True, offs)):
        args = ("mxfp8_e4m3_rceil", torch.bfloat16, dim0, dim1, kernel)
        got = qdq_op(x, *args, o)
        want = qdq_op(x.unsqueeze(0), *args, o)
        assert [t.shape for t in got] == [x.shape] * len(got)
        for g, w in zip(got, want, strict=True):
            assert torch.equal(_bytes(g), _bytes(w[0])), (dim0, dim1, o is None)
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fo = None if o is None else mode.from_tensor(o)
            fake = [(t.shape, t.stride(), t.dtype) for t in qdq_op(mode.from_tensor(x), *args, fo)]
        assert fake == [(t.shape, t.stride(), t.dtype) for t in got]


def test_rows_launch_constants_cover_the_kernels_constexprs():
    """The rows kernel's compile-time arguments built once per configuration (`_rows_launch`) are
    every constexpr of `qdq_rows_kernel` but the two that depend on the shapes (EP, I64), and the
    configuration's flags reach the kernel as given (MATRICES too)."""
    import inspect

    from mxmoe.quant.checks import spec_of
    from mxmoe.quant.triton_qdq import _rows_launch, qdq_rows_kernel

    fn = getattr(qdq_rows_kernel, "fn", qdq_rows_kernel)
    params = inspect.signature(fn).parameters.items()
    constexprs = {n for n, p in params if str(p.annotation).endswith("constexpr")}
    spec = spec_of(32, "rceil", torch.float8_e4m3fn)
    # (IN_BF16, OUT_BF16, DIM0, DIM1, GROUPED, MATRICES, SOFT)
    for flags in ((True, False, False, True, False, False, True),
                  (False, True, True, False, False, True, False),
                  (True, True, False, True, True, False, True)):
        consts, bct = _rows_launch(spec, *flags)
        assert set(consts) - {"num_warps"} == constexprs - {"EP", "I64"}, flags
        names = ("IN_BF16", "OUT_BF16", "DIM0", "DIM1", "GROUPED", "MATRICES", "SOFT")
        assert tuple(consts[n] for n in names) == flags
        assert bct == consts["W"] * consts["NB"] * 32


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.gpu
@pytest.mark.parametrize("combo", COMBOS, ids=[combo_id(c) for c in COMBOS])
def test_gpu_qdq_triton_matches_oracle_and_torch(combo):
    """On the GPU: the Triton qdq == the oracle on every input class (full level), and == the torch
    backend bit for bit on large random tensors of every shape class (dim0 odd rows, dim1 2D and 3D
    (expert weights along N, also with a short last block per matrix), both)."""
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
        ((16, 1024, 1024), lambda t, r, o: [qdq(t, -2, recipe=r, out_dtype=o)]),
        ((7, 500, 768), lambda t, r, o: [qdq(t, -2, recipe=r, out_dtype=o)]),
        ((4096, 2048), lambda t, r, o: list(qdq_dim0_dim1(t, recipe=r, out_dtype=o))),
    ):
        t = (torch.randn(shape, device="cuda") * scale[: shape[-2]]).to(dtype)
        for out in DTYPES:
            for a, b in zip(fn(t, rt, out), fn(t, rg, out), strict=True):
                assert torch.equal(_bytes(a), _bytes(b)), (shape, out)


@pytest.mark.gpu
def test_gpu_qdq_fake_matches_real_triton():
    """The Triton backend's outputs have the layout the fake implementation promises."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    x = torch.randn(3, 90, 160, device="cuda", dtype=torch.bfloat16)
    for dim0, dim1 in ((True, False), (False, True), (True, True)):
        args = ("mxfp8_e4m3_rceil", torch.bfloat16, dim0, dim1, "triton")
        real = [(t.shape, t.stride(), t.dtype) for t in qdq_op(x, *args)]
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fake = [(t.shape, t.stride(), t.dtype) for t in qdq_op(mode.from_tensor(x), *args)]
        assert real == fake, (dim0, dim1)


@pytest.mark.gpu
@pytest.mark.parametrize("combo", COMBOS, ids=[combo_id(c) for c in COMBOS])
def test_gpu_qdq_rows_triton_matches_oracle(combo):
    """On the GPU: the Triton rows kernel == the oracle's padded form on every input class (full
    level), ragged groups (empty ones, sizes 1, 31, 32, 33, rows after the last); bf16 out, and fp32
    out too for fp32 in (each output format is a compiled variant: kept few for the GPU run's time;
    no groups and a short last block: test_gpu_qdq_rows_triton_equals_torch_large)."""
    mode, elem, dtype = combo
    src = np.ascontiguousarray(data(64, BS, mode, elem, dtype, "full").T)
    rt = recipe("triton", mode, elem)
    x32 = grouped_rows(src, COUNTS, TAIL)
    ends = np.cumsum(COUNTS).tolist()
    x = to_torch(x32, dtype, "cuda")
    for out in DTYPES if dtype == torch.float32 else (torch.bfloat16,):
        w0, w1 = oracle_rows(x32, BS, mode, elem, out, ends)
        y0, y1 = qdq_dim0_dim1(x, recipe=rt, out_dtype=out, offs=offs_of(COUNTS, "cuda"))
        check_values(y0, w0, f"gpu rows dim0 -> {out}")
        check_values(y1, w1, f"gpu rows dim1 -> {out}")


@pytest.mark.gpu
def test_gpu_qdq_rows_triton_equals_torch_large():
    """On the GPU: the Triton rows kernel == the torch backend bit for bit on a large wide-range
    input, T no multiple of 32, 100 ragged groups (every 7th empty) and 13 rows after the last,
    7168 columns (several column tiles per program, a short last column program): both directions
    with and without groups, dim1 alone with groups; e4m3 RCEIL bf16 and e5m2 FLOOR fp32 in."""
    g = torch.Generator().manual_seed(1)
    counts = torch.randint(0, 200, (100,), generator=g)
    counts[::7] = 0
    T = int(counts.sum()) + 13
    offs = counts.cumsum(0).to(torch.int32).cuda()
    scale = torch.logspace(-30, 30, T, device="cuda").view(-1, 1)
    for mode, elem, dtype in (("rceil", torch.float8_e4m3fn, torch.bfloat16),
                              ("floor", torch.float8_e5m2, torch.float32)):
        rt, rg = recipe("triton", mode, elem), recipe("torch", mode, elem)
        t = (torch.randn(T, 7168, device="cuda") * scale).to(dtype)
        for o in (None, offs):
            got = qdq_dim0_dim1(t, recipe=rt, out_dtype=torch.bfloat16, offs=o)
            want = qdq_dim0_dim1(t, recipe=rg, out_dtype=torch.bfloat16, offs=o)
            for a, b in zip(got, want, strict=True):
                assert torch.equal(_bytes(a), _bytes(b)), (mode, o is None)
        got = qdq(t, -2, recipe=rt, out_dtype=torch.bfloat16, offs=offs)
        assert torch.equal(_bytes(got), _bytes(want[1])), mode


@pytest.mark.gpu
def test_gpu_qdq_rows_fake_matches_real_triton():
    """The Triton rows kernel's outputs have the layout the fake implementation promises."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    x = torch.randn(1, 1000, 512, device="cuda", dtype=torch.bfloat16)
    offs = torch.tensor([100, 100, 999], dtype=torch.int32, device="cuda")
    for dim0, o in ((True, None), (False, offs), (True, offs)):
        args = ("mxfp8_e4m3_rceil", torch.bfloat16, dim0, True, "triton")
        real = [(t.shape, t.stride(), t.dtype) for t in qdq_op(x, *args, o)]
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fo = None if o is None else mode.from_tensor(o)
            fake = [(t.shape, t.stride(), t.dtype) for t in qdq_op(mode.from_tensor(x), *args, fo)]
        assert real == fake, (dim0, o is None)
