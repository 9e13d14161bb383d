"""Bit-exactness of every CPU cast backend against the NumPy oracle (tests/quant/oracle.py).

Parametrized over `mxmoe.available_kernels("cpu")`: `torch`, and `triton` through the Triton
interpreter (TRITON_INTERPRET=1, set by tests/conftest.py) — a backend listed there whose module is
missing fails here. Triton runs on smaller data (`helpers.level`) because the interpreter is slow.
The same checks run on CUDA in test_casts_gpu.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import recipe_for

import mxmoe
from mxmoe.quant import MXTensor, to_mx, to_mx_dim0_dim1
from tests.quant import cases as D
from tests.quant import oracle as O
from tests.quant.helpers import (
    COMBOS,
    DTYPES,
    ELEMS,
    MODES,
    assert_bytes,
    check_dequant,
    check_quant,
    combos,
    data,
    dname,
    level,
    to_torch,
    ubytes,
)

KERNELS = mxmoe.available_kernels("cpu")
BS = 32
# the Triton interpreter evaluates x * 2^-e in NumPy on NaN/Inf blocks too (results are masked)
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")


def combo_id(c) -> str:
    m, e, d = c
    return f"{m}-{dname(e).removeprefix('float8_')}-{dname(d)}"


kernel_p = pytest.mark.parametrize("kernel", KERNELS)
combo_p = pytest.mark.parametrize("combo", COMBOS, ids=[combo_id(c) for c in COMBOS])


def _storage_ok(mx: MXTensor, shape, what: str) -> None:
    nb = (*shape[:-1], shape[-1] // mx.block_size)
    assert tuple(mx.qdata_blocked.shape) == tuple(shape), f"{what}: qdata_blocked {mx.qdata_blocked.shape}"
    assert tuple(mx.scale_blocked.shape) == nb, f"{what}: scale_blocked {mx.scale_blocked.shape}"
    assert mx.qdata_blocked.is_contiguous() and mx.scale_blocked.is_contiguous(), what


def test_available_kernels_cpu():
    assert KERNELS[0] == "torch"
    assert "cuda" not in KERNELS
    assert set(KERNELS) <= {"torch", "triton"}


@kernel_p
@combo_p
def test_dim0(kernel, combo):
    mode, elem, dtype = combo
    x32 = data(33, BS, mode, elem, dtype, level(kernel))
    x = to_torch(x32, dtype)
    mx = to_mx(x, axis=-1, recipe=recipe_for(kernel, scaling_mode=mode, elem_dtype=elem, block_size=BS))
    assert mx.axis == 1 and mx.orig_dtype == dtype and mx.scaling_mode == mode
    _storage_ok(mx, x32.shape, "dim0")
    ws, wq = check_quant(mx.scale_blocked, mx.qdata_blocked, x32, BS, mode, elem, f"dim0 {kernel}")
    assert_bytes(mx.qdata, wq, "dim0 logical qdata")
    assert_bytes(mx.scale, ws, "dim0 logical scale")


@kernel_p
@combo_p
def test_dim1(kernel, combo):
    """x (C, 33) along axis 0: storage (33, C) contiguous, logical views are its .t()."""
    mode, elem, dtype = combo
    g32 = data(33, BS, mode, elem, dtype, level(kernel))
    x = to_torch(g32.T, dtype)
    assert x.is_contiguous()
    mx = to_mx(x, axis=0, recipe=recipe_for(kernel, scaling_mode=mode, elem_dtype=elem, block_size=BS))
    assert mx.axis == 0
    _storage_ok(mx, g32.shape, "dim1")
    ws, wq = check_quant(mx.scale_blocked, mx.qdata_blocked, g32, BS, mode, elem, f"dim1 {kernel}")
    assert tuple(mx.qdata.shape) == tuple(x.shape)
    assert tuple(mx.scale.shape) == (x.shape[0] // BS, x.shape[1])
    assert_bytes(mx.qdata, wq.T, "dim1 logical qdata")
    assert_bytes(mx.scale, ws.T, "dim1 logical scale")


@kernel_p
@combo_p
@pytest.mark.parametrize("axis", [-1, -2])
def test_expert_weights_3d(kernel, combo, axis):
    """(E, N, K) expert weights along K (axis=-1, storage (E, N, K)) and along N (axis=-2, storage
    (E, K, N), logical views transposed)."""
    mode, elem, dtype = combo
    E, inner = 3, 11
    g32 = data(E * inner, BS, mode, elem, dtype, level(kernel))  # rows (e, n) or (e, k)
    C = g32.shape[1]
    if axis == -1:
        x = to_torch(g32.reshape(E, inner, C), dtype)  # (E, N=11, K=C)
    else:
        x = to_torch(g32.reshape(E, inner, C).transpose(0, 2, 1), dtype)  # (E, N=C, K=11)
    mx = to_mx(x, axis=axis, recipe=recipe_for(kernel, scaling_mode=mode, elem_dtype=elem, block_size=BS))
    assert mx.axis == x.ndim + axis
    _storage_ok(mx, (E, inner, C), f"3d axis={axis}")
    ws, wq = check_quant(
        mx.scale_blocked.reshape(E * inner, -1), mx.qdata_blocked.reshape(E * inner, C), g32, BS, mode,
        elem, f"3d axis={axis} {kernel}",
    )
    assert tuple(mx.qdata.shape) == tuple(x.shape)
    ws3, wq3 = ws.reshape(E, inner, -1), wq.reshape(E, inner, C)
    if axis == -2:
        ws3, wq3 = ws3.transpose(0, 2, 1), wq3.transpose(0, 2, 1)
    assert_bytes(mx.qdata, wq3, "3d logical qdata")
    assert_bytes(mx.scale, ws3, "3d logical scale")


@kernel_p
@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
def test_one_and_four_dims(kernel, dtype):
    """1D x (axis -1) and 4D x (2, 2, n, C) along either of the last two dims (row-major: the dim1
    kernel over 4 matrices): the backends take the leading dims as they come, bit for bit."""
    for mode, elem, dt in combos(kernel):
        if dt != dtype:
            continue
        g32 = data(8, BS, mode, elem, dtype, level(kernel), seed=7)  # (8, C)
        C = g32.shape[1]
        mx = to_mx(to_torch(g32[0], dtype), -1, recipe=recipe_for(kernel, scaling_mode=mode, elem_dtype=elem))
        _storage_ok(mx, (C,), "1d")
        check_quant(mx.scale_blocked[None], mx.qdata_blocked[None], g32[:1], BS, mode, elem, f"1d {kernel}")
        g4 = g32.reshape(2, 2, 2, C)
        for axis, x32 in ((-1, g4), (-2, g4.transpose(0, 1, 3, 2))):  # storage (2, 2, 2, C) both ways
            r = recipe_for(kernel, scaling_mode=mode, elem_dtype=elem)
            mx = to_mx(to_torch(x32, dtype), axis, recipe=r)
            _storage_ok(mx, (2, 2, 2, C), f"4d axis={axis}")
            check_quant(mx.scale_blocked.reshape(8, -1), mx.qdata_blocked.reshape(8, C), g32, BS, mode, elem,
                        f"4d axis={axis} {kernel}")
            assert tuple(mx.qdata.shape) == x32.shape


@kernel_p
@combo_p
@pytest.mark.parametrize("orient", ["rows", "cols"])
def test_dim0_dim1_fused(kernel, combo, orient):
    """to_mx_dim0_dim1 == the oracle along both axes; orient says along which axis the special
    blocks lie (the other axis mixes them)."""
    mode, elem, dtype = combo
    g32 = data(64, BS, mode, elem, dtype, level(kernel))
    x32 = np.ascontiguousarray(g32 if orient == "rows" else g32.T)
    x = to_torch(x32, dtype)
    m0, m1 = to_mx_dim0_dim1(x, recipe=recipe_for(kernel, scaling_mode=mode, elem_dtype=elem, block_size=BS))
    assert (m0.axis, m1.axis) == (1, 0)
    R, C = x32.shape
    _storage_ok(m0, (R, C), "fused dim0")
    _storage_ok(m1, (C, R), "fused dim1")
    check_quant(m0.scale_blocked, m0.qdata_blocked, x32, BS, mode, elem, f"fused dim0 {kernel}")
    ws, wq = check_quant(
        m1.scale_blocked, m1.qdata_blocked, np.ascontiguousarray(x32.T), BS, mode, elem,
        f"fused dim1 {kernel}",
    )
    assert_bytes(m1.qdata, wq.T, "fused dim1 logical qdata")
    assert_bytes(m1.scale, ws.T, "fused dim1 logical scale")


@kernel_p
@combo_p
@pytest.mark.parametrize("cast", ["dim0", "dim1"])
def test_dequantize(kernel, combo, cast):
    """MXTensor.dequantize to bf16 and fp32 == oracle_dequantize of the tensor's own bytes, in the
    logical layout; the default dtype is the input's."""
    mode, elem, dtype = combo
    g32 = data(33, BS, mode, elem, dtype, level(kernel))
    x = to_torch(g32 if cast == "dim0" else g32.T, dtype)
    r = recipe_for(kernel, scaling_mode=mode, elem_dtype=elem, block_size=BS)
    mx = to_mx(x, axis=-1 if cast == "dim0" else 0, recipe=r)
    sb, qb = ubytes(mx.scale_blocked), ubytes(mx.qdata_blocked)
    for out in (torch.bfloat16, torch.float32):
        y = mx.dequantize(out, recipe=recipe_for(kernel))
        assert y.dtype == out and tuple(y.shape) == tuple(x.shape)
        yb = y if cast == "dim0" else y.t()  # back to the storage layout
        check_dequant(yb, sb, qb, BS, elem, f"dequantize {cast} -> {dname(out)} {kernel}")
    assert mx.dequantize(recipe=recipe_for(kernel)).dtype == dtype


@kernel_p
@pytest.mark.parametrize("elem", ELEMS, ids=dname)
@pytest.mark.parametrize("out", DTYPES, ids=dname)
def test_dequantize_every_byte(kernel, elem, out):
    """Every (scale byte, element byte) pair, including scale 0 (2^-127), 254 (2^127: overflows to
    inf for large elements), 0xFF (NaN), NaN codes and e5m2 Inf codes."""
    rows = np.arange(256) if kernel == "torch" else np.array([0, 1, 2, 20, 100, 127, 128, 200, 253, 254, 255])
    nblk = 256 // BS
    sb = ((rows[:, None] + 37 * np.arange(nblk)[None, :]) % 256).astype(np.uint8)
    qb = np.tile(np.arange(256, dtype=np.uint8), (len(rows), 1))
    mx = MXTensor(
        torch.from_numpy(qb).view(elem), torch.from_numpy(sb).view(torch.float8_e8m0fnu), axis=1,
        block_size=BS,
    )
    check_dequant(mx.dequantize(out, recipe=recipe_for(kernel)), sb, qb, BS, elem, f"every byte {kernel}")


def _check_all_combos(kernel, x_t: torch.Tensor, x_blocks32: np.ndarray, axis: int, what: str, bs: int = BS,
                      storage_shape=None):
    """Quantize x_t along axis for every combo of this kernel and compare the storage with the oracle
    on x_blocks32 (float32 (rows, C), blocks along the last axis, rows = storage rows)."""
    for mode, elem, dtype in combos(kernel):
        if x_t.dtype != dtype:
            continue
        r = recipe_for(kernel, scaling_mode=mode, elem_dtype=elem, block_size=bs)
        mx = to_mx(x_t, axis=axis, recipe=r)
        shape = storage_shape or x_blocks32.shape
        _storage_ok(mx, shape, what)
        C = x_blocks32.shape[1]
        check_quant(mx.scale_blocked.reshape(-1, C // bs), mx.qdata_blocked.reshape(-1, C), x_blocks32, bs,
                    mode, elem, f"{what} {mode} {dname(elem)} {kernel}")


@kernel_p
@pytest.mark.parametrize("rows", [1, 3, 33, 130])
@pytest.mark.parametrize("cast", ["dim0", "dim1"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
def test_odd_row_counts(kernel, rows, cast, dtype):
    """Row (dim0) / column (dim1) counts that are not multiples of anything."""
    lvl = level(kernel)
    g32 = data(rows, BS, "rceil", torch.float8_e4m3fn, dtype, lvl, seed=rows)
    if kernel == "triton" and lvl == "small":
        g32 = g32[:, : 4 * BS]
    if cast == "dim0":
        _check_all_combos(kernel, to_torch(g32, dtype), g32, -1, f"rows={rows}")
    else:
        _check_all_combos(kernel, to_torch(g32.T, dtype), np.ascontiguousarray(g32), 0, f"cols={rows}")


def _noncontig_cases(g32: np.ndarray, dtype):
    """(name, x tensor, axis, float32 blocks matrix of the storage, storage shape) for non-contiguous
    inputs built from g32 (R, C), blocks along its last axis."""
    R, C = g32.shape
    gt = to_torch(g32, dtype)
    wide = np.concatenate([g32, g32[::-1]], axis=1)  # (R, 2C)
    wt = to_torch(wide, dtype)
    out = [
        # transposed view whose quantized axis is innermost in memory: read in place
        ("t-view axis0", gt.t(), 0, g32, (R, C)),
        # transposed view quantized along its strided axis
        ("t-view axis-1", to_torch(g32.T, dtype).t(), -1, g32, (R, C)),
        # every other column: strided innermost dim
        ("col-step slice", wt[:, ::2], -1, np.ascontiguousarray(wide[:, ::2]), (R, C)),
        # a column window (row stride 2C) and a row window
        ("col-window", wt[:, BS : BS + C], -1, np.ascontiguousarray(wide[:, BS : BS + C]), (R, C)),
        ("row-window axis0", to_torch(wide.T, dtype)[BS : BS + C], 0,
         np.ascontiguousarray(wide[:, BS : BS + C]), (R, C)),
    ]
    if R % 3 == 0:
        E = 3
        g3 = g32.reshape(E, R // E, C)
        # permuted 3D views (E, C, R/E) whose axis -2 is innermost in memory, and the reverse
        out.append(("3d permuted axis-2", to_torch(g3, dtype).permute(0, 2, 1), -2, g32, (E, R // E, C)))
        out.append(("3d permuted axis-1", to_torch(g3.transpose(0, 2, 1), dtype).permute(0, 2, 1), -1, g32,
                    (E, R // E, C)))
    return out


@kernel_p
@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
def test_noncontiguous_inputs(kernel, dtype):
    g32 = data(33, BS, "even", torch.float8_e5m2, dtype, level(kernel), seed=5)
    if kernel == "triton" and level(kernel) == "small":
        g32 = g32[:, : 4 * BS]
    for name, x, axis, blocks, shape in _noncontig_cases(g32, dtype):
        assert not x.is_contiguous() or name.startswith("row-window"), name
        _check_all_combos(kernel, x, blocks, axis, name, storage_shape=shape)


@kernel_p
@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
def test_fused_noncontiguous(kernel, dtype):
    g32 = data(64, BS, "floor", torch.float8_e4m3fn, dtype, level(kernel), seed=6)
    x = to_torch(g32.T, dtype).t()  # (64, C) transposed view
    for mode, elem, dt in combos(kernel):
        if dt != dtype:
            continue
        m0, m1 = to_mx_dim0_dim1(x, recipe=recipe_for(kernel, scaling_mode=mode, elem_dtype=elem))
        check_quant(m0.scale_blocked, m0.qdata_blocked, g32, BS, mode, elem, "fused t-view dim0")
        check_quant(m1.scale_blocked, m1.qdata_blocked, np.ascontiguousarray(g32.T), BS, mode, elem,
                    "fused t-view dim1")


@kernel_p
@pytest.mark.parametrize("bs", [2, 16, 64, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
def test_other_block_sizes(kernel, bs, dtype):
    """Block sizes other than 32: dim0, dim1, 3D along -2, fused, and dequantize."""
    lvl = level(kernel)
    g32 = data(64 if bs <= 64 else 128, bs, "ceil", torch.float8_e4m3fn, dtype, lvl, seed=bs)
    if kernel == "triton" and lvl == "small":
        g32 = g32[:, : max(4, 256 // bs) * bs]
    R, C = g32.shape
    x = to_torch(g32, dtype)
    for mode, elem, dt in combos(kernel):
        if dt != dtype:
            continue
        what = f"bs={bs} {mode} {dname(elem)} {kernel}"
        r = recipe_for(kernel, scaling_mode=mode, elem_dtype=elem, block_size=bs)
        mx = to_mx(x, axis=-1, recipe=r)
        ws, wq = check_quant(mx.scale_blocked, mx.qdata_blocked, g32, bs, mode, elem, f"dim0 {what}")
        check_dequant(mx.dequantize(torch.float32, recipe=r), ws, wq, bs, elem, f"dequant {what}")
        mx = to_mx(to_torch(g32.T, dtype), axis=0, recipe=r)
        check_quant(mx.scale_blocked, mx.qdata_blocked, g32, bs, mode, elem, f"dim1 {what}")
        x3 = to_torch(g32.reshape(2, R // 2, C).transpose(0, 2, 1), dtype)
        mx = to_mx(x3, axis=-2, recipe=r)
        check_quant(mx.scale_blocked.reshape(R, -1), mx.qdata_blocked.reshape(R, C), g32, bs, mode, elem,
                    f"3d axis=-2 {what}")
        m0, m1 = to_mx_dim0_dim1(x, recipe=r)
        check_quant(m0.scale_blocked, m0.qdata_blocked, g32, bs, mode, elem, f"fused dim0 {what}")
        check_quant(m1.scale_blocked, m1.qdata_blocked, np.ascontiguousarray(g32.T), bs, mode, elem,
                    f"fused dim1 {what}")


def _nonfinite_data(dtype: str, bs: int = BS) -> tuple[np.ndarray, np.ndarray]:
    """float32 (8, 8*bs) where about half the blocks hold NaN (several payloads) or +-Inf among
    normal, zero, subnormal or huge values; and the (8, 8) mask of those blocks."""
    rng = np.random.default_rng(7)
    x = D.random_blocks(64, bs, dtype, rng, -130, 126).reshape(8, 8, bs)
    x[1, :, :] = 0.0
    x[2, :, :] = D.from_bits(np.uint32(D.STEP[dtype]) * np.uint32(3))  # subnormal
    x[3, :, :] = D.max_finite(dtype)
    specials = [D.from_bits(p) for p in D.NAN_BITS[dtype]] + [np.float32(np.inf), np.float32(-np.inf)]
    mask = rng.random((8, 8)) < 0.5
    for r, c in np.argwhere(mask):
        for _ in range(rng.integers(1, 4)):
            x[r, c, rng.integers(bs)] = specials[rng.integers(len(specials))]
    return np.ascontiguousarray(x.reshape(8, 8 * bs)), mask


@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
def test_nonfinite_all_kernels_agree(dtype):
    """NaN/+-Inf blocks: scale 0xFF, every element 0x7F, dequantized to NaN, identical in every
    available kernel (and the others untouched)."""
    x32, mask = _nonfinite_data(dname(dtype))
    x = to_torch(x32, dtype)
    results = {}
    for kernel in KERNELS:
        for mode in MODES:
            for elem in ELEMS:
                mx = to_mx(x, recipe=recipe_for(kernel, scaling_mode=mode, elem_dtype=elem))
                s, q = ubytes(mx.scale_blocked), ubytes(mx.qdata_blocked).reshape(8, 8, BS)
                assert np.all(s[mask] == 0xFF) and np.all(q[mask] == 0x7F), (kernel, mode)
                assert np.all(s[~mask] != 0xFF), (kernel, mode)
                check_quant(mx.scale_blocked, mx.qdata_blocked, x32, BS, mode, elem, f"nonfinite {kernel}")
                y = mx.dequantize(torch.float32, recipe=recipe_for(kernel)).reshape(8, 8, BS)
                assert torch.isnan(y[torch.from_numpy(mask)]).all()
                assert not torch.isnan(y[torch.from_numpy(~mask)]).any()
                results.setdefault((mode, elem), []).append((kernel, s, q))
    for runs in results.values():
        for kernel, s, q in runs[1:]:
            assert np.array_equal(s, runs[0][1]) and np.array_equal(q, runs[0][2]), kernel


@kernel_p
def test_named_classes(kernel):
    """A few hand-checked e4m3 blocks of 2, spelled out as a readable anchor next to the oracle."""
    x = torch.tensor(
        [[0.0, -0.0, 448.0, 1.0, 480.0, 1.0, 3.0 * 2**-134, 2.0**-140]], dtype=torch.float32
    ).repeat(3, 1)
    mx = to_mx(x, recipe=recipe_for(kernel, scaling_mode="floor", block_size=2))
    # zeros: scale byte 0 (2^-127), +0 / -0 kept. amax 448: e = 8 - 8 = 0 (byte 127), 1.0 = 0x38.
    # amax 480: FLOOR e = 0, 480 saturates to 448 (0x7E). fp32 subnormals: e clamps to -127,
    # 3*2^-134 * 2^127 = 1.5*2^-6 (0x0C), 2^-140 * 2^127 = 2^-13 underflows to +0.
    assert ubytes(mx.scale_blocked)[0].tolist() == [0, 127, 127, 0]
    assert ubytes(mx.qdata_blocked)[0].tolist() == [0x00, 0x80, 0x7E, 0x38, 0x7E, 0x38, 0x0C, 0x00]
    mx = to_mx(x, recipe=recipe_for(kernel, scaling_mode="rceil", block_size=2))
    # RCEIL: 448 * fp32(1/448) == 1 exactly (byte 127); 480 -> descale > 1 -> e = 1 (byte 128):
    # 480 / 2 = 240 (0x77), 1 / 2 (0x30); the subnormal block's descale is ~2^-141.6 -> e = -127.
    assert ubytes(mx.scale_blocked)[0].tolist() == [0, 127, 128, 0]
    assert ubytes(mx.qdata_blocked)[0].tolist() == [0x00, 0x80, 0x7E, 0x38, 0x77, 0x30, 0x0C, 0x00]
    s, q = O.oracle_quantize(x.numpy(), 2, "rceil", "float8_e4m3fn")
    assert s[0].tolist() == [0, 127, 128, 0] and q[0].tolist()[4:6] == [0x77, 0x30]


def test_profiler_shows_the_casts_by_op_name():
    """Under the profiler each eager cast runs inside a range named like its custom op."""
    x = torch.ones(64, 64)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        mx = to_mx(x, 0, recipe=recipe_for("torch"))
        to_mx(x, -1, recipe=recipe_for("torch"))
        to_mx_dim0_dim1(x, recipe=recipe_for("torch"))
        mx.dequantize(recipe=recipe_for("torch"))
    names = {e.name for e in prof.events()}
    assert {"mxmoe::quantize_dim0", "mxmoe::quantize_dim1", "mxmoe::quantize_dim0_dim1",
            "mxmoe::dequantize"} <= names
