"""The CUDA qdq kernels (the C++ operators `mxmoe_cuda::qdq_dim0`, `qdq_dim1`, `qdq_dim0_dim1`,
csrc/mx_qdq.cu) and which kernel a qdq call picks.

CPU tests: the dispatch (`backends.cast_kernel` for the qdq casts, and the kernel the public calls hand
to the op, traced on fake CUDA tensors). GPU tests (marked gpu): the operator against the NumPy oracle
on every input class of tests/quant/cases.py, every scale mode x element format x input dtype x output
dtype, and bit for bit against the CUDA cast followed by the CUDA dequantize (`to_mx` and `dequantize`
with a recipe naming "cuda", NaN payloads included) and against the Triton qdq (NaN where NaN); odd
shapes, other block sizes and misaligned inputs (the generic kernel), more than 2^31 elements,
argument errors, the out variant and torch.compile(fullgraph=True). The dim1 and dim0+dim1
operators, without and with expert groups (offs): the oracle on every input class and
combination, the Triton rows kernel and the torch backend (NaN where NaN); short last blocks, 3D /
4D x (blocks per matrix), empty and ragged groups, rows after the last group, odd shapes, other
block sizes and misaligned pointers (the generic kernels), more than 2^31 elements, argument
errors, the fake implementations and torch.compile(fullgraph=True).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import assert_same_bits, recipe_for

import mxmoe.quant.qdq as qdq_mod
from mxmoe.formats import get_format
from mxmoe.quant.backends import cast_kernel
from mxmoe.quant.qdq import qdq, qdq_dim0_dim1
from mxmoe.recipe import MXRecipe
from tests.quant import oracle as O
from tests.quant.helpers import COMBOS, DTYPES, check_dequant, data, dname, to_f32_numpy, to_torch
from tests.quant.test_qdq import COUNTS, TAIL, check_values, grouped_rows, offs_of, oracle_rows

BS = 32
CUDA = torch.device("cuda")
CPU = torch.device("cpu")


def recipe(kernel: str, mode: str = "rceil", elem=torch.float8_e4m3fn, bs: int = BS, dim1: str | None = None):
    return MXRecipe(scaling_mode=mode, elem_dtype=elem, block_size=bs, dim0_kernel=kernel,
                    dim1_kernel=kernel if dim1 is None else dim1)


# ------------------------------------------------------------------------------------------------
# CPU: dispatch


@pytest.fixture
def cuda_available(as_on_a_gpu):
    """Kernel choices as on a GPU machine whose extension builds; load_extension recorded."""
    return as_on_a_gpu()


def test_qdq_kernel_takes_cuda_where_an_operator_covers_the_call(cuda_available):
    for cast in ("qdq_dim0", "qdq_dim1"):
        for k in ("cuda", "auto"):
            cuda_available.clear()
            assert cast_kernel(recipe(k), CUDA, cast) == "cuda"
            assert cuda_available  # the extension is loaded before the op is called
    # dim0 alone with offs: the Triton rows kernel (cuda_cast.STAND_INS)
    assert cast_kernel(recipe("cuda"), CUDA, "qdq_dim0_offs") == "triton"
    assert cast_kernel(recipe("auto"), CUDA, "qdq_dim0_offs") == "triton"
    # explicit choices and CPU tensors are unchanged
    assert cast_kernel(recipe("triton"), CUDA, "qdq_dim1") == "triton"
    assert cast_kernel(recipe("torch"), CUDA, "qdq_dim1") == "torch"
    assert cast_kernel(recipe("auto"), CPU, "qdq_dim1") == "torch"
    # each call reads its own field of the recipe
    assert cast_kernel(recipe("torch", dim1="cuda"), CUDA, "qdq_dim0") == "torch"
    assert cast_kernel(recipe("torch", dim1="cuda"), CUDA, "qdq_dim1") == "cuda"
    with pytest.raises(ValueError, match="dim0_kernel='nope' is not a cast kernel"):
        recipe("nope")
    with pytest.raises(ValueError, match="cast='qdq'; expected one of"):
        cast_kernel(recipe("cuda"), CUDA, "qdq")


def test_qdq_kernel_auto_falls_back_to_triton(as_on_a_gpu):
    """"auto" without a usable extension (its build fails, or no toolkit): Triton."""
    as_on_a_gpu(builds=False)
    assert cast_kernel(recipe("auto"), CUDA, "qdq_dim1") == "triton"
    as_on_a_gpu(cuda_reason="kernel='cuda' builds its extension on first use and needs nvcc")
    assert cast_kernel(recipe("auto"), CUDA, "qdq_dim1") == "triton"
    with pytest.raises(RuntimeError, match="recipe dim1_kernel='cuda': kernel='cuda' builds its extension"):
        cast_kernel(recipe("cuda"), CUDA, "qdq_dim1")


def test_triton_qdq_block_limit_holds_for_a_kept_answer(as_on_a_gpu):
    """The Triton qdq kernel's block-size limit is checked on every call, also where the kernel
    choice was kept from an earlier call (of a recipe with another block size)."""
    assert cast_kernel(recipe("triton"), CUDA, "qdq_dim1") == "triton"
    assert cast_kernel(recipe("triton"), CUDA, "qdq_dim1") == "triton"  # kept
    with pytest.raises(ValueError, match=r"block_size=256: .* up to 128 \(the recipe's dim1_kernel='triton'"):
        cast_kernel(recipe("triton", bs=256), CUDA, "qdq_dim1")


def test_qdq_kernel_cuda_on_cpu_tensor_raises():
    with pytest.raises(RuntimeError, match="recipe dim1_kernel='cuda': kernel='cuda' needs a CUDA tensor"):
        cast_kernel(recipe("cuda"), CPU, "qdq_dim1")


def test_public_calls_pick_the_kernel(cuda_available, monkeypatch):
    """On (fake) CUDA tensors: every call (dim0, dim1, both; 2D, 3D, 4D; dim1 and both also with
    offs) hands "cuda" to the op for the deciding kernel "cuda" / "auto", but dim0 alone with offs
    the Triton kernel."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    calls = []

    def record(*args):
        x, out_dtype, dim0, dim1, kernel = args[0], *args[2:6]
        calls.append((dim0, dim1, kernel))
        return [torch.empty(x.shape, dtype=out_dtype, device=x.device) for on in (dim0, dim1) if on]

    monkeypatch.setattr(qdq_mod, "_qdq", record)
    with FakeTensorMode():
        x = torch.empty(64, 64, dtype=torch.bfloat16, device="cuda")
        x4 = torch.empty(2, 3, 32, 64, dtype=torch.bfloat16, device="cuda")
        offs = torch.empty(2, dtype=torch.int32, device="cuda")
        for k in ("cuda", "auto"):
            r = recipe(k)
            qdq(x, -1, recipe=r)
            qdq(x4, -1, recipe=r)
            qdq(x, -1, recipe=r, offs=offs)
            qdq(x, -2, recipe=r)
            qdq(x4, -2, recipe=r)
            qdq(x, -2, recipe=r, offs=offs)
            qdq_dim0_dim1(x, recipe=r)
            qdq_dim0_dim1(x, recipe=r, offs=offs)
        qdq(x, -1, recipe=recipe("cuda", dim1="torch"))  # dim0_kernel decides dim0
        qdq(x, -2, recipe=recipe("torch", dim1="cuda"))  # dim1_kernel decides dim1 ...
        qdq_dim0_dim1(x, recipe=recipe("torch", dim1="cuda"))  # ... and both
        qdq(x, -2, recipe=recipe("cuda", dim1="torch"))
        qdq(x4.view(48, 256), -1, recipe=recipe("cuda", bs=256), out_dtype=torch.float32)  # no Triton limit
        qdq(x4.view(48, 256), -2, recipe=recipe("cuda", bs=256), out_dtype=torch.float32)
    want = [(True, False, "cuda"), (True, False, "cuda"), (True, False, "triton"), (False, True, "cuda"),
            (False, True, "cuda"), (False, True, "cuda"), (True, True, "cuda"), (True, True, "cuda")] * 2
    want += [(True, False, "cuda"), (False, True, "cuda"), (True, True, "cuda"), (False, True, "torch"),
             (True, False, "cuda"), (False, True, "cuda")]
    assert calls == want


def test_cuda_kernel_in_the_op_has_no_grouped_dim0_alone():
    offs = torch.tensor([4], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"has no grouped dim0 alone \(offs\); it takes 'triton'"):
        qdq_mod._qdq_impl(torch.empty(4, 32), get_format("mxfp8_e4m3_rceil"), torch.bfloat16, True, False,
                          "cuda", offs)


# ------------------------------------------------------------------------------------------------
# GPU


def _cuda_cast_dequant(x: torch.Tensor, r: MXRecipe, out: torch.dtype) -> torch.Tensor:
    from mxmoe.quant.mx_tensor import to_mx

    return to_mx(x, -1, recipe=r).dequantize(out, recipe=recipe_for("cuda"))


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


def _check_all(x: torch.Tensor, mode: str, elem, out: torch.dtype, what: str, bs: int = BS,
               triton: bool = True) -> torch.Tensor:
    """qdq with the cuda kernel == the CUDA cast + CUDA dequantize bit for bit (NaN payloads
    included) and (triton) == the Triton qdq (NaN where NaN); returns the cuda result."""
    rc = recipe("cuda", mode, elem, bs)
    y = qdq(x, -1, recipe=rc, out_dtype=out)
    assert y.dtype == out and y.shape == x.shape and y.is_contiguous(), what
    assert torch.equal(_bits(y), _bits(_cuda_cast_dequant(x, rc, out))), f"{what}: != cast + dequantize"
    if triton and bs <= 128:
        yt = qdq(x, -1, recipe=recipe("triton", mode, elem, bs), out_dtype=out)
        assert_same_bits(y, yt, f"{what} vs triton")
    return y


@pytest.mark.gpu
@pytest.mark.parametrize("combo", COMBOS, ids=[f"{m}-{dname(e)}-{dname(d)}" for m, e, d in COMBOS])
def test_gpu_qdq_cuda_matches_oracle(combo):
    """Every input class (magnitudes 2^-140..2^120, zero blocks, +-0, subnormals, ties, max * 2^k,
    NaN / Inf), both output dtypes: the oracle, the CUDA cast + dequantize, the Triton qdq; and the
    C++ operator is what ran (the dispatch)."""
    mode, elem, dtype = combo
    g32 = data(64, BS, mode, elem, dtype, "full")
    s0, q0 = O.oracle_quantize(g32, BS, mode, dname(elem))
    x = to_torch(g32, dtype, "cuda")
    for out in DTYPES:
        what = f"qdq cuda {mode} {dname(elem)} {dname(dtype)} -> {dname(out)}"
        y = _check_all(x, mode, elem, out, what)
        check_dequant(y, s0, q0, BS, elem, what)
        direct = torch.ops.mxmoe_cuda.qdq_dim0(x, BS, qdq_mod.MODE_IDS[mode], elem, out)
        assert torch.equal(_bits(direct), _bits(y)), what


@pytest.mark.gpu
def test_gpu_qdq_cuda_shapes():
    """One row, C = 32, many rows, 3D / 4D x, empty x, a non-contiguous x (made contiguous by qdq),
    random data over 60 binades: all against the cast + dequantize, bf16 -> bf16 RCEIL e4m3 also
    against the Triton qdq (each other Triton variant would be one more compile; the oracle test
    covers them all)."""
    torch.manual_seed(0)
    shapes = ((1, 32), (1, 7168), (5, 32), (4001, 1024), (3, 17, 96), (2, 3, 5, 64), (0, 64), (65536, 64))
    for shape in shapes:
        scale = torch.logspace(-30, 30, shape[-2], device="cuda").view(-1, 1)
        for dtype in DTYPES:
            x = (torch.randn(shape, device="cuda") * scale).to(dtype)
            for mode, elem in (("rceil", torch.float8_e4m3fn), ("floor", torch.float8_e5m2)):
                for out in DTYPES:
                    default = mode == "rceil" and dtype == out == torch.bfloat16
                    _check_all(x, mode, elem, out, f"{shape} {dname(dtype)} {mode} -> {dname(out)}",
                               triton=default)
    xt = torch.randn(64, 96, device="cuda", dtype=torch.bfloat16).t()
    _check_all(xt, "rceil", torch.float8_e4m3fn, torch.bfloat16, "transposed view")


@pytest.mark.gpu
@pytest.mark.parametrize("bs", [2, 16, 64, 256])
def test_gpu_qdq_cuda_other_block_sizes_match_oracle(bs):
    """Block sizes other than 32 take the generic kernel: the oracle and the cast + dequantize (no
    Triton compiles per block size here)."""
    for mode, elem, dtype in (("rceil", torch.float8_e4m3fn, torch.bfloat16),
                              ("even", torch.float8_e5m2, torch.float32)):
        g32 = data(2 * bs if bs > 16 else 64, bs, mode, elem, dtype, "full")
        s0, q0 = O.oracle_quantize(g32, bs, mode, dname(elem))
        x = to_torch(g32, dtype, "cuda")
        for out in DTYPES:
            y = _check_all(x, mode, elem, out, f"bs={bs} {mode}", bs, triton=False)
            check_dequant(y, s0, q0, bs, elem, f"bs={bs} {mode} -> {dname(out)}")


@pytest.mark.gpu
def test_gpu_qdq_cuda_misaligned_and_out_variant():
    """x and out at offsets that are no multiple of 16 bytes (the generic kernel), and the out
    variant writing into a slice of a larger buffer (nothing else touched)."""
    from mxmoe.formats import make_spec
    from mxmoe.quant import cuda_cast

    spec = make_spec(BS, "ceil", torch.float8_e4m3fn)
    r = recipe("cuda", "ceil")
    g32 = data(64, BS, "ceil", torch.float8_e4m3fn, torch.bfloat16, "full")
    x = to_torch(g32, torch.bfloat16, "cuda")
    R, C = x.shape
    buf = torch.empty(R * C + 1, dtype=torch.bfloat16, device="cuda")
    buf[1:] = x.reshape(-1)
    xm = buf[1:].view(R, C)  # 2-byte offset
    want = _cuda_cast_dequant(x, r, torch.float32)
    assert torch.equal(_bits(cuda_cast.qdq_dim0(xm, spec, torch.float32)), _bits(want))
    ybuf = torch.zeros(R * C + 2, dtype=torch.float32, device="cuda")
    cuda_cast.qdq_dim0(xm, spec, torch.float32, out=ybuf[1:-1].view(R, C))
    assert torch.equal(_bits(ybuf[1:-1].view(R, C)), _bits(want))
    assert bool(ybuf[0] == 0) and bool(ybuf[-1] == 0)
    y16 = torch.zeros(R, C, dtype=torch.bfloat16, device="cuda")
    cuda_cast.qdq_dim0(x, spec, torch.bfloat16, out=y16)
    assert torch.equal(_bits(y16), _bits(_cuda_cast_dequant(x, r, torch.bfloat16)))


@pytest.mark.gpu
def test_gpu_qdq_cuda_operator_checks_its_arguments():
    """The C++ operator checks in C++ and names the argument, the value and what is accepted."""
    from mxmoe.quant import cuda_cast

    cuda_cast.load_extension()
    op = torch.ops.mxmoe_cuda.qdq_dim0
    e4, bf = torch.float8_e4m3fn, torch.bfloat16
    x = torch.randn(4, 64, device="cuda", dtype=bf)
    with pytest.raises(RuntimeError, match=r"x.shape\[-1\]=64 is not divisible by block_size=128"):
        op(x, 128, 1, e4, bf)
    with pytest.raises(RuntimeError, match="block_size must be a power of two >= 2, got 24"):
        op(x, 24, 1, e4, bf)
    with pytest.raises(RuntimeError, match="mode must be 0..3"):
        op(x, 32, 4, e4, bf)
    with pytest.raises(TypeError, match="x is Half; expected BFloat16 or Float"):
        op(x.half(), 32, 1, e4, bf)
    with pytest.raises(TypeError, match="elem_dtype is"):
        op(x, 32, 1, torch.float16, bf)
    with pytest.raises(TypeError, match="out_dtype is Half"):
        op(x, 32, 1, e4, torch.float16)
    with pytest.raises(RuntimeError, match=r"x must be contiguous, got shape \(64, 4\)"):
        op(x.t(), 32, 1, e4, bf)
    with pytest.raises(RuntimeError, match=r"out must be contiguous of shape \(4, 64\)"):
        torch.ops.mxmoe_cuda.qdq_dim0_out(x, 32, 1, e4, torch.empty(4, 32, device="cuda", dtype=bf))


@pytest.mark.gpu
def test_gpu_qdq_cuda_compiles_fullgraph():
    """torch.compile(fullgraph=True): the op decomposes into the C++ operator, which inductor calls
    directly (no call back into mxmoe::qdq's Python); compiled == eager bit for bit."""
    from torch._inductor.utils import run_and_get_code

    from mxmoe.quant import cuda_cast

    cuda_cast.load_extension()
    r = recipe("cuda")
    x = torch.randn(1000, 512, device="cuda", dtype=torch.bfloat16) * 3

    w3 = torch.randn(4, 100, 512, device="cuda", dtype=torch.bfloat16)
    offs = torch.tensor([100, 100, 999], dtype=torch.int32, device="cuda")

    def f(x, w3, offs):
        return (qdq(x, -1, recipe=r), qdq(x, -1, recipe=r, out_dtype=torch.float32), qdq(x, -2, recipe=r),
                qdq(w3, -2, recipe=r), *qdq_dim0_dim1(x, recipe=r), qdq(x, -2, recipe=r, offs=offs),
                *qdq_dim0_dim1(x, recipe=r, offs=offs), qdq(x, -1, recipe=r, offs=offs))

    torch._dynamo.reset()
    got, codes = run_and_get_code(torch.compile(f, fullgraph=True), x, w3, offs)
    code = "\n".join(codes)
    for name in ("mxmoe_cuda.qdq_dim0", "mxmoe_cuda.qdq_dim1", "mxmoe_cuda.qdq_dim0_dim1", "qdq_rows_kernel"):
        assert name in code, name
    assert "torch.ops.mxmoe.qdq" not in code
    for g, e in zip(got, f(x, w3, offs), strict=True):
        assert torch.equal(_bits(g), _bits(e))


@pytest.mark.gpu
def test_gpu_qdq_cuda_beyond_2_31_elements():
    """More than 2^31 elements (64-bit vector indices): the last rows and the first rows equal the
    same kernel on small slices."""
    r = recipe("cuda")
    C = 8192
    T = 2**31 // C + 300
    x = torch.randn(T, C, device="cuda", dtype=torch.bfloat16)
    x[-1] *= 2.0**40
    y = qdq(x, -1, recipe=r)
    assert torch.equal(_bits(y[-400:]), _bits(qdq(x[-400:], -1, recipe=r)))
    assert torch.equal(_bits(y[:64]), _bits(qdq(x[:64], -1, recipe=r)))
    tail = to_f32_numpy(x[-2:])
    s, q = O.oracle_quantize(tail, BS, "rceil", "float8_e4m3fn")
    check_dequant(y[-2:], s, q, BS, torch.float8_e4m3fn, "beyond 2^31: last rows")


# ------------------------------------------------------------------------------------------------
# GPU: dim1 and dim0+dim1 (mxmoe_cuda::qdq_dim1, qdq_dim0_dim1; no groups)


def _rows_outputs(x: torch.Tensor, r: MXRecipe, out: torch.dtype) -> list[torch.Tensor]:
    """qdq(x, -2), and for 2D and 3D x both outputs of qdq_dim0_dim1."""
    ys = [qdq(x, -2, recipe=r, out_dtype=out)]
    if x.ndim <= 3:
        ys += list(qdq_dim0_dim1(x, recipe=r, out_dtype=out))
    return ys


def _check_rows(x: torch.Tensor, mode: str, elem, out: torch.dtype, what: str, bs: int = BS,
                triton: bool = True) -> list[torch.Tensor]:
    """The cuda kernel's dim1 (and for 2D and 3D x dim0+dim1) == the torch backend and (triton) the Triton
    rows kernel, NaN where NaN; the fused dim0 output == the dim0 operator bit for bit. Returns
    [y1] or [y1, y0 fused, y1 fused]."""
    rc = recipe("cuda", mode, elem, bs)
    got = _rows_outputs(x, rc, out)
    for y in got:
        assert y.dtype == out and y.shape == x.shape and y.is_contiguous(), what
    for g, w in zip(got, _rows_outputs(x, recipe("torch", mode, elem, bs), out), strict=True):
        assert_same_bits(g, w, f"{what} vs torch")
    if triton and bs <= 128:
        for g, w in zip(got, _rows_outputs(x, recipe("triton", mode, elem, bs), out), strict=True):
            assert_same_bits(g, w, f"{what} vs triton")
    if x.ndim <= 3:
        assert torch.equal(_bits(got[1]), _bits(qdq(x, -1, recipe=rc, out_dtype=out))), f"{what}: fused dim0"
        assert torch.equal(_bits(got[2]), _bits(got[0])), f"{what}: fused dim1 != dim1"
    return got


@pytest.mark.gpu
@pytest.mark.parametrize("combo", COMBOS, ids=[f"{m}-{dname(e)}-{dname(d)}" for m, e, d in COMBOS])
def test_gpu_qdq_cuda_rows_match_oracle(combo):
    """Every input class along the rows (x = the oracle's input transposed: its blocks run down
    x's columns) and along the columns (the fused dim0), both output dtypes: the oracle, the torch
    backend, the Triton rows kernel; the C++ operators called directly give the same bits."""
    mode, elem, dtype = combo
    g32 = data(64, BS, mode, elem, dtype, "full")  # (64, C): blocks along C
    x32 = g32.T.copy()  # (C, 64): blocks of x down its columns
    s1, q1 = O.oracle_quantize(g32, BS, mode, dname(elem))
    s0, q0 = O.oracle_quantize(x32, BS, mode, dname(elem))
    x = to_torch(x32, dtype, "cuda")
    m = qdq_mod.MODE_IDS[mode]
    for out in DTYPES:
        what = f"qdq rows cuda {mode} {dname(elem)} {dname(dtype)} -> {dname(out)}"
        y1, f0, f1 = _check_rows(x, mode, elem, out, what)
        check_dequant(y1.t(), s1, q1, BS, elem, what + " dim1")
        check_dequant(f0, s0, q0, BS, elem, what + " fused dim0")
        check_dequant(f1.t(), s1, q1, BS, elem, what + " fused dim1")
        assert torch.equal(_bits(torch.ops.mxmoe_cuda.qdq_dim1(x, BS, m, elem, out)), _bits(y1)), what
        d0, d1 = torch.ops.mxmoe_cuda.qdq_dim0_dim1(x, BS, m, elem, out)
        assert torch.equal(_bits(d0), _bits(f0)) and torch.equal(_bits(d1), _bits(f1)), what


@pytest.mark.gpu
def test_gpu_qdq_cuda_rows_shapes():
    """Short last blocks (R no multiple of 32, one row), a column count that leaves a warp's unit
    part empty (C = 32, 96), wide rows (7168), 3D weights with a short last block per matrix
    (blocks never across two), 4D, empty x, a transposed view, random data over 60 binades: against
    the torch backend; bf16 -> bf16 RCEIL e4m3 also against the Triton rows kernel."""
    torch.manual_seed(0)
    shapes = ((1, 32), (5, 96), (33, 64), (100, 7168), (4001, 1024), (7, 500, 768), (3, 17, 96),
              (2, 3, 40, 64), (0, 64), (4, 0, 64), (65536, 64))
    for shape in shapes:
        scale = torch.logspace(-30, 30, max(shape[-2], 1), device="cuda").view(-1, 1)
        for dtype in DTYPES:
            x = (torch.randn(shape, device="cuda") * scale[: shape[-2]]).to(dtype)
            for mode, elem in (("rceil", torch.float8_e4m3fn), ("floor", torch.float8_e5m2)):
                for out in DTYPES:
                    default = mode == "rceil" and dtype == out == torch.bfloat16
                    _check_rows(x, mode, elem, out, f"{shape} {dname(dtype)} {mode} -> {dname(out)}",
                                triton=default)
    xt = torch.randn(64, 96, device="cuda", dtype=torch.bfloat16).t()
    _check_rows(xt, "rceil", torch.float8_e4m3fn, torch.bfloat16, "transposed view")


@pytest.mark.gpu
@pytest.mark.parametrize("bs", [2, 16, 64, 256])
def test_gpu_qdq_cuda_rows_other_block_sizes_match_oracle(bs):
    """Block sizes other than 32 take the generic dim1 kernel (the fused call: the dim0 and dim1
    operators in turn): the oracle both ways and the torch backend (no Triton compiles here)."""
    for mode, elem, dtype in (("rceil", torch.float8_e4m3fn, torch.bfloat16),
                              ("even", torch.float8_e5m2, torch.float32)):
        g32 = data(2 * bs if bs > 16 else 64, bs, mode, elem, dtype, "full")  # (n, C), n % bs == 0
        x32 = g32.T.copy()
        s1, q1 = O.oracle_quantize(g32, bs, mode, dname(elem))
        s0, q0 = O.oracle_quantize(x32, bs, mode, dname(elem))
        x = to_torch(x32, dtype, "cuda")
        for out in DTYPES:
            what = f"bs={bs} {mode} -> {dname(out)}"
            y1, f0, f1 = _check_rows(x, mode, elem, out, what, bs, triton=False)
            check_dequant(y1.t(), s1, q1, bs, elem, what + " dim1")
            check_dequant(f0, s0, q0, bs, elem, what + " fused dim0")
            check_dequant(f1.t(), s1, q1, bs, elem, what + " fused dim1")


@pytest.mark.gpu
def test_gpu_qdq_cuda_rows_misaligned():
    """x at an offset that is no multiple of 16 bytes (the generic dim1 kernel; the fused call
    falls back to the two operators): the same bits as the aligned x."""
    from mxmoe.formats import make_spec
    from mxmoe.quant import cuda_cast

    spec = make_spec(BS, "ceil", torch.float8_e4m3fn)
    g32 = data(64, BS, "ceil", torch.float8_e4m3fn, torch.bfloat16, "full")
    x = to_torch(g32.T.copy(), torch.bfloat16, "cuda")
    R, C = x.shape
    buf = torch.empty(R * C + 1, dtype=torch.bfloat16, device="cuda")
    buf[1:] = x.reshape(-1)
    xm = buf[1:].view(R, C)  # 2-byte offset
    for out in DTYPES:
        y1 = cuda_cast.qdq_dim1(x, spec, out)
        assert torch.equal(_bits(cuda_cast.qdq_dim1(xm, spec, out)), _bits(y1)), out
        a0, a1 = cuda_cast.qdq_dim0_dim1(x, spec, out)
        m0, m1 = cuda_cast.qdq_dim0_dim1(xm, spec, out)
        assert torch.equal(_bits(m0), _bits(a0)) and torch.equal(_bits(m1), _bits(a1)), out
        assert torch.equal(_bits(a1), _bits(y1)), out


@pytest.mark.gpu
def test_gpu_qdq_cuda_rows_fake_matches_real():
    """The dim1 / dim0+dim1 operators' outputs have the layout their fake implementations promise."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from mxmoe.quant import cuda_cast

    cuda_cast.load_extension()
    x = torch.randn(3, 90, 160, device="cuda", dtype=torch.bfloat16)
    args = (32, 1, torch.float8_e4m3fn, torch.float32)
    for op in (torch.ops.mxmoe_cuda.qdq_dim1, torch.ops.mxmoe_cuda.qdq_dim0_dim1):
        real = op(x, *args)
        real = [real] if isinstance(real, torch.Tensor) else list(real)
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fake = op(mode.from_tensor(x), *args)
            fake = [fake] if isinstance(fake, torch.Tensor) else list(fake)
            fake = [(t.shape, t.stride(), t.dtype) for t in fake]
        assert [(t.shape, t.stride(), t.dtype) for t in real] == fake, op


@pytest.mark.gpu
def test_gpu_qdq_cuda_rows_operators_check_their_arguments():
    """qdq_dim1 / qdq_dim0_dim1 check in C++ and name the argument, the value and what is accepted."""
    from mxmoe.quant import cuda_cast

    cuda_cast.load_extension()
    e4, bf = torch.float8_e4m3fn, torch.bfloat16
    x = torch.randn(64, 64, device="cuda", dtype=bf)
    for op in (torch.ops.mxmoe_cuda.qdq_dim1, torch.ops.mxmoe_cuda.qdq_dim0_dim1):
        with pytest.raises(RuntimeError, match=r"x must have at least 2 dims, got shape \(64\)"):
            op(x[0], 32, 1, e4, bf)
        with pytest.raises(RuntimeError, match="block_size must be a power of two >= 2, got 24"):
            op(x, 24, 1, e4, bf)
        with pytest.raises(RuntimeError, match="mode must be 0..3"):
            op(x, 32, -1, e4, bf)
        with pytest.raises(TypeError, match="x is Half; expected BFloat16 or Float"):
            op(x.half(), 32, 1, e4, bf)
        with pytest.raises(TypeError, match="elem_dtype is"):
            op(x, 32, 1, torch.float16, bf)
        with pytest.raises(TypeError, match="out_dtype is Half"):
            op(x, 32, 1, e4, torch.float16)
        with pytest.raises(RuntimeError, match=r"x must be contiguous, got shape \(64, 32\)"):
            op(x[:, :32], 32, 1, e4, bf)
    with pytest.raises(RuntimeError, match=r"x.shape\[-1\]=64 is not divisible by block_size=128"):
        torch.ops.mxmoe_cuda.qdq_dim0_dim1(x, 128, 1, e4, bf)
    # dim1 alone needs no whole blocks along C (blocks run along R)
    assert torch.ops.mxmoe_cuda.qdq_dim1(x[:, :48].contiguous(), 32, 1, e4, bf).shape == (64, 48)


@pytest.mark.gpu
def test_gpu_qdq_cuda_rows_beyond_2_31_elements():
    """More than 2^31 elements (64-bit row offsets): dim1 and dim0+dim1 rows at the end and at the
    start equal the same kernels on slices cut at block boundaries; the data viewed as two
    matrices (3D, R no multiple of 32: blocks per matrix, the second past 2^31) equals each matrix
    alone."""
    r = recipe("cuda")
    C = 8192
    T = 2**31 // C + 300  # even
    x = torch.randn(T, C, device="cuda", dtype=torch.bfloat16)
    x[-1] *= 2.0**40
    s = (T // BS - 10) * BS
    y0, y1 = qdq_dim0_dim1(x, recipe=r)
    z0, z1 = qdq_dim0_dim1(x[s:], recipe=r)
    assert torch.equal(_bits(y0[s:]), _bits(z0)) and torch.equal(_bits(y1[s:]), _bits(z1))
    h0, h1 = qdq_dim0_dim1(x[:992], recipe=r)
    assert torch.equal(_bits(y0[:992]), _bits(h0)) and torch.equal(_bits(y1[:992]), _bits(h1))
    del y0, z0, z1, h0, h1
    assert torch.equal(_bits(qdq(x, -2, recipe=r)), _bits(y1))
    del y1
    x3 = x.view(2, T // 2, C)
    y3 = qdq(x3, -2, recipe=r)
    for m in range(2):
        assert torch.equal(_bits(y3[m]), _bits(qdq(x3[m], -2, recipe=r))), m


# ------------------------------------------------------------------------------------------------
# GPU: dim1 and dim0+dim1 with expert groups (offs)


@pytest.mark.gpu
@pytest.mark.parametrize("combo", COMBOS, ids=[f"{m}-{dname(e)}-{dname(d)}" for m, e, d in COMBOS])
def test_gpu_qdq_cuda_grouped_match_oracle(combo):
    """Every input class in ragged groups (empty ones, sizes 1, 31, 32, 33, rows after the last),
    both output dtypes: the oracle's padded form (dim0+dim1 and dim1 alone), the torch backend and
    (bf16 out) the Triton rows kernel."""
    mode, elem, dtype = combo
    src = np.ascontiguousarray(data(64, BS, mode, elem, dtype, "full").T)
    x32 = grouped_rows(src, COUNTS, TAIL)
    ends = np.cumsum(COUNTS).tolist()
    x = to_torch(x32, dtype, "cuda")
    offs = offs_of(COUNTS, "cuda")
    rc = recipe("cuda", mode, elem)
    for out in DTYPES:
        what = f"grouped cuda {mode} {dname(elem)} {dname(dtype)} -> {dname(out)}"
        w0, w1 = oracle_rows(x32, BS, mode, elem, out, ends)
        y0, y1 = qdq_dim0_dim1(x, recipe=rc, out_dtype=out, offs=offs)
        check_values(y0, w0, what + " dim0")
        check_values(y1, w1, what + " dim1")
        check_values(qdq(x, -2, recipe=rc, out_dtype=out, offs=offs), w1, what + " dim1 alone")
        for ref in ("torch", "triton") if out == torch.bfloat16 else ("torch",):
            r0, r1 = qdq_dim0_dim1(x, recipe=recipe(ref, mode, elem), out_dtype=out, offs=offs)
            assert_same_bits(y0, r0, f"{what} dim0 vs {ref}")
            assert_same_bits(y1, r1, f"{what} dim1 vs {ref}")


def _grouped_all(x: torch.Tensor, r: MXRecipe, offs: torch.Tensor, out: torch.dtype) -> list[torch.Tensor]:
    """Both outputs of qdq_dim0_dim1 and dim1 alone, with groups."""
    y1 = qdq(x, -2, recipe=r, out_dtype=out, offs=offs)
    return [*qdq_dim0_dim1(x, recipe=r, out_dtype=out, offs=offs), y1]


@pytest.mark.gpu
def test_gpu_qdq_cuda_grouped_equals_torch_large():
    """A large wide-range input, T no multiple of 32, 7168 columns: 100 ragged groups (every 7th
    empty) with 13 rows after the last, one group of all rows, 4096 groups (most empty, the most
    the public API takes; the last one ends at T), every group empty (all rows after the groups:
    zero): the cuda kernel == the torch backend (NaN where NaN) for both outputs and dim1 alone;
    e4m3 RCEIL bf16 also == the Triton rows kernel."""
    g = torch.Generator().manual_seed(1)
    counts = torch.randint(0, 200, (100,), generator=g)
    counts[::7] = 0
    T = int(counts.sum()) + 13
    many = torch.zeros(4096, dtype=torch.int64)
    many[torch.randperm(4096, generator=g)[:300]] = torch.randint(0, 20, (300,), generator=g)  # < T in all
    many[-1] += max(0, T - int(many.sum()))
    offs_list = [counts.cumsum(0), torch.tensor([T]), many.cumsum(0), torch.zeros(5, dtype=torch.int64)]
    scale = torch.logspace(-30, 30, T, device="cuda").view(-1, 1)
    for mode, elem, dtype in (("rceil", torch.float8_e4m3fn, torch.bfloat16),
                              ("floor", torch.float8_e5m2, torch.float32)):
        rc, rg = recipe("cuda", mode, elem), recipe("torch", mode, elem)
        t = (torch.randn(T, 7168, device="cuda") * scale).to(dtype)
        for i, o in enumerate(offs_list):
            offs = o.to(torch.int32).cuda()
            got = _grouped_all(t, rc, offs, torch.bfloat16)
            for a, b in zip(got, _grouped_all(t, rg, offs, torch.bfloat16), strict=True):
                assert_same_bits(a, b, f"{mode} offs #{i} vs torch")
            if mode == "rceil" and i < 2:
                for a, b in zip(got, _grouped_all(t, recipe("triton", mode, elem), offs, torch.bfloat16),
                                strict=True):
                    assert_same_bits(a, b, f"{mode} offs #{i} vs triton")


@pytest.mark.gpu
def test_gpu_qdq_cuda_grouped_generic_paths():
    """Groups on the generic kernels: block sizes 16 and 64 against the oracle's padded form, and a
    misaligned x (the fused call's fallback: the dim0 operator, the rows after the groups zeroed,
    then the generic dim1 kernel) equal to the aligned x."""
    mode, elem, dtype = "even", torch.float8_e5m2, torch.float32
    for bs in (16, 64):
        src = np.ascontiguousarray(data(2 * bs if bs > 16 else 64, bs, mode, elem, dtype, "full").T)
        counts = [0, 1, bs - 1, bs, bs + 1, 0, 45]
        x32 = grouped_rows(src, counts, TAIL, bs)
        x = to_torch(x32, dtype, "cuda")
        w0, w1 = oracle_rows(x32, bs, mode, elem, torch.float32, np.cumsum(counts).tolist())
        y0, y1 = qdq_dim0_dim1(x, recipe=recipe("cuda", mode, elem, bs), out_dtype=torch.float32,
                               offs=offs_of(counts, "cuda"))
        check_values(y0, w0, f"bs={bs} grouped dim0")
        check_values(y1, w1, f"bs={bs} grouped dim1")
    src = np.ascontiguousarray(data(64, BS, "ceil", torch.float8_e4m3fn, torch.bfloat16, "full").T)
    x = to_torch(grouped_rows(src, COUNTS, TAIL), torch.bfloat16, "cuda")
    R, C = x.shape
    buf = torch.empty(R * C + 1, dtype=torch.bfloat16, device="cuda")
    buf[1:] = x.reshape(-1)
    xm = buf[1:].view(R, C)  # 2-byte offset
    r = recipe("cuda", "ceil")
    offs = offs_of(COUNTS, "cuda")
    for out in DTYPES:
        for a, b in zip(_grouped_all(xm, r, offs, out), _grouped_all(x, r, offs, out), strict=True):
            assert torch.equal(_bits(a), _bits(b)), out


@pytest.mark.gpu
def test_gpu_qdq_cuda_grouped_operators_check_offs():
    """offs is checked in C++: x 2D, a 1D int32 tensor on x's device with at least one group."""
    from mxmoe.quant import cuda_cast

    cuda_cast.load_extension()
    e4, bf = torch.float8_e4m3fn, torch.bfloat16
    x = torch.randn(64, 64, device="cuda", dtype=bf)
    offs = torch.tensor([10, 64], dtype=torch.int32, device="cuda")
    for op in (torch.ops.mxmoe_cuda.qdq_dim1, torch.ops.mxmoe_cuda.qdq_dim0_dim1):
        with pytest.raises(RuntimeError, match=r"x must be 2D \(T, C\) with offs, got shape \(2, 32, 64\)"):
            op(x.view(2, 32, 64), 32, 1, e4, bf, offs)
        with pytest.raises(TypeError, match=r"offs must be a 1D Int tensor of cumulative group ends, got Lo"):
            op(x, 32, 1, e4, bf, offs.long())
        with pytest.raises(RuntimeError, match=r"offs must have at least 1 group, got shape \(0\)"):
            op(x, 32, 1, e4, bf, offs[:0])
        with pytest.raises(RuntimeError, match="offs is on cpu, x on cuda"):
            op(x, 32, 1, e4, bf, offs.cpu())


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["triton", "cuda"])
def test_gpu_qdq_grouped_beyond_2_31_elements(kernel):
    """More than 2^31 elements with groups (the kernels' 64-bit row offsets): the groups at the end
    and the first rows equal the same kernel on slices (offsets shifted, 32-bit offsets), the rows
    after the last group zero, dim1 alone equals the fused call's; each matrix of the same data
    viewed as 3D (dim1 per matrix, the second past 2^31) equals the kernel on that matrix alone."""
    r = recipe(kernel)
    C = 8192
    T = 2**31 // C + 300
    x = torch.randn(T, C, device="cuda", dtype=torch.bfloat16)
    counts = [T - 350, 150, 0, 100]  # then 100 rows in no group
    offs = offs_of(counts, "cuda")
    y0, y1 = qdq_dim0_dim1(x, recipe=r, offs=offs)
    s = T - 350
    z0, z1 = qdq_dim0_dim1(x[s:], recipe=r, offs=offs[1:] - s)
    assert torch.equal(_bits(y0[s:]), _bits(z0)) and torch.equal(_bits(y1[s:]), _bits(z1))
    h0, h1 = qdq_dim0_dim1(x[:992], recipe=r, offs=offs_of([992], "cuda"))
    assert torch.equal(_bits(y0[:992]), _bits(h0)) and torch.equal(_bits(y1[:992]), _bits(h1))
    assert not bool(y0[-100:].any()) and not bool(y1[-100:].any())
    del z0, z1, h0, h1, y0
    assert torch.equal(_bits(qdq(x, -2, recipe=r, offs=offs)), _bits(y1))
    del y1
    x3 = x.view(2, T // 2, C)
    y3 = qdq(x3, -2, recipe=r)
    for m in range(2):
        assert torch.equal(_bits(y3[m]), _bits(qdq(x3[m], -2, recipe=r))), m
