"""Bit-exactness of the CUDA cast backends against the NumPy oracle, on larger shapes.

Run on a GPU machine: `PYTHONPATH=. python -m pytest -m gpu tests/quant -q`.

Kernels: `torch` (eager), `triton` and `cuda` run the whole matrix; the inductor-compiled torch
backend (torch_cast's functions compiled by torch.compile: Triton code generated from the
reference) runs the main casts on every combo. A backend that does not import or build fails here.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from conftest import recipe_for

from mxmoe.formats import make_spec
from mxmoe.quant import MXTensor, to_mx, to_mx_dim0_dim1, torch_cast
from tests.quant import oracle as O
from tests.quant.helpers import (
    COMBOS,
    DTYPES,
    ELEMS,
    MODES,
    check_dequant,
    check_quant,
    data,
    dname,
    to_torch,
    ubytes,
)

pytestmark = pytest.mark.gpu

BS = 32
ROWS, NB = 1000, 64  # (1000, 2048) inputs


VARIANTS = ["torch", "triton", "cuda"]
DEVICE = "cuda"


def combo_id(c) -> str:
    m, e, d = c
    return f"{m}-{dname(e).removeprefix('float8_')}-{dname(d)}"


variant_p = pytest.mark.parametrize("variant", VARIANTS)
combo_p = pytest.mark.parametrize("combo", COMBOS, ids=[combo_id(c) for c in COMBOS])


def cast(variant: str, x: torch.Tensor, axis: int, mode: str, elem, bs: int = BS) -> MXTensor:
    return to_mx(x, axis=axis, recipe=recipe_for(variant, scaling_mode=mode, elem_dtype=elem, block_size=bs))


def cast_fused(variant: str, x: torch.Tensor, mode: str, elem, bs: int = BS):
    return to_mx_dim0_dim1(x, recipe=recipe_for(variant, scaling_mode=mode, elem_dtype=elem, block_size=bs))


def dequant(variant: str, mx: MXTensor, out: torch.dtype) -> torch.Tensor:
    """Dequantized values in the *storage* layout (rows of blocks)."""
    y = mx.dequantize(out, recipe=recipe_for(variant))
    return y.movedim(mx.axis, -1).reshape(-1, mx.qdata_blocked.shape[-1])


@functools.lru_cache(maxsize=128)
def want(rows: int, mode: str, elem, dtype, transposed: bool):
    """Oracle bytes of data(rows, BS, ..., nb=NB) (or of its transpose): (scale, elem) uint8."""
    g32 = data(rows, BS, mode, elem, dtype, "full", 0, NB)
    if transposed:
        g32 = np.ascontiguousarray(g32.T)
    return O.oracle_quantize(g32, BS, mode, dname(elem))


def test_gpu_kernels_available():
    import mxmoe

    assert mxmoe.available_kernels("cuda") == ["torch", "triton", "cuda"]


@variant_p
@combo_p
def test_dim0_gpu(variant, combo):
    mode, elem, dtype = combo
    g32 = data(ROWS, BS, mode, elem, dtype, "full", 0, NB)
    mx = cast(variant, to_torch(g32, dtype, DEVICE), -1, mode, elem)
    assert mx.qdata_blocked.is_contiguous() and tuple(mx.qdata_blocked.shape) == g32.shape
    w = want(ROWS, mode, elem, dtype, False)
    check_quant(mx.scale_blocked, mx.qdata_blocked, g32, BS, mode, elem, f"dim0 {variant}", w)
    for out in DTYPES:
        check_dequant(dequant(variant, mx, out), *w, BS, elem, f"dequant dim0 {dname(out)} {variant}")


@variant_p
@combo_p
def test_dim1_gpu(variant, combo):
    """x (2048, 1000) along axis 0: storage (1000, 2048) contiguous."""
    mode, elem, dtype = combo
    g32 = data(ROWS, BS, mode, elem, dtype, "full", 0, NB)
    mx = cast(variant, to_torch(g32.T, dtype, DEVICE), 0, mode, elem)
    assert mx.qdata_blocked.is_contiguous() and tuple(mx.qdata_blocked.shape) == g32.shape
    assert mx.scale_blocked.is_contiguous() and tuple(mx.scale_blocked.shape) == (ROWS, NB)
    w = want(ROWS, mode, elem, dtype, False)
    ws, wq = check_quant(mx.scale_blocked, mx.qdata_blocked, g32, BS, mode, elem, f"dim1 {variant}", w)
    assert np.array_equal(ubytes(mx.qdata), wq.T) and np.array_equal(ubytes(mx.scale), ws.T)
    for out in DTYPES:
        check_dequant(dequant(variant, mx, out), ws, wq, BS, elem, f"dequant dim1 {dname(out)} {variant}")


@variant_p
@combo_p
@pytest.mark.parametrize("axis", [-1, -2])
def test_expert_weights_gpu(variant, combo, axis):
    """(8, 125, 2048) along K and (8, 2048, 125) along N."""
    mode, elem, dtype = combo
    E, inner = 8, ROWS // 8
    g32 = data(ROWS, BS, mode, elem, dtype, "full", 0, NB)
    C = g32.shape[1]
    g3 = g32.reshape(E, inner, C)
    x = to_torch(g3 if axis == -1 else g3.transpose(0, 2, 1), dtype, DEVICE)
    mx = cast(variant, x, axis, mode, elem)
    assert tuple(mx.qdata_blocked.shape) == (E, inner, C) and mx.qdata_blocked.is_contiguous()
    check_quant(mx.scale_blocked.reshape(ROWS, -1), mx.qdata_blocked.reshape(ROWS, C), g32, BS, mode, elem,
                f"3d axis={axis} {variant}", want(ROWS, mode, elem, dtype, False))


@variant_p
@combo_p
@pytest.mark.parametrize("orient", ["rows", "cols"])
def test_fused_gpu(variant, combo, orient):
    mode, elem, dtype = combo
    g32 = data(1024, BS, mode, elem, dtype, "full", 0, NB)
    x32 = g32 if orient == "rows" else np.ascontiguousarray(g32.T)
    m0, m1 = cast_fused(variant, to_torch(x32, dtype, DEVICE), mode, elem)
    tr = orient == "cols"
    check_quant(m0.scale_blocked, m0.qdata_blocked, x32, BS, mode, elem, f"fused dim0 {variant}",
                want(1024, mode, elem, dtype, tr))
    check_quant(m1.scale_blocked, m1.qdata_blocked, np.ascontiguousarray(x32.T), BS, mode, elem,
                f"fused dim1 {variant}", want(1024, mode, elem, dtype, not tr))


@variant_p
@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
def test_noncontiguous_and_odd_shapes_gpu(variant, dtype):
    """Transposed views, slices, odd row counts and block sizes 16/64 on the GPU."""
    g32 = data(130, BS, "rceil", torch.float8_e4m3fn, dtype, "full", 3, 16)
    R, C = g32.shape
    wide = np.concatenate([g32, g32[::-1]], axis=1)
    wt = to_torch(wide, dtype, DEVICE)
    cases = [
        (to_torch(g32, dtype, DEVICE).t(), 0, g32),  # quantized axis innermost: read in place
        (to_torch(g32.T, dtype, DEVICE).t(), -1, g32),
        (wt[:, ::2], -1, np.ascontiguousarray(wide[:, ::2])),
        (wt[:, BS : BS + C], -1, np.ascontiguousarray(wide[:, BS : BS + C])),
        (to_torch(g32[:1], dtype, DEVICE), -1, np.ascontiguousarray(g32[:1])),
        (to_torch(g32[:3].T, dtype, DEVICE), 0, np.ascontiguousarray(g32[:3])),
        (to_torch(g32[:33].T, dtype, DEVICE), 0, np.ascontiguousarray(g32[:33])),
    ]
    for mode in MODES:
        for elem in ELEMS:
            for x, axis, blocks in cases:
                mx = cast(variant, x, axis, mode, elem)
                check_quant(mx.scale_blocked, mx.qdata_blocked, blocks, BS, mode, elem,
                            f"noncontig axis={axis} {tuple(x.shape)} {mode} {variant}")
            for bs in (16, 64):
                g = data(128, bs, mode, elem, dtype, "full", 4, 32)
                mx = cast(variant, to_torch(g, dtype, DEVICE), -1, mode, elem, bs)
                check_quant(mx.scale_blocked, mx.qdata_blocked, g, bs, mode, elem, f"bs={bs} dim0 {variant}")
                mx = cast(variant, to_torch(g.T, dtype, DEVICE), 0, mode, elem, bs)
                check_quant(mx.scale_blocked, mx.qdata_blocked, g, bs, mode, elem, f"bs={bs} dim1 {variant}")
                m0, m1 = cast_fused(variant, to_torch(g, dtype, DEVICE), mode, elem, bs)
                check_quant(m1.scale_blocked, m1.qdata_blocked, np.ascontiguousarray(g.T), bs, mode, elem,
                            f"bs={bs} fused dim1 {variant}")


@variant_p
@pytest.mark.parametrize("elem", ELEMS, ids=dname)
def test_dequantize_every_byte_gpu(variant, elem):
    rows = np.arange(256)
    sb = ((rows[:, None] + 37 * np.arange(256 // BS)[None, :]) % 256).astype(np.uint8)
    qb = np.tile(np.arange(256, dtype=np.uint8), (256, 1))
    mx = MXTensor(torch.from_numpy(qb).view(elem).to(DEVICE),
                  torch.from_numpy(sb).view(torch.float8_e8m0fnu).to(DEVICE), axis=1, block_size=BS)
    for out in DTYPES:
        check_dequant(dequant(variant, mx, out), sb, qb, BS, elem, f"every byte {dname(out)} {variant}")


def test_all_gpu_variants_agree_on_nan_inf():
    """Non-finite blocks: every variant writes scale 0xFF and elements 0x7F, nothing else differs."""
    from tests.quant.test_casts import _nonfinite_data

    for dtype in DTYPES:
        x32, mask = _nonfinite_data(dname(dtype))
        x = to_torch(x32, dtype, DEVICE)
        for mode in MODES:
            for elem in ELEMS:
                ref = None
                for variant in VARIANTS:
                    mx = cast(variant, x, -1, mode, elem)
                    s, q = ubytes(mx.scale_blocked), ubytes(mx.qdata_blocked)
                    assert np.all(s[mask] == 0xFF) and np.all(q.reshape(8, 8, BS)[mask] == 0x7F), variant
                    if ref is None:
                        ref = (s, q)
                    assert np.array_equal(s, ref[0]) and np.array_equal(q, ref[1]), variant


@combo_p
def test_torch_backend_inductor_compiled_gpu(combo):
    """torch_cast's fused, 3D dim1 and dequantize compiled by inductor (fullgraph, one graph per
    combo) == the oracle: the Triton code inductor generates must keep subnormals, ties and NaNs."""
    mode, elem, dtype = combo
    spec = make_spec(BS, mode, elem)
    g32 = data(1024, BS, mode, elem, dtype, "full", 0, NB)
    E = 8

    def fn(x, x3):
        q0, s0, q1, s1 = torch_cast.quantize_dim0_dim1(x, spec)
        q3, s3 = torch_cast.quantize_dim1(x3, spec)
        y16 = torch_cast.dequantize(q0, s0, BS, torch.bfloat16)
        y32 = torch_cast.dequantize(q1, s1, BS, torch.float32)
        u8 = torch.uint8
        return q0, s0.view(u8), q1, s1.view(u8), q3, s3.view(u8), y16, y32

    torch._dynamo.reset()
    x = to_torch(g32, dtype, DEVICE)
    x3 = to_torch(g32.reshape(E, 1024 // E, -1).transpose(0, 2, 1), dtype, DEVICE)  # (E, C, 128)
    q0, s0, q1, s1, q3, s3, y16, y32 = torch.compile(fn, fullgraph=True)(x, x3)
    e8 = torch.float8_e8m0fnu
    w, wt = want(1024, mode, elem, dtype, False), want(1024, mode, elem, dtype, True)
    check_quant(s0.view(e8), q0, g32, BS, mode, elem, "inductor fused dim0", w)
    check_quant(s1.view(e8), q1, np.ascontiguousarray(g32.T), BS, mode, elem, "inductor fused dim1", wt)
    check_quant(s3.view(e8).reshape(1024, -1), q3.reshape(1024, -1), g32, BS, mode, elem, "inductor 3d dim1",
                w)
    check_dequant(y16, *w, BS, elem, "inductor dequantize bf16")
    check_dequant(y32, *wt, BS, elem, "inductor dequantize fp32")


@pytest.mark.parametrize("kernel", ["torch", "triton", "cuda"])
def test_no_graph_breaks_gpu(kernel):
    r = recipe_for(kernel)

    def fn(x):
        a = to_mx(x, recipe=r)
        b = to_mx(x, axis=0, recipe=r)
        c0, c1 = to_mx_dim0_dim1(x, recipe=r)
        return a.dequantize(recipe=r), b.dequantize(recipe=r), c1.dequantize(recipe=r)

    torch._dynamo.reset()
    x = torch.randn(256, 512, dtype=torch.bfloat16, device=DEVICE)
    explanation = torch._dynamo.explain(fn)(x)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    y = torch.compile(fn, fullgraph=True)(x)
    ye = fn(x)
    for a, b in zip(y, ye, strict=True):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.parametrize("kernel", ["torch", "triton", "cuda"])
def test_random_problems_gpu(kernel):
    """The Hypothesis properties of test_cast_properties.py, on the GPU."""
    from tests.quant import test_cast_properties as P

    P.check_random_problems(kernel, DEVICE, 200)
    P.check_round_trip(kernel, DEVICE, 200)


def test_auto_picks_per_cast_and_matches_torch():
    """kernel='auto' on the H200: CUDA for every cast (the cuda backend's auto_rank: its C++ operators'
    host cost decides), each result bit-identical to the torch backend's."""
    from mxmoe.quant import backends as kernels

    dev = torch.device("cuda")
    got = {c: kernels.resolve_kernel("auto", dev, c) for c in kernels.CASTS}
    assert got == {"dim0": "cuda", "dim1": "cuda", "dim0_dim1": "cuda", "dequant": "cuda"}
    x = torch.randn(256, 320, device="cuda", dtype=torch.bfloat16) * 3
    auto, ref = recipe_for("auto"), recipe_for("torch")
    for axis in (-1, 0):
        a, t = to_mx(x, axis=axis, recipe=auto), to_mx(x, axis=axis, recipe=ref)
        assert torch.equal(a.qdata.view(torch.uint8), t.qdata.view(torch.uint8))
        assert torch.equal(a.scale.view(torch.uint8), t.scale.view(torch.uint8))
        assert torch.equal(a.dequantize(recipe=auto), t.dequantize(recipe=ref))
    for a, t in zip(to_mx_dim0_dim1(x, recipe=auto), to_mx_dim0_dim1(x, recipe=ref), strict=True):
        assert torch.equal(a.qdata.view(torch.uint8), t.qdata.view(torch.uint8))
        assert torch.equal(a.scale.view(torch.uint8), t.scale.view(torch.uint8))
