"""Exactness audit: the cells of the (op x CPU backend x scale mode x element x input dtype x input
class) matrix that the other oracle tests leave out, each against the NumPy spec oracle
(tests/quant/oracle.py, through the padded form `oracle_rows` of test_qdq.py), never a backend
against itself.

- The Triton qdq (interpreter) in every combo (the other CPU tests take a spread of 4 of the 16):
  dim0, dim1 (2D and 3D expert weights along N), both from one read, ragged groups (empty ones,
  sizes 1, 31, 32, 33, rows after offs[-1]) for the fused call and for each axis alone.
- The fused SwiGLU forward and backward qdq on the "triton" kernel in every combo, with and without
  groups, fp32 out too (the other tests take 2 combos, groups, bf16 out), and on both CPU kernels
  with CEIL / EVEN in edge groups.
- Edge groups (offs[-1] == 0, all empty but one, one row, 32k + 1 rows) holding every input class,
  in CEIL and EVEN on both kernels (the other edge-group tests: RCEIL / FLOOR on random data).
- Dequantize of every (scale byte, element byte) pair in the dim1 layout and for 3D expert weights
  along N (the other every-byte tests: 2D along the last dim).
- quantize_dim0 / dequantize into caller buffers (`out=`) in every combo (the other test compares
  the backend with its own result without `out`).
- qdq block sizes 16 and 64 in CEIL and EVEN; Triton qdq rows wider than one program's column tiles.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mxmoe.quant import MXTensor
from mxmoe.quant.qdq import qdq, qdq_dim0_dim1, swiglu_bwd_qdq_dim0_dim1, swiglu_qdq_dim0_dim1
from mxmoe.recipe import MXRecipe
from tests.quant.helpers import (
    COMBOS,
    DTYPES,
    ELEMS,
    check_dequant,
    check_quant,
    combos,
    data,
    dname,
    to_f32_numpy,
    to_torch,
    ubytes,
)
from tests.quant.test_qdq import BS, COUNTS, KERNELS, TAIL, check_values, grouped_rows, offs_of, oracle_rows

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")


def combo_id(c) -> str:
    m, e, d = c
    return f"{m}-{dname(e).removeprefix('float8_')}-{dname(d)}"


combo_p = pytest.mark.parametrize("combo", COMBOS, ids=[combo_id(c) for c in COMBOS])
# the combos test_qdq.py already runs on the Triton interpreter (helpers.combos: a spread of 4)
_SPREAD = combos("triton") if not torch.cuda.is_available() else []
REST = [c for c in COMBOS if c not in _SPREAD]
rest_p = pytest.mark.parametrize("combo", REST, ids=[combo_id(c) for c in REST])


def recipe(kernel: str, mode: str, elem, bs: int = BS) -> MXRecipe:
    return MXRecipe(scaling_mode=mode, elem_dtype=elem, block_size=bs, dim0_kernel=kernel, dim1_kernel=kernel)


def outputs(dtype) -> tuple[torch.dtype, ...]:
    """Output dtypes of the interpreter's heavier loops: bf16, and fp32 too for fp32 in (bf16 in to
    fp32 out: test_qdq.py's spread and the SwiGLU forward below)."""
    return DTYPES if dtype == torch.float32 else (torch.bfloat16,)


def rows_data(mode, elem, dtype, seed: int = 0) -> np.ndarray:
    """float32 (R, 64), R a multiple of 32: the input classes of tests/quant/cases.py as blocks along
    the rows (small level: the interpreter's pace)."""
    return np.ascontiguousarray(data(64, BS, mode, elem, dtype, "small", seed).T)


@pytest.mark.interpreter
@rest_p
def test_triton_qdq_every_combo(combo):
    """The 12 combos test_qdq.py leaves out on the interpreter (`outputs`): qdq along each
    axis and both ways (special blocks along either axis), 3D (E, N, K) along N and K with a short
    last block per matrix, ragged groups fused and per axis."""
    mode, elem, dtype = combo
    r = recipe("triton", mode, elem)
    src = rows_data(mode, elem, dtype)  # (R, 64): blocks along the rows
    g32 = np.ascontiguousarray(src.T)  # (64, R): blocks along the last axis
    x2 = to_torch(src, dtype)
    x3_32 = grouped_rows(src, [45] * 3, 0).reshape(3, 45, -1)  # 3 matrices, short last block each
    x3 = to_torch(x3_32, dtype)
    xg32 = grouped_rows(src, COUNTS, TAIL)
    xg, ends, offs = to_torch(xg32, dtype), np.cumsum(COUNTS).tolist(), offs_of(COUNTS)
    for out in outputs(dtype):
        what = f"triton {combo_id(combo)} -> {dname(out)}"
        w0, w1 = oracle_rows(src, BS, mode, elem, out, None)
        check_values(qdq(x2, -1, recipe=r, out_dtype=out), w0, f"{what} dim0")
        check_values(qdq(x2, -2, recipe=r, out_dtype=out), w1, f"{what} dim1")
        y0, y1 = qdq_dim0_dim1(x2, recipe=r, out_dtype=out)
        check_values(y0, w0, f"{what} fused dim0")
        check_values(y1, w1, f"{what} fused dim1")
        # the transposed arrangement: special blocks along the last axis
        v0, v1 = oracle_rows(g32, BS, mode, elem, out, None)
        y0, y1 = qdq_dim0_dim1(to_torch(g32, dtype), recipe=r, out_dtype=out)
        check_values(y0, v0, f"{what} fused dim0 (cols)")
        check_values(y1, v1, f"{what} fused dim1 (cols)")
        # 3D expert weights along N (blocks of each matrix's rows) and along K
        y1, y0 = qdq(x3, -2, recipe=r, out_dtype=out), qdq(x3, -1, recipe=r, out_dtype=out)
        for e in range(3):
            u0, u1 = oracle_rows(x3_32[e], BS, mode, elem, out, None)
            check_values(y1[e], u1, f"{what} 3d dim1 matrix {e}")
            check_values(y0[e], u0, f"{what} 3d dim0 matrix {e}")
        # ragged groups: empty ones, 1, 31, 32, 33 rows, rows after offs[-1]
        g0, g1 = oracle_rows(xg32, BS, mode, elem, out, ends)
        y0, y1 = qdq_dim0_dim1(xg, recipe=r, out_dtype=out, offs=offs)
        check_values(y0, g0, f"{what} grouped dim0")
        check_values(y1, g1, f"{what} grouped dim1")
        check_values(qdq(xg, -1, recipe=r, out_dtype=out, offs=offs), g0, f"{what} grouped dim0 alone")
        check_values(qdq(xg, -2, recipe=r, out_dtype=out, offs=offs), g1, f"{what} grouped dim1 alone")


def _swiglu_inputs(mode, elem, dtype, grouped: bool, n: int):
    """n tensors (T, C) of every input class (one data seed each), ragged groups or 45 rows."""
    rows = [rows_data(mode, elem, dtype, seed) for seed in range(n)]
    rows = [grouped_rows(r, COUNTS, TAIL) if grouped else r[:45] for r in rows]
    ends = np.cumsum(COUNTS).tolist() if grouped else None
    return [to_torch(r, dtype) for r in rows], (offs_of(COUNTS) if grouped else None), ends


@pytest.mark.interpreter
@combo_p
def test_triton_swiglu_qdq_every_combo(combo):
    """Forward: y0, y1 of h = F.silu(g) * u (torch's h: the definition) == the oracle's padded form."""
    mode, elem, dtype = combo
    r = recipe("triton", mode, elem)
    for grouped in (False, True):
        (g, u), offs, ends = _swiglu_inputs(mode, elem, dtype, grouped, 2)
        h32 = to_f32_numpy(F.silu(g) * u)
        for out in DTYPES:
            what = f"triton swiglu {combo_id(combo)} -> {dname(out)} grouped={grouped}"
            w0, w1 = oracle_rows(h32, BS, mode, elem, out, ends)
            y0, y1 = swiglu_qdq_dim0_dim1(g, u, recipe=r, out_dtype=out, offs=offs)
            check_values(y0, w0, f"{what} dim0")
            check_values(y1, w1, f"{what} dim1")


@pytest.mark.interpreter
@combo_p
def test_triton_swiglu_bwd_qdq_every_combo(combo):
    """Backward: the four outputs (`outputs`) == the oracle's padded form of torch's
    dg = silu_backward(dh * u, g) and du = dh * F.silu(g) (autograd's formulas for F.silu(g) * u)."""
    mode, elem, dtype = combo
    r = recipe("triton", mode, elem)
    for grouped in (False, True):
        (dh, g, u), offs, ends = _swiglu_inputs(mode, elem, dtype, grouped, 3)
        dg32 = to_f32_numpy(torch.ops.aten.silu_backward(dh * u, g))
        du32 = to_f32_numpy(dh * F.silu(g))
        for out in outputs(dtype):
            what = f"triton swiglu_bwd {combo_id(combo)} -> {dname(out)} grouped={grouped}"
            want = [*oracle_rows(dg32, BS, mode, elem, out, ends),
                    *oracle_rows(du32, BS, mode, elem, out, ends)]
            got = swiglu_bwd_qdq_dim0_dim1(dh, g, u, recipe=r, out_dtype=out, offs=offs)
            for y, w, name in zip(got, want, ("dg0", "dg1", "du0", "du1"), strict=True):
                check_values(y, w, f"{what} {name}")


EDGE_GROUPS = (
    ([0, 0, 70, 0], 0),
    ([1], 1),
    ([33, 1, 65], 1),  # every group and the tail one row past whole blocks
    ([0, 0], 5),  # offs[-1] == 0: every row in no group
    ([64], 0),
)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("mode", ["ceil", "even"])
def test_edge_groups_ceil_even(kernel, mode):
    """Edge groups holding every input class, CEIL and EVEN, both elements (each with one input
    dtype, the other one in the other mode), the input dtype's output: qdq both ways and the SwiGLU
    forward and backward qdq, against the oracle's padded form."""
    pairs = ((ELEMS[0], DTYPES[0]), (ELEMS[1], DTYPES[1])) if mode == "ceil" else (
        (ELEMS[0], DTYPES[1]), (ELEMS[1], DTYPES[0]))
    for elem, dtype in pairs:
        r = recipe(kernel, mode, elem)
        srcs = [rows_data(mode, elem, dtype, seed) for seed in range(3)]
        for counts, tail in EDGE_GROUPS:
            ends, offs = np.cumsum(counts).tolist(), offs_of(counts)
            xs32 = [grouped_rows(s, counts, tail) for s in srcs]
            dh, g, u = (to_torch(x, dtype) for x in xs32)
            out = torch.float32 if dtype == torch.float32 else torch.bfloat16
            what = f"{kernel} {mode} {dname(elem)} {dname(dtype)} {counts}+{tail}"
            w0, w1 = oracle_rows(xs32[0], BS, mode, elem, out, ends)
            y0, y1 = qdq_dim0_dim1(dh, recipe=r, out_dtype=out, offs=offs)
            check_values(y0, w0, f"{what} qdq dim0")
            check_values(y1, w1, f"{what} qdq dim1")
            h32 = to_f32_numpy(F.silu(g) * u)
            want = oracle_rows(h32, BS, mode, elem, out, ends)
            for y, w, name in zip(swiglu_qdq_dim0_dim1(g, u, recipe=r, out_dtype=out, offs=offs), want,
                                  ("y0", "y1"), strict=True):
                check_values(y, w, f"{what} swiglu {name}")
            dg32 = to_f32_numpy(torch.ops.aten.silu_backward(dh * u, g))
            du32 = to_f32_numpy(dh * F.silu(g))
            want = [*oracle_rows(dg32, BS, mode, elem, out, ends),
                    *oracle_rows(du32, BS, mode, elem, out, ends)]
            got = swiglu_bwd_qdq_dim0_dim1(dh, g, u, recipe=r, out_dtype=out, offs=offs)
            for y, w, name in zip(got, want, ("dg0", "dg1", "du0", "du1"), strict=True):
                check_values(y, w, f"{what} swiglu_bwd {name}")


def _every_byte(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(scale bytes (R, 8), element bytes (R, 256)): every element byte against the scale bytes of
    `rows` (0: 2^-127, 254: 2^127, 255: NaN, ...), shifted per block."""
    sb = ((rows[:, None] + 37 * np.arange(256 // BS)[None, :]) % 256).astype(np.uint8)
    qb = np.tile(np.arange(256, dtype=np.uint8), (len(rows), 1))
    return sb, qb


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("elem", ELEMS, ids=dname)
def test_dequantize_every_byte_dim1_and_3d(kernel, elem):
    """Every (scale byte, element byte) pair, NaN scale 0xFF, NaN codes and e5m2 Inf codes included,
    dequantized from the dim1 layout (axis 0) and from 3D expert weights quantized along N (axis 1),
    into bf16 and fp32: the logical result is the oracle's, transposed."""
    rows = np.arange(256)
    if kernel == "triton":  # the interpreter: the scale bytes around the kernel's cases (SAFE_S 10 / 17)
        rows = np.array([0, 1, 2, 9, 10, 16, 17, 127, 200, 253, 254, 255])
    sb, qb = _every_byte(rows)
    q, s = torch.from_numpy(qb).view(elem), torch.from_numpy(sb).view(torch.float8_e8m0fnu)
    rk = recipe(kernel, "rceil", elem)
    mx2 = MXTensor(q, s, axis=0, block_size=BS)
    R = len(rows) - len(rows) % 2
    mx3 = MXTensor(q[:R].reshape(2, R // 2, 256), s[:R].reshape(2, R // 2, -1), axis=1, block_size=BS)
    for out in DTYPES:
        y2 = mx2.dequantize(out, recipe=rk)
        assert tuple(y2.shape) == (256, len(rows))
        check_dequant(y2.t(), sb, qb, BS, elem, f"dim1 every byte {kernel} -> {dname(out)}")
        y3 = mx3.dequantize(out, recipe=rk)
        assert tuple(y3.shape) == (2, 256, R // 2)
        check_dequant(y3.transpose(1, 2).reshape(R, 256), sb[:R], qb[:R], BS, elem,
                      f"3d along N every byte {kernel} -> {dname(out)}")


@pytest.mark.parametrize("kernel", KERNELS)
def test_quantize_dim0_into_buffers_every_combo(kernel):
    """quantize_dim0(x, spec, out=(q, s)) into row slices of larger buffers (what the MX dispatch
    does with its communication buffers) and dequantize(q, s, ..., out=) into rows of a larger
    output: the bytes written are the oracle's, every combo, every input class, bf16 and fp32 out;
    the bytes around the slices are untouched."""
    from mxmoe.formats import make_spec
    from mxmoe.quant.backends import backend

    for mode, elem, dtype in COMBOS:
        x32 = data(33, BS, mode, elem, dtype, "small")
        R, C = x32.shape
        qbuf = torch.full((R + 9, C), 0xA5, dtype=torch.uint8)
        sbuf = torch.full((R + 9, C // BS), 0x5A, dtype=torch.uint8)
        qo, so = qbuf[4 : 4 + R].view(elem), sbuf[4 : 4 + R].view(torch.float8_e8m0fnu)
        q, s = backend(kernel).quantize_dim0(to_torch(x32, dtype), make_spec(BS, mode, elem), out=(qo, so))
        assert q.data_ptr() == qo.data_ptr() and s.data_ptr() == so.data_ptr()
        check_quant(so, qo, x32, BS, mode, elem, f"dim0 out= {kernel} {mode} {dname(elem)} {dname(dtype)}")
        for part in (qbuf[:4], qbuf[4 + R :], sbuf[:4], sbuf[4 + R :]):
            assert bool((part == part.flatten()[0]).all()) and int(part.flatten()[0]) in (0xA5, 0x5A), mode
        # and back, into rows of a larger output
        for out in DTYPES:
            ybuf = torch.full((R + 5, C), 7.0, dtype=out)
            y = backend(kernel).dequantize(q, s, BS, out, out=ybuf[2 : 2 + R])
            assert y.data_ptr() == ybuf[2].data_ptr()
            check_dequant(ybuf[2 : 2 + R], ubytes(s), ubytes(q), BS, elem, f"dequantize out= {kernel} {mode}")
            assert bool((ybuf[:2] == 7).all()) and bool((ybuf[2 + R :] == 7).all()), mode


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("bs", [16, 64])
def test_qdq_other_block_sizes_ceil_even(kernel, bs):
    """Block sizes 16 and 64 in CEIL and EVEN (test_qdq.py runs them in RCEIL and FLOOR), every
    input class: qdq along each axis without groups and both ways in ragged groups."""
    for mode, elem, dtype in (("ceil", ELEMS[1], DTYPES[0]), ("even", ELEMS[0], DTYPES[1]),
                              ("ceil", ELEMS[0], DTYPES[1]), ("even", ELEMS[1], DTYPES[0])):
        r = recipe(kernel, mode, elem, bs)
        src = np.ascontiguousarray(data(2 * bs, bs, mode, elem, dtype, "small").T)  # blocks along rows
        if kernel == "triton":
            src = src[: 8 * bs]
        x = to_torch(src, dtype)
        counts = [0, bs + 1, 1, 2 * bs - 1]
        xg32 = grouped_rows(src, counts, 3, bs)
        ends = np.cumsum(counts).tolist()
        out = torch.float32 if dtype == torch.float32 else torch.bfloat16
        what = f"bs={bs} {kernel} {mode} {dname(elem)} {dname(dtype)}"
        w0, w1 = oracle_rows(src, bs, mode, elem, out, None)
        check_values(qdq(x, -1, recipe=r, out_dtype=out), w0, f"{what} dim0")
        check_values(qdq(x, -2, recipe=r, out_dtype=out), w1, f"{what} dim1")
        g0, g1 = oracle_rows(xg32, bs, mode, elem, out, ends)
        y0, y1 = qdq_dim0_dim1(to_torch(xg32, dtype), recipe=r, out_dtype=out, offs=offs_of(counts))
        check_values(y0, g0, f"{what} grouped dim0")
        check_values(y1, g1, f"{what} grouped dim1")


WIDE = [("floor", ELEMS[1], DTYPES[0]), ("rceil", ELEMS[0], DTYPES[1]), ("ceil", ELEMS[1], DTYPES[1]),
        ("even", ELEMS[0], DTYPES[0])]


@pytest.mark.interpreter
@pytest.mark.parametrize("combo", WIDE, ids=[combo_id(c) for c in WIDE])
def test_triton_qdq_wide_rows(combo):
    """Rows wider than one program's column tiles (256 columns a tile, 4 tiles a program: C = 1440
    takes a second program and a short last tile) holding every input class: the rows kernel's
    column loop and masks against the oracle, without and with groups, blocks along either axis."""
    mode, elem, dtype = combo
    r = recipe("triton", mode, elem)
    along_c = data(10, BS, mode, elem, dtype, "small", nb=45)  # (10, 1440): blocks along the columns
    along_r = np.ascontiguousarray(data(1440, BS, mode, elem, dtype, "small").T)  # (32, 1440)
    counts = [0, 5, 33, 0, 1]
    for x32 in (along_c, along_r):
        assert x32.shape[1] == 1440
        xg32 = grouped_rows(x32, counts, 4) if x32.shape[0] % BS == 0 else x32[:6]
        gends = np.cumsum(counts).tolist() if x32.shape[0] % BS == 0 else [2, 6]
        for ends, xx in ((None, x32), (gends, xg32)):
            offs = torch.tensor(ends, dtype=torch.int32) if ends is not None else None
            for out in (dtype,):  # (the output formats: test_triton_qdq_every_combo)
                what = f"wide {combo_id(combo)} {xx.shape} groups={ends} -> {dname(out)}"
                w0, w1 = oracle_rows(xx, BS, mode, elem, out, ends)
                y0, y1 = qdq_dim0_dim1(to_torch(xx, dtype), recipe=r, out_dtype=out, offs=offs)
                check_values(y0, w0, f"{what} dim0")
                check_values(y1, w1, f"{what} dim1")
