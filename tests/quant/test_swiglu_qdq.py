"""The fused SwiGLU + dim0+dim1 qdq (`mxmoe.quant.qdq.swiglu_qdq_dim0_dim1`, the C++ operator
`mxmoe_cuda::swiglu_qdq_dim0_dim1`): y0, y1 = qdq_dim0_dim1(h, offs) of h = F.silu(g) * u as eager
PyTorch computes it on the inputs' device, without h in memory on the cuda kernel.

CPU: the torch kernel (the reference) against the NumPy oracle applied to torch's h (every scale
mode, element format, input and output dtype; ragged and empty groups, rows after the last group,
no groups), the triton kernel through the interpreter (two combos); argument errors; the fake
implementation and torch.compile(fullgraph=True); the kernel choice; the sm_90 build of the SwiGLU
kernel variants (no spills, 16-byte loads, the stores of the qdq kernel).
GPU (marked gpu): the cuda kernel bit for bit against the reference formed on the GPU (torch's
silu and mul, then the cuda qdq_dim0_dim1) and against the oracle; odd shapes, misaligned inputs
and other block sizes (h formed by ATen then cast), argument errors, torch.compile(fullgraph=True)."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import assert_same_bits

import mxmoe.quant.qdq as qdq_mod
from mxmoe.quant.qdq import qdq_dim0_dim1, swiglu_qdq_dim0_dim1, swiglu_qdq_op
from mxmoe.recipe import MXRecipe
from tests.quant.helpers import COMBOS, DTYPES, data, dname, to_f32_numpy, to_torch
from tests.quant.test_qdq import COUNTS, TAIL, check_values, grouped_rows, offs_of, oracle_rows

BS = 32


def recipe(kernel: str, mode: str = "rceil", elem=torch.float8_e4m3fn, bs: int = BS) -> MXRecipe:
    return MXRecipe(scaling_mode=mode, elem_dtype=elem, block_size=bs, dim0_kernel=kernel, dim1_kernel=kernel)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


def gate_inputs(mode: str, elem, dtype, grouped: bool, device="cpu"):
    """(g, u, offs, ends): g from the cast test data (every input class of tests/quant/cases.py:
    zeros, subnormals, huge, NaN / Inf, ...), u from it with another seed, as (T, 64) rows with
    ragged groups (COUNTS, TAIL rows after them) or 45 rows without groups."""
    rows = []
    for seed in (0, 1):
        src = np.ascontiguousarray(data(64, BS, mode, elem, dtype, "full", seed).T)  # blocks along rows
        rows.append(grouped_rows(src, COUNTS, TAIL) if grouped else src[:45])
    g, u = (to_torch(r, dtype, device) for r in rows)
    offs = offs_of(COUNTS, device) if grouped else None
    return g, u, offs, (np.cumsum(COUNTS).tolist() if grouped else None)


# ------------------------------------------------------------------------------------------------
# CPU


@pytest.mark.parametrize("grouped", [False, True])
def test_swiglu_qdq_matches_oracle(grouped):
    """Every combo, both output dtypes: y0, y1 == the oracle's padded form of h = F.silu(g) * u
    (torch's h on the CPU: the definition), and == qdq_dim0_dim1(h) of the unfused code."""
    for mode, elem, dtype in COMBOS:
        g, u, offs, ends = gate_inputs(mode, elem, dtype, grouped)
        h = F.silu(g) * u
        r = recipe("torch", mode, elem)
        for out in DTYPES:
            what = f"swiglu {mode} {dname(elem)} {dname(dtype)} -> {dname(out)} grouped={grouped}"
            w0, w1 = oracle_rows(to_f32_numpy(h), BS, mode, elem, out, ends)
            y0, y1 = swiglu_qdq_dim0_dim1(g, u, recipe=r, out_dtype=out, offs=offs)
            assert y0.shape == y1.shape == g.shape and y0.is_contiguous() and y1.is_contiguous()
            assert y0.dtype == y1.dtype == out
            check_values(y0, w0, what + " dim0")
            check_values(y1, w1, what + " dim1")
            z0, z1 = qdq_dim0_dim1(h, recipe=r, out_dtype=out, offs=offs)
            assert torch.equal(_bits(y0), _bits(z0)) and torch.equal(_bits(y1), _bits(z1)), what


@pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")
def test_swiglu_qdq_triton_kernel_matches_oracle():
    """The "triton" kernel (torch's h, then the Triton rows kernel; on the GPU where there is one, else
    on CPU through the interpreter) in ragged groups: the oracle's padded form of h, one combo per
    input dtype."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for mode, elem, dtype in (("floor", torch.float8_e4m3fn, torch.bfloat16),
                              ("rceil", torch.float8_e5m2, torch.float32)):
        g, u, offs, ends = gate_inputs(mode, elem, dtype, True, device)
        w0, w1 = oracle_rows(to_f32_numpy(F.silu(g) * u), BS, mode, elem, torch.bfloat16, ends)
        y0, y1 = swiglu_qdq_dim0_dim1(g, u, recipe=recipe("triton", mode, elem), out_dtype=torch.bfloat16,
                                      offs=offs)
        check_values(y0, w0, f"triton {mode} {dname(dtype)} dim0")
        check_values(y1, w1, f"triton {mode} {dname(dtype)} dim1")


def test_swiglu_qdq_edge_groups_noncontiguous_and_default_dtype():
    """offs[-1] == 0 (every row in no group: zeros), one group of all rows, a single row, block 16,
    transposed (non-contiguous) g and u, the default out_dtype (g's): equal to the unfused calls."""
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
        g = (torch.randn(T, 64, generator=gen) * 4).to(dtype)
        u = torch.randn(T, 64, generator=gen).to(dtype)
        offs = offs_of(counts)
        y0, y1 = swiglu_qdq_dim0_dim1(g, u, recipe=rr, offs=offs)
        z0, z1 = qdq_dim0_dim1(F.silu(g) * u, recipe=rr, offs=offs)
        assert y0.dtype == dtype
        assert torch.equal(_bits(y0), _bits(z0)) and torch.equal(_bits(y1), _bits(z1)), (counts, tail)
    gt = torch.randn(64, 40, generator=gen).bfloat16().t()
    ut = torch.randn(64, 40, generator=gen).bfloat16().t()
    y0, y1 = swiglu_qdq_dim0_dim1(gt, ut, recipe=r)
    z0, z1 = qdq_dim0_dim1(F.silu(gt) * ut, recipe=r)
    assert torch.equal(_bits(y0), _bits(z0)) and torch.equal(_bits(y1), _bits(z1))


def test_swiglu_qdq_errors():
    r = recipe("torch")
    g = torch.randn(40, 64, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="u must be a torch.Tensor"):
        swiglu_qdq_dim0_dim1(g, 1.0, recipe=r)
    with pytest.raises(TypeError, match="g has dtype torch.float16"):
        swiglu_qdq_dim0_dim1(g.half(), g, recipe=r)
    with pytest.raises(ValueError, match=r"u \(torch.float32, shape \(40, 64\).*must have g's dtype"):
        swiglu_qdq_dim0_dim1(g, g.float(), recipe=r)
    with pytest.raises(ValueError, match=r"u \(torch.bfloat16, shape \(40, 32\).*must have g's dtype, shape"):
        swiglu_qdq_dim0_dim1(g, g[:, :32], recipe=r)
    with pytest.raises(ValueError, match=r"g must be 2D for swiglu_qdq_dim0_dim1, got shape \(2, 20, 64\)"):
        swiglu_qdq_dim0_dim1(g.view(2, 20, 64), g.view(2, 20, 64), recipe=r)
    with pytest.raises(ValueError, match=r"g.shape\[-1\]=48 \(g \(40, 48\)\) is not divisible by block_size"):
        swiglu_qdq_dim0_dim1(g[:, :48], g[:, :48], recipe=r)
    with pytest.raises(TypeError, match="offs must be a 1D torch.int32 tensor"):
        swiglu_qdq_dim0_dim1(g, g, recipe=r, offs=torch.tensor([40]))
    with pytest.raises(TypeError, match="out_dtype=torch.float16 is not supported"):
        swiglu_qdq_dim0_dim1(g, g, recipe=r, out_dtype=torch.float16)


def test_swiglu_qdq_fake_matches_real_and_compiles():
    """The op's fake outputs have the real ones' shapes, strides and dtypes; a fullgraph compile of a
    function calling it (the torch kernel: the opaque op) gives the eager values."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    g = torch.randn(45, 64, dtype=torch.bfloat16)
    u = torch.randn(45, 64, dtype=torch.bfloat16)
    offs = offs_of([5, 0, 30])
    for o in (None, offs):
        args = ("mxfp8_e4m3_rceil", torch.float32, "torch")
        real = [(t.shape, t.stride(), t.dtype) for t in swiglu_qdq_op(g, u, *args, o)]
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fo = None if o is None else mode.from_tensor(o)
            fake = [(t.shape, t.stride(), t.dtype)
                    for t in swiglu_qdq_op(mode.from_tensor(g), mode.from_tensor(u), *args, fo)]
        assert real == fake, o is None
    r = recipe("torch", "floor", torch.float8_e4m3fn)

    def f(g, u, offs):
        a, b = swiglu_qdq_dim0_dim1(g, u, recipe=r, out_dtype=torch.float32, offs=offs)
        return a + b

    got = torch.compile(f, fullgraph=True, backend="inductor")(g, u, offs)
    assert torch.equal(got, f(g, u, offs))


def test_swiglu_qdq_kernel_choice(monkeypatch, as_on_a_gpu):
    """The qdq calls' kernel choice (`cast_kernel` with the recipe's dim1_kernel): "auto" is the torch
    reference on CPU; on CUDA (traced on fake CUDA tensors, the extension's presence faked) "auto"
    and "cuda" hand "cuda" to the op, "triton" stays "triton"."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    seen = []
    real = qdq_mod._swiglu_qdq_impl

    def spy(*args, **kw):
        seen.append(args[4])
        return real(*args, **kw)

    monkeypatch.setattr(qdq_mod, "_swiglu_qdq_impl", spy)
    g = torch.randn(40, 64)
    swiglu_qdq_dim0_dim1(g, g, recipe=recipe("auto"))
    assert seen == ["torch"]
    as_on_a_gpu()
    picked = []
    monkeypatch.setattr(qdq_mod, "swiglu_qdq_trusted",
                        lambda g, u, r, kernel, out, offs=None: picked.append(kernel) or [g, g])
    with FakeTensorMode():
        gc = torch.empty(40, 64, device="cuda")
        for k in ("auto", "cuda", "triton"):
            swiglu_qdq_dim0_dim1(gc, gc, recipe=recipe(k))
    assert picked == ["cuda", "cuda", "triton"]


def test_swiglu_kernel_compiles_for_sm90_without_spills(mx_cast_sm90):
    """csrc/mx_swiglu_qdq.cu for sm_90 (nvcc, no GPU): every SWIGLU variant of qdq_dim1_kernel (bf16 /
    fp32 in, both elements and outputs: 8) has no local memory and no spills, at most 85 registers
    for bf16 (8 lanes per column, three CTAs per SM) and 128 for fp32 (4 lanes); g and u are read
    with 16-byte streaming loads, the outputs written with the qdq kernel's 16- / 8-byte streaming
    stores only."""
    info = mx_cast_sm90.ptxas
    entries = mx_cast_sm90.entries(r"qdq_dim1_kernel.*ELb1EEEv")  # the SWIGLU variants (last argument true)
    assert len(entries) == 8, sorted(entries)
    for name, body in entries.items():
        stack, st, ld, regs = info[name]
        max_regs = 85 if "qdq_dim1_kernelILi0E" in name else 128  # bf16: three CTAs per SM
        assert stack == st == ld == 0 and regs <= max_regs, (name, info[name])
        loads = set(re.findall(r"ld\.global[.\w]*", body))
        stores = set(re.findall(r"st\.global[.\w]*", body))
        assert loads <= {"ld.global.cs.v4.u32", "ld.global.nc.u32", "ld.global.nc.s32", "ld.global.u32",
                         "ld.global.s32", "ld.global.nc.v4.u32"}, (name, loads)
        assert "ld.global.cs.v4.u32" in loads, (name, loads)
        assert stores and stores <= {"st.global.cs.v4.u32", "st.global.cs.v2.u32"}, (name, stores)
        assert ".local" not in body, name


# ------------------------------------------------------------------------------------------------
# GPU


def _reference_cuda(g, u, r, out, offs):
    """The definition on the GPU: torch's h, then the cuda qdq_dim0_dim1."""
    return qdq_dim0_dim1(F.silu(g) * u, recipe=r, out_dtype=out, offs=offs)


@pytest.mark.gpu
@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("combo", COMBOS, ids=[f"{m}-{dname(e)}-{dname(d)}" for m, e, d in COMBOS])
def test_gpu_swiglu_qdq_cuda_matches_reference_and_oracle(combo, grouped):
    """The cuda kernel (h in registers) == torch's h on the GPU then the cuda qdq, bit for bit (NaN
    where NaN), and == the oracle of that h; both output dtypes, ragged and empty groups."""
    mode, elem, dtype = combo
    g, u, offs, ends = gate_inputs(mode, elem, dtype, grouped, "cuda")
    rc = recipe("cuda", mode, elem)
    h = F.silu(g) * u
    for out in DTYPES:
        what = f"gpu swiglu {mode} {dname(elem)} {dname(dtype)} -> {dname(out)} grouped={grouped}"
        y0, y1 = swiglu_qdq_dim0_dim1(g, u, recipe=rc, out_dtype=out, offs=offs)
        z0, z1 = _reference_cuda(g, u, rc, out, offs)
        assert_same_bits(y0, z0, what + " dim0")
        assert_same_bits(y1, z1, what + " dim1")
        w0, w1 = oracle_rows(to_f32_numpy(h.cpu()), BS, mode, elem, out, ends)
        check_values(y0, w0, what + " dim0 oracle")
        check_values(y1, w1, what + " dim1 oracle")


@pytest.mark.gpu
def test_gpu_swiglu_qdq_every_bf16_gate_and_random_fp32():
    """g over every bf16 bit pattern (65536 values, u random) and 2^20 fp32 g, half of them random
    bit patterns (subnormals, |g| > 88 where expf over- or underflows, NaN / Inf), half N(0, 40):
    y0 and y1 of the cuda kernel == the reference on the GPU (torch's silu and mul, then the cuda
    qdq), bit for bit."""
    rc = recipe("cuda")
    torch.manual_seed(0)
    gb = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).cuda()
    g = gb.view(-1, 256)
    u = torch.randn(g.shape, device="cuda").bfloat16()
    for out in DTYPES:
        y = swiglu_qdq_dim0_dim1(g, u, recipe=rc, out_dtype=out)
        z = _reference_cuda(g, u, rc, out, None)
        for a, b, k in zip(y, z, ("dim0", "dim1"), strict=True):
            assert_same_bits(a, b, f"bf16 all patterns {k} -> {dname(out)}")
    bits = torch.randint(-(2**31), 2**31 - 1, (4096, 256), device="cuda", dtype=torch.int32)
    gf = torch.where(torch.rand(bits.shape, device="cuda") < 0.5, bits.view(torch.float32),
                     torch.randn(bits.shape, device="cuda") * 40)
    uf = torch.randn(gf.shape, device="cuda")
    for out in DTYPES:
        y = swiglu_qdq_dim0_dim1(gf, uf, recipe=rc, out_dtype=out)
        z = _reference_cuda(gf, uf, rc, out, None)
        for a, b, k in zip(y, z, ("dim0", "dim1"), strict=True):
            assert_same_bits(a, b, f"fp32 random {k} -> {dname(out)}")


@pytest.mark.gpu
def test_gpu_swiglu_qdq_cuda_shapes_misaligned_and_block_sizes():
    """Large ragged groups (7168 columns, 100 groups, every 7th empty, rows after the last), one row,
    misaligned g / u (offset views: h formed by ATen, then the two-pass qdq) and block size 16:
    all == the reference on the GPU."""
    gen = torch.Generator().manual_seed(1)
    counts = torch.randint(0, 200, (100,), generator=gen)
    counts[::7] = 0
    T = int(counts.sum()) + 13
    offs = torch.cumsum(counts, 0).to(torch.int32).cuda()
    for dtype in DTYPES:
        g = (torch.randn(T, 7168, device="cuda") * 3).to(dtype)
        u = torch.randn(T, 7168, device="cuda").to(dtype)
        for r, o in ((recipe("cuda"), offs), (recipe("cuda", "floor", torch.float8_e5m2), None),
                     (recipe("cuda", "rceil", torch.float8_e4m3fn, 16), offs)):
            for out in DTYPES:
                y = swiglu_qdq_dim0_dim1(g, u, recipe=r, out_dtype=out, offs=o)
                z = _reference_cuda(g, u, r, out, o)
                for a, b, k in zip(y, z, ("dim0", "dim1"), strict=True):
                    assert_same_bits(a, b, f"large {dname(dtype)} bs={r.block_size} {k} -> {dname(out)}")
        g1, u1 = g[:1], u[:1]
        assert_same_bits(swiglu_qdq_dim0_dim1(g1, u1, recipe=recipe("cuda"))[0],
              _reference_cuda(g1, u1, recipe("cuda"), dtype, None)[0], "one row")
        flat_g = torch.randn(65 * 64 + 1, device="cuda").to(dtype)
        flat_u = torch.randn(65 * 64 + 1, device="cuda").to(dtype)
        gm, um = flat_g[1:].view(65, 64), flat_u[1:].view(65, 64)  # not 16-byte aligned
        om = offs_of([10, 0, 40], "cuda")
        y = swiglu_qdq_dim0_dim1(gm, um, recipe=recipe("cuda"), offs=om)
        z = _reference_cuda(gm, um, recipe("cuda"), dtype, om)
        for a, b, k in zip(y, z, ("dim0", "dim1"), strict=True):
            assert_same_bits(a, b, f"misaligned {dname(dtype)} {k}")


@pytest.mark.gpu
def test_gpu_swiglu_qdq_operator_checks_and_compiles():
    """The C++ operator's checks name the argument; a fullgraph compile calls it (the op decomposed
    into mxmoe_cuda::swiglu_qdq_dim0_dim1) with the eager values."""
    from mxmoe.formats import MODE_IDS
    from mxmoe.quant import cuda_cast

    cuda_cast.load_extension()
    op = torch.ops.mxmoe_cuda.swiglu_qdq_dim0_dim1
    g = torch.randn(40, 64, device="cuda", dtype=torch.bfloat16)
    args = (32, MODE_IDS["rceil"], torch.float8_e4m3fn, torch.bfloat16)
    with pytest.raises(TypeError, match="u is Float; expected g's dtype BFloat16"):
        op(g, g.float(), *args)
    with pytest.raises(RuntimeError, match=r"contiguous of g.s shape \(40, 64\), got shape \(40, 32\)"):
        op(g, g[:, :32].contiguous(), *args)
    with pytest.raises(RuntimeError, match="u must be contiguous of g's shape"):
        op(g, g.t().contiguous().t(), *args)
    with pytest.raises(RuntimeError, match="u is on cpu, g on cuda"):
        op(g, g.cpu(), *args)
    with pytest.raises(RuntimeError, match=r"g must be contiguous, got shape \(64, 40\)"):
        op(g.t(), g.t(), *args)
    with pytest.raises(RuntimeError, match=r"g.shape\[-1\]=48 is not divisible"):
        op(g[:, :48].contiguous(), g[:, :48].contiguous(), *args)
    with pytest.raises(TypeError, match="g is Half; expected BFloat16 or Float"):
        op(g.half(), g.half(), *args)
    r = recipe("cuda")
    offs = offs_of([7, 0, 30], "cuda")
    u = torch.randn_like(g)

    def f(g, u, offs):
        a, b = swiglu_qdq_dim0_dim1(g, u, recipe=r, out_dtype=torch.float32, offs=offs)
        return a + b

    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    got, codes = run_and_get_code(torch.compile(f, fullgraph=True), g, u, offs)
    code = "\n".join(codes)
    assert "mxmoe_cuda.swiglu_qdq_dim0_dim1" in code and "torch.ops.mxmoe.swiglu_qdq" not in code
    assert torch.equal(got, f(g, u, offs))
