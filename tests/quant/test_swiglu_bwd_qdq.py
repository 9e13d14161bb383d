"""The fused SwiGLU backward + dim0+dim1 qdq of its outputs (`mxmoe.quant.qdq.swiglu_bwd_qdq_dim0_dim1`,
the C++ operator `mxmoe_cuda::swiglu_bwd_qdq_dim0_dim1`): (dg0, dg1), (du0, du1) = qdq_dim0_dim1 of
dg = silu_backward(dh * u, g) and du = dh * F.silu(g) as eager PyTorch computes them on the inputs'
device, without dg and du in memory on the cuda kernel.

CPU: the torch kernel (the reference) against the NumPy oracle applied to torch's own dg and du (every
scale mode, element format, input and output dtype, every input class of tests/quant/cases.py in dh,
g and u; ragged and empty groups, rows after the last group, no groups), the triton kernel through
the interpreter; edge groups; argument errors; the fake implementation and torch.compile(fullgraph);
the kernel choice; the sm_90 build of the kernel (no spills, 16-byte loads, the qdq kernel's stores).
GPU (marked gpu): the cuda kernel bit for bit against torch's own dg and du on the GPU then the cuda
qdq_dim0_dim1, for every bf16 value of g and for random fp32; the oracle; odd shapes, misaligned
inputs and block size 16 (dg, du formed by ATen then cast); the operator's checks; torch.compile."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import assert_same_bits

import mxmoe.quant.qdq as qdq_mod
from mxmoe.quant.qdq import qdq_dim0_dim1, swiglu_bwd_qdq_dim0_dim1, swiglu_bwd_qdq_op
from tests.quant.helpers import COMBOS, DTYPES, data, dname, to_f32_numpy, to_torch
from tests.quant.test_qdq import COUNTS, TAIL, check_values, grouped_rows, offs_of, oracle_rows
from tests.quant.test_swiglu_qdq import BS, _bits, recipe

NAMES = ("dg0", "dg1", "du0", "du1")


def bwd_inputs(mode: str, elem, dtype, grouped: bool, device="cpu"):
    """(dh, g, u, offs, ends): each from the cast test data with its own seed (every input class of
    tests/quant/cases.py: zeros, subnormals, huge, NaN / Inf, ...), as (T, 64) rows with ragged groups
    (COUNTS, TAIL rows after them) or 45 rows without groups."""
    rows = []
    for seed in (2, 0, 1):
        src = np.ascontiguousarray(data(64, BS, mode, elem, dtype, "full", seed).T)  # blocks along rows
        rows.append(grouped_rows(src, COUNTS, TAIL) if grouped else src[:45])
    dh, g, u = (to_torch(r, dtype, device) for r in rows)
    offs = offs_of(COUNTS, device) if grouped else None
    return dh, g, u, offs, (np.cumsum(COUNTS).tolist() if grouped else None)


def torch_bwd(dh, g, u):
    """(dg, du) as autograd forms them for h = F.silu(g) * u (written out here, independently of the
    code under test): SiluBackward0 on MulBackward0's grad of silu(g), and MulBackward0's grad of u."""
    return torch.ops.aten.silu_backward(dh * u, g), dh * F.silu(g)


def test_torch_bwd_is_autograds():
    """torch_bwd is what autograd gives g and u for F.silu(g) * u (bf16 and fp32, CPU)."""
    gen = torch.Generator().manual_seed(0)
    for dtype in DTYPES:
        g, u, dh = ((torch.randn(33, 64, generator=gen) * 3).to(dtype) for _ in range(3))
        g.requires_grad_(True)
        u.requires_grad_(True)
        dg, du = torch.autograd.grad(F.silu(g) * u, (g, u), dh)
        wg, wu = torch_bwd(dh, g.detach(), u.detach())
        assert torch.equal(_bits(dg), _bits(wg)) and torch.equal(_bits(du), _bits(wu)), dtype


# ------------------------------------------------------------------------------------------------
# CPU


@pytest.mark.parametrize("grouped", [False, True])
def test_swiglu_bwd_qdq_matches_oracle(grouped):
    """Every combo, both output dtypes: the four outputs == the oracle's padded form of torch's dg and
    du, and == qdq_dim0_dim1 of them (the unfused code)."""
    for mode, elem, dtype in COMBOS:
        dh, g, u, offs, ends = bwd_inputs(mode, elem, dtype, grouped)
        dg, du = torch_bwd(dh, g, u)
        r = recipe("torch", mode, elem)
        for out in DTYPES:
            what = f"swiglu_bwd {mode} {dname(elem)} {dname(dtype)} -> {dname(out)} grouped={grouped}"
            got = swiglu_bwd_qdq_dim0_dim1(dh, g, u, recipe=r, out_dtype=out, offs=offs)
            want = [*oracle_rows(to_f32_numpy(dg), BS, mode, elem, out, ends),
                    *oracle_rows(to_f32_numpy(du), BS, mode, elem, out, ends)]
            unfused = [*qdq_dim0_dim1(dg, recipe=r, out_dtype=out, offs=offs),
                       *qdq_dim0_dim1(du, recipe=r, out_dtype=out, offs=offs)]
            for y, w, z, name in zip(got, want, unfused, NAMES, strict=True):
                assert y.shape == g.shape and y.dtype == out and y.is_contiguous(), what
                check_values(y, w, f"{what} {name}")
                assert torch.equal(_bits(y), _bits(z)), f"{what} {name} unfused"


@pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")
def test_swiglu_bwd_qdq_triton_kernel_matches_oracle():
    """The "triton" kernel (torch's dg and du, then the Triton rows kernel; on the GPU where there is
    one, else on CPU through the interpreter) in ragged groups: the oracle's padded form, one combo
    per input dtype."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for mode, elem, dtype in (("floor", torch.float8_e4m3fn, torch.bfloat16),
                              ("rceil", torch.float8_e5m2, torch.float32)):
        dh, g, u, offs, ends = bwd_inputs(mode, elem, dtype, True, device)
        dg, du = torch_bwd(dh, g, u)
        want = [*oracle_rows(to_f32_numpy(dg), BS, mode, elem, torch.bfloat16, ends),
                *oracle_rows(to_f32_numpy(du), BS, mode, elem, torch.bfloat16, ends)]
        rt = recipe("triton", mode, elem)
        got = swiglu_bwd_qdq_dim0_dim1(dh, g, u, recipe=rt, out_dtype=torch.bfloat16, offs=offs)
        for y, w, name in zip(got, want, NAMES, strict=True):
            check_values(y, w, f"triton {mode} {dname(dtype)} {name}")


def _unfused(dh, g, u, r, out=None, offs=None):
    dg, du = torch_bwd(dh, g, u)
    return [y for x in (dg, du) for y in qdq_dim0_dim1(x, recipe=r, out_dtype=out, offs=offs)]


def test_swiglu_bwd_qdq_edge_groups_noncontiguous_and_default_dtype():
    """offs[-1] == 0 (every row in no group: zeros), one group of all rows, a single row, block 16,
    transposed (non-contiguous) inputs, the default out_dtype (dh's): equal to the unfused calls."""
    gen = torch.Generator().manual_seed(5)
    r16 = recipe("torch", "floor", torch.float8_e5m2, 16)
    r = recipe("torch", "rceil", torch.float8_e4m3fn)
    for rr, counts, tail, dtype in (
        (r, [0, 0], 5, torch.bfloat16),
        (r, [70], 0, torch.float32),
        (r, [1], 0, torch.bfloat16),
        (r16, [3, 17, 16, 0, 40], 9, torch.float32),
    ):
        T = sum(counts) + tail
        dh, g, u = ((torch.randn(T, 64, generator=gen) * 4).to(dtype) for _ in range(3))
        offs = offs_of(counts)
        got = swiglu_bwd_qdq_dim0_dim1(dh, g, u, recipe=rr, offs=offs)
        for y, z, name in zip(got, _unfused(dh, g, u, rr, offs=offs), NAMES, strict=True):
            assert y.dtype == dtype
            assert torch.equal(_bits(y), _bits(z)), (counts, tail, name)
    dh, g, u = (torch.randn(64, 40, generator=gen).bfloat16().t() for _ in range(3))
    for y, z in zip(swiglu_bwd_qdq_dim0_dim1(dh, g, u, recipe=r), _unfused(dh, g, u, r), strict=True):
        assert torch.equal(_bits(y), _bits(z))


def test_swiglu_bwd_qdq_errors():
    r = recipe("torch")
    x = torch.randn(40, 64, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="u must be a torch.Tensor"):
        swiglu_bwd_qdq_dim0_dim1(x, x, 1.0, recipe=r)
    with pytest.raises(TypeError, match="dh has dtype torch.float16"):
        swiglu_bwd_qdq_dim0_dim1(x.half(), x, x, recipe=r)
    with pytest.raises(ValueError, match=r"g \(torch.float32, shape \(40, 64\).*must have dh's dtype"):
        swiglu_bwd_qdq_dim0_dim1(x, x.float(), x, recipe=r)
    with pytest.raises(ValueError, match=r"u \(torch.bfloat16, shape \(40, 32\).*must have dh's dtype, sh"):
        swiglu_bwd_qdq_dim0_dim1(x, x, x[:, :32], recipe=r)
    x3 = x.view(2, 20, 64)
    with pytest.raises(ValueError, match=r"dh must be 2D for swiglu_bwd_qdq_dim0_dim1, got shape \(2, 20"):
        swiglu_bwd_qdq_dim0_dim1(x3, x3, x3, recipe=r)
    x48 = x[:, :48]
    with pytest.raises(ValueError, match=r"dh.shape\[-1\]=48 \(dh \(40, 48\)\) is not divisible by block_"):
        swiglu_bwd_qdq_dim0_dim1(x48, x48, x48, recipe=r)
    with pytest.raises(TypeError, match="offs must be a 1D torch.int32 tensor"):
        swiglu_bwd_qdq_dim0_dim1(x, x, x, recipe=r, offs=torch.tensor([40]))
    with pytest.raises(TypeError, match="out_dtype=torch.float16 is not supported"):
        swiglu_bwd_qdq_dim0_dim1(x, x, x, recipe=r, out_dtype=torch.float16)


def test_swiglu_bwd_qdq_fake_matches_real_and_compiles():
    """The op's fake outputs have the real ones' shapes, strides and dtypes; a fullgraph compile of a
    function calling it (the torch kernel: the opaque op) gives the eager values."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    dh, g, u = (torch.randn(45, 64, dtype=torch.bfloat16) for _ in range(3))
    offs = offs_of([5, 0, 30])
    for o in (None, offs):
        args = ("mxfp8_e4m3_rceil", torch.float32, "torch")
        real = [(t.shape, t.stride(), t.dtype) for t in swiglu_bwd_qdq_op(dh, g, u, *args, o)]
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fo = None if o is None else mode.from_tensor(o)
            fake = [(t.shape, t.stride(), t.dtype) for t in swiglu_bwd_qdq_op(
                mode.from_tensor(dh), mode.from_tensor(g), mode.from_tensor(u), *args, fo)]
        assert real == fake and len(real) == 4, o is None
    r = recipe("torch", "floor", torch.float8_e4m3fn)

    def f(dh, g, u, offs):
        a, b, c, d = swiglu_bwd_qdq_dim0_dim1(dh, g, u, recipe=r, out_dtype=torch.float32, offs=offs)
        return a + 2 * b + 3 * c + 4 * d

    got = torch.compile(f, fullgraph=True, backend="inductor")(dh, g, u, offs)
    assert torch.equal(got, f(dh, g, u, offs))


def test_swiglu_bwd_qdq_kernel_choice(monkeypatch, as_on_a_gpu):
    """The kernel choice (`cast_kernel` with the recipe's dim1_kernel): "auto" is the torch reference
    on CPU; on CUDA (fake CUDA tensors, the extension's presence faked) "auto" and "cuda" hand "cuda"
    to the op, "triton" stays "triton"."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    seen = []
    real = qdq_mod._swiglu_bwd_qdq_impl

    def spy(*args, **kw):
        seen.append(args[5])
        return real(*args, **kw)

    monkeypatch.setattr(qdq_mod, "_swiglu_bwd_qdq_impl", spy)
    x = torch.randn(40, 64)
    swiglu_bwd_qdq_dim0_dim1(x, x, x, recipe=recipe("auto"))
    assert seen == ["torch"]
    as_on_a_gpu()
    picked = []
    monkeypatch.setattr(qdq_mod, "swiglu_bwd_qdq_trusted",
                        lambda dh, g, u, r, kernel, out, offs=None: picked.append(kernel) or [dh] * 4)
    with FakeTensorMode():
        xc = torch.empty(40, 64, device="cuda")
        for k in ("auto", "cuda", "triton"):
            swiglu_bwd_qdq_dim0_dim1(xc, xc, xc, recipe=recipe(k))
    assert picked == ["cuda", "cuda", "triton"]


def test_swiglu_bwd_kernel_compiles_for_sm90_with_bounded_spills(mx_cast_sm90):
    """csrc/mx_swiglu_qdq.cu for sm_90 (nvcc, no GPU): every variant of swiglu_bwd_qdq_kernel (bf16 / fp32
    in, both elements and outputs: 8): fp32 at most 128 registers (two CTAs per SM) with no spills;
    bf16 at most 85 (three CTAs per SM, its launch bounds) with at most 32 bytes spilled (ptxas
    spills 20-24 there: measured 8-9 % faster on the H200 than two CTAs without spills); no local
    memory in the PTX; dh, g and u are read with 16-byte streaming loads, the four outputs written
    with the qdq kernel's 16- / 8-byte streaming stores only; 1 + x * (1 - s) of silu_backward is
    one fma."""
    info = mx_cast_sm90.ptxas
    entries = mx_cast_sm90.entries("swiglu_bwd_qdq_kernel")
    assert len(entries) == 8, sorted(entries)
    for name, body in entries.items():
        stack, st, ld, regs = info[name]
        if "swiglu_bwd_qdq_kernelILi0E" in name:  # bf16 in: three CTAs per SM
            assert max(stack, st, ld) <= 32 and regs <= 85, (name, info[name])
        else:
            assert stack == st == ld == 0 and regs <= 128, (name, info[name])
        loads = set(re.findall(r"ld\.global[.\w]*", body))
        stores = set(re.findall(r"st\.global[.\w]*", body))
        assert loads <= {"ld.global.cs.v4.u32", "ld.global.nc.u32", "ld.global.nc.s32", "ld.global.u32",
                         "ld.global.s32", "ld.global.nc.v4.u32"}, (name, loads)
        assert "ld.global.cs.v4.u32" in loads, (name, loads)
        assert stores and stores <= {"st.global.cs.v4.u32", "st.global.cs.v2.u32"}, (name, stores)
        assert ".local" not in body, name
        assert "fma.rn.f32" in body, name


# ------------------------------------------------------------------------------------------------
# GPU


@pytest.mark.gpu
@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("combo", COMBOS, ids=[f"{m}-{dname(e)}-{dname(d)}" for m, e, d in COMBOS])
def test_gpu_swiglu_bwd_qdq_cuda_matches_reference_and_oracle(combo, grouped):
    """The cuda kernel (dg, du in registers) == torch's dg and du on the GPU then the cuda qdq, bit for
    bit (NaN where NaN), and == the oracle of those dg, du; both output dtypes, ragged and empty groups."""
    mode, elem, dtype = combo
    dh, g, u, offs, ends = bwd_inputs(mode, elem, dtype, grouped, "cuda")
    rc = recipe("cuda", mode, elem)
    dg, du = torch_bwd(dh, g, u)
    for out in DTYPES:
        what = f"gpu swiglu_bwd {mode} {dname(elem)} {dname(dtype)} -> {dname(out)} grouped={grouped}"
        got = swiglu_bwd_qdq_dim0_dim1(dh, g, u, recipe=rc, out_dtype=out, offs=offs)
        want = [*oracle_rows(to_f32_numpy(dg.cpu()), BS, mode, elem, out, ends),
                *oracle_rows(to_f32_numpy(du.cpu()), BS, mode, elem, out, ends)]
        for y, z, w, name in zip(got, _unfused(dh, g, u, rc, out, offs), want, NAMES, strict=True):
            assert_same_bits(y, z, f"{what} {name}")
            check_values(y, w, f"{what} {name} oracle")


@pytest.mark.gpu
def test_gpu_swiglu_bwd_qdq_every_bf16_gate_and_random_fp32():
    """g over every bf16 bit pattern (65536 values; dh, u random) and 2^20 fp32 g, half of them random
    bit patterns (subnormals, |g| > 88 where expf over- or underflows, NaN / Inf), half N(0, 40): the
    four outputs of the cuda kernel == torch's dg and du on the GPU then the cuda qdq, bit for bit.
    Also dh, u at the bf16 extremes (huge: products overflow to Inf). A failure in dg only would mean
    torch's silu_backward rounds differently (csrc/mx_numerics.cuh's silu_bwd_f32)."""
    rc = recipe("cuda")
    torch.manual_seed(0)
    gb = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).cuda()
    g = gb.view(-1, 256)
    for scale in (1.0, 2.0**100):
        dh = (torch.randn(g.shape, device="cuda") * scale).bfloat16()
        u = (torch.randn(g.shape, device="cuda") * scale).bfloat16()
        for out in DTYPES:
            got = swiglu_bwd_qdq_dim0_dim1(dh, g, u, recipe=rc, out_dtype=out)
            for a, b, k in zip(got, _unfused(dh, g, u, rc, out), NAMES, strict=True):
                assert_same_bits(a, b, f"bf16 all patterns x{scale} {k} -> {dname(out)}")
    bits = torch.randint(-(2**31), 2**31 - 1, (4096, 256), device="cuda", dtype=torch.int32)
    gf = torch.where(torch.rand(bits.shape, device="cuda") < 0.5, bits.view(torch.float32),
                     torch.randn(bits.shape, device="cuda") * 40)
    dhf, uf = torch.randn(gf.shape, device="cuda"), torch.randn(gf.shape, device="cuda")
    for out in DTYPES:
        got = swiglu_bwd_qdq_dim0_dim1(dhf, gf, uf, recipe=rc, out_dtype=out)
        for a, b, k in zip(got, _unfused(dhf, gf, uf, rc, out), NAMES, strict=True):
            assert_same_bits(a, b, f"fp32 random {k} -> {dname(out)}")


@pytest.mark.gpu
def test_gpu_swiglu_bwd_qdq_cuda_shapes_misaligned_and_block_sizes():
    """Large ragged groups (7168 columns, 100 groups, every 7th empty, rows after the last), one row,
    misaligned inputs (offset views: dg, du formed by ATen, then the two-pass qdq) and block size 16:
    all == the reference on the GPU."""
    gen = torch.Generator().manual_seed(1)
    counts = torch.randint(0, 200, (100,), generator=gen)
    counts[::7] = 0
    T = int(counts.sum()) + 13
    offs = torch.cumsum(counts, 0).to(torch.int32).cuda()
    for dtype in DTYPES:
        dh, g, u = ((torch.randn(T, 7168, device="cuda") * 3).to(dtype) for _ in range(3))
        for r, o in ((recipe("cuda"), offs), (recipe("cuda", "floor", torch.float8_e5m2), None),
                     (recipe("cuda", "rceil", torch.float8_e4m3fn, 16), offs)):
            for out in DTYPES:
                got = swiglu_bwd_qdq_dim0_dim1(dh, g, u, recipe=r, out_dtype=out, offs=o)
                for a, b, k in zip(got, _unfused(dh, g, u, r, out, o), NAMES, strict=True):
                    assert_same_bits(a, b, f"large {dname(dtype)} bs={r.block_size} {k} -> {dname(out)}")
        one = (dh[:1], g[:1], u[:1])
        for a, b, k in zip(swiglu_bwd_qdq_dim0_dim1(*one, recipe=recipe("cuda")),
                           _unfused(*one, recipe("cuda")), NAMES, strict=True):
            assert_same_bits(a, b, f"one row {k}")
        flats = [torch.randn(65 * 64 + 1, device="cuda").to(dtype) for _ in range(3)]
        mis = [f[1:].view(65, 64) for f in flats]  # not 16-byte aligned
        om = offs_of([10, 0, 40], "cuda")
        for a, b, k in zip(swiglu_bwd_qdq_dim0_dim1(*mis, recipe=recipe("cuda"), offs=om),
                           _unfused(*mis, recipe("cuda"), None, om), NAMES, strict=True):
            assert_same_bits(a, b, f"misaligned {dname(dtype)} {k}")


@pytest.mark.gpu
def test_gpu_swiglu_bwd_qdq_operator_checks_and_compiles():
    """The C++ operator's checks name the argument; a fullgraph compile calls it (the op decomposed
    into mxmoe_cuda::swiglu_bwd_qdq_dim0_dim1) with the eager values."""
    from mxmoe.formats import MODE_IDS
    from mxmoe.quant import cuda_cast

    cuda_cast.load_extension()
    op = torch.ops.mxmoe_cuda.swiglu_bwd_qdq_dim0_dim1
    x = torch.randn(40, 64, device="cuda", dtype=torch.bfloat16)
    args = (32, MODE_IDS["rceil"], torch.float8_e4m3fn, torch.bfloat16)
    with pytest.raises(TypeError, match="g is Float; expected dh's dtype BFloat16"):
        op(x, x.float(), x, *args)
    with pytest.raises(RuntimeError, match=r"u must be contiguous of dh.s shape \(40, 64\), got shape \(40"):
        op(x, x, x[:, :32].contiguous(), *args)
    with pytest.raises(RuntimeError, match="g must be contiguous of dh's shape"):
        op(x, x.t().contiguous().t(), x, *args)
    with pytest.raises(RuntimeError, match="u is on cpu, dh on cuda"):
        op(x, x, x.cpu(), *args)
    with pytest.raises(RuntimeError, match=r"dh must be contiguous, got shape \(64, 40\)"):
        op(x.t(), x.t(), x.t(), *args)
    x48 = x[:, :48].contiguous()
    with pytest.raises(RuntimeError, match=r"dh.shape\[-1\]=48 is not divisible"):
        op(x48, x48, x48, *args)
    with pytest.raises(TypeError, match="dh is Half; expected BFloat16 or Float"):
        op(x.half(), x.half(), x.half(), *args)
    r = recipe("cuda")
    offs = offs_of([7, 0, 30], "cuda")
    g, u = torch.randn_like(x), torch.randn_like(x)

    def f(dh, g, u, offs):
        a, b, c, d = swiglu_bwd_qdq_dim0_dim1(dh, g, u, recipe=r, out_dtype=torch.float32, offs=offs)
        return a + 2 * b + 3 * c + 4 * d

    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    got, codes = run_and_get_code(torch.compile(f, fullgraph=True), x, g, u, offs)
    code = "\n".join(codes)
    assert "mxmoe_cuda.swiglu_bwd_qdq_dim0_dim1" in code and "torch.ops.mxmoe.swiglu_bwd_qdq" not in code
    assert torch.equal(got, f(x, g, u, offs))
