"""The "fp8" GEMM backend (mxmoe/ops/fp8_gemm.py) against the fp64 product of the dequantized
operands: random and adversarial scales (2^-127..2^127, zero blocks, NaN bytes), ragged and empty
groups. CPU runs the Triton kernel through the interpreter (small shapes) and compiles the Gluon
kernel for sm_90a; `-m gpu` runs the Gluon kernel on the H200.

Bounds (stated in the module docstring): per 32-block the sum of products is fp32 in the
interpreter ((k + 2) 2^-23 Σ|a b| for the whole dot, as tests/ops/test_mx_ops.py) and the sm_90 fp8
MMA's narrower adder on the GPU (2^-7 Σ|a b|, worst case of ~13 kept bits per product); plus
the output rounding (bf16: 2^-8 |ref|) and 2^-126 per block for contributions below fp32's normal
range.
"""

import functools
import operator

import pytest
import torch

from mxmoe.ops import fp8_gemm, fp8_wgmma, mx_gemm, mx_grouped_mm, mx_mm
from mxmoe.ops.fp8_gemm import Fp8GemmConfig, fp8_mx_gemm, why_unavailable
from mxmoe.ops.fp8_wgmma import WgmmaConfig
from mxmoe.quant.mx_tensor import MXTensor, to_mx
from mxmoe.recipe import MXRecipe, recipe

E4M3_FINITE = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)


def dev() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def rand_q(*shape, gen, max_byte=0x7E, device="cpu"):
    """Random e4m3 elements: uniform over the finite bit patterns with magnitude byte <= max_byte."""
    pool = E4M3_FINITE[(E4M3_FINITE & 0x7F) <= max_byte]
    idx = torch.randint(0, pool.numel(), shape, generator=gen)
    return pool[idx].view(torch.float8_e4m3fn).to(device)


def scales(bytes_: torch.Tensor, device) -> torch.Tensor:
    return bytes_.to(torch.uint8).view(torch.float8_e8m0fnu).to(device)


def dq64(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """fp64 value of K-innermost MX storage: q (..., K) e4m3, s (..., K/32) e8m0 (255 = NaN)."""
    b = s.view(torch.uint8).cpu().to(torch.float64)
    f = torch.where(b == 255, torch.nan, torch.exp2(b - 127))
    return q.cpu().double() * torch.repeat_interleave(f, 32, dim=-1)


def bound(a_abs, b_abs_t, ref, k, out_dtype, gpu):
    """a_abs (M, K) and b_abs_t (N, K) fp64 magnitudes of the dequantized operands."""
    acc = 2.0**-7 if gpu else (k + 2) * 2.0**-23
    b = (a_abs @ b_abs_t.t()) * acc + (k // 32 + 1) * 2.0**-126
    if out_dtype == torch.bfloat16:
        b = b + ref.abs() * 2.0**-8
    return b


def check(got, ref, a_abs, b_abs_t, k, gpu):
    out_dtype = got.dtype
    got = got.cpu().double()
    nan = torch.isnan(ref)
    assert torch.equal(torch.isnan(got), nan), "NaN pattern differs from the reference"
    err = (got - ref).abs()[~nan]
    bnd = bound(a_abs, b_abs_t, ref, k, out_dtype, gpu)[~nan]
    assert bool((err <= bnd).all()), f"max err {err.max().item()}, max excess {(err - bnd).max().item()}"


def _rand_operand(rows, k, gen, lo=110, hi=140, device="cpu"):
    q = rand_q(rows, k, gen=gen, device=device)
    s = scales(torch.randint(lo, hi, (rows, k // 32), generator=gen), device)
    return q, s


# ------------------------------------------------------------------------------------------------
# Dense and grouped, random scales
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M,N,K", [(32, 32, 64), (45, 50, 96), (7, 70, 256)])
def test_dense_random(M, N, K, out_dtype):
    gen = torch.Generator().manual_seed(M * N + K)
    aq, as_ = _rand_operand(M, K, gen)
    bq, bs = _rand_operand(N, K, gen)
    got = fp8_mx_gemm(aq, as_, bq, bs, None, out_dtype)
    assert got.dtype == out_dtype and got.shape == (M, N) and got.is_contiguous()
    A, B = dq64(aq, as_), dq64(bq, bs)
    check(got, A @ B.t(), A.abs(), B.abs(), K, gpu=False)


def grouped_rows_ref(A, B3, ends):
    out = torch.zeros(A.shape[0], B3.shape[1], dtype=torch.float64)
    start = 0
    for e, end in enumerate(ends):
        out[start:end] = A[start:end] @ B3[e].t()
        start = end
    return out


@pytest.mark.parametrize("counts,T", [([5, 0, 28], 40), ([0, 0, 33], 33), ([40, 1, 0, 7], 60), ([0], 8)])
def test_grouped_rows(counts, T):
    """2D x 3D: ragged and empty groups, rows past the last group zero."""
    E, N, K = len(counts), 36, 64
    gen = torch.Generator().manual_seed(T + E)
    aq, as_ = _rand_operand(T, K, gen)
    bq, bs = _rand_operand(E * N, K, gen)
    bq, bs = bq.view(E, N, K), bs.view(E, N, K // 32)
    ends = torch.tensor(counts).cumsum(0).tolist()
    offs = torch.tensor(ends, dtype=torch.int32)
    got = fp8_mx_gemm(aq, as_, bq, bs, offs, torch.float32)
    A, B = dq64(aq, as_), dq64(bq, bs)
    ref = grouped_rows_ref(A, B, ends)
    bnd = grouped_rows_ref(A.abs(), B.abs(), ends) * (K + 2) * 2.0**-23 + 2.0**-120
    assert bool(((got.double() - ref).abs() <= bnd).all())
    assert not got[ends[-1]:].any()


@pytest.mark.parametrize("counts", [[32, 0, 64, 64], [0, 96], [64, 0], [0, 0], [160]])
def test_grouped_k(counts):
    """2D x 2D grouped over K (wgrad): group sizes multiples of 32, empty groups give zeros."""
    M, N = 40, 33
    T = max(32, sum(counts))
    gen = torch.Generator().manual_seed(sum(counts) + len(counts))
    aq, as_ = _rand_operand(M, T, gen)
    bq, bs = _rand_operand(N, T, gen)
    ends = torch.tensor(counts).cumsum(0).tolist()
    got = fp8_mx_gemm(aq, as_, bq, bs, torch.tensor(ends, dtype=torch.int32), torch.float32)
    assert got.shape == (len(counts), M, N)
    A, B = dq64(aq, as_), dq64(bq, bs)
    start = 0
    for e, end in enumerate(ends):
        ref = A[:, start:end] @ B[:, start:end].t()
        if end == start:
            assert not got[e].any()
        check(got[e], ref, A[:, start:end].abs(), B[:, start:end].abs(), end - start, gpu=False)
        start = end


# ------------------------------------------------------------------------------------------------
# Adversarial scales
# ------------------------------------------------------------------------------------------------


def adversarial(M, N, K, gen, device):
    """A with scale bytes 0..3 in even blocks and 251..254 in odd ones; B the mirror (products near
    2^0). The huge-scale A blocks hold small elements (|a| <= 2^-6, B <= 1 there) so |part| sa <
    2^128; block 0 of A is zero with scale 254 against B's 254 (must give 0, not NaN)."""
    nb = K // 32
    even = torch.arange(nb) % 2 == 0
    ea = torch.where(even, torch.randint(0, 4, (M, nb), generator=gen),
                     torch.randint(251, 255, (M, nb), generator=gen))
    eb = torch.where(even, torch.randint(251, 255, (N, nb), generator=gen),
                     torch.randint(0, 4, (N, nb), generator=gen))
    aq = rand_q(M, K, gen=gen).view(torch.uint8).view(M, nb, 32)
    bq = rand_q(N, K, gen=gen).view(torch.uint8).view(N, nb, 32)
    small_a = rand_q(M, K, gen=gen, max_byte=0x08).view(torch.uint8).view(M, nb, 32)  # <= 2^-6
    small_b = rand_q(N, K, gen=gen, max_byte=0x38).view(torch.uint8).view(N, nb, 32)  # <= 1
    aq = torch.where(even[None, :, None], aq, small_a)
    bq = torch.where(even[None, :, None], bq, small_b)
    aq[:, 0] = 0
    ea[:, 0] = 254
    eb[:, 0] = 254
    aq = aq.reshape(M, K).view(torch.float8_e4m3fn).to(device)
    bq = bq.reshape(N, K).view(torch.float8_e4m3fn).to(device)
    return aq, scales(ea, device), bq, scales(eb, device)


def run_adversarial(M, N, K, device):
    gen = torch.Generator().manual_seed(K)
    aq, as_, bq, bs = adversarial(M, N, K, gen, device)
    got = fp8_mx_gemm(aq, as_, bq, bs, None, torch.float32)
    A, B = dq64(aq, as_), dq64(bq, bs)
    assert torch.isfinite(got).all()
    check(got, A @ B.t(), A.abs(), B.abs(), K, gpu=device == "cuda")


def test_adversarial_scales():
    run_adversarial(40, 36, 256, "cpu")


def exact_case(M, N, K, gen, device):
    """Small-integer elements and scales with ea[m, k] + eb[n, k] = x_m + z_n: every block's
    contribution has the same power of two per output, so the exact result is an fp32 integer times
    one power of two, from 2^-127 (both bytes 0) up; any adder of >= 16 bits gets it exactly."""
    nb = K // 32
    y = torch.randint(0, 64, (nb,), generator=gen)
    x = torch.randint(0, 64, (M,), generator=gen)
    x[0] = y[0] = 0  # row 0, block 0: byte 0 (2^-127)
    z = torch.randint(127, 191, (N,), generator=gen)
    ea = x[:, None] + y[None, :]
    eb = z[:, None] - y[None, :]
    ints = torch.tensor([-2.0, -1.0, 0.0, 1.0, 2.0])
    aq = ints[torch.randint(0, 5, (M, K), generator=gen)].to(torch.float8_e4m3fn)
    bq = ints[torch.randint(0, 5, (N, K), generator=gen)].to(torch.float8_e4m3fn)
    return aq.to(device), scales(ea, device), bq.to(device), scales(eb, device)


def test_exact_power_of_two_scales():
    gen = torch.Generator().manual_seed(3)
    aq, as_, bq, bs = exact_case(33, 40, 128, gen, "cpu")
    got = fp8_mx_gemm(aq, as_, bq, bs, None, torch.float32)
    assert torch.equal(got.double(), dq64(aq, as_) @ dq64(bq, bs).t())


def run_scale_byte_extremes(device):
    K = 64
    one = torch.full((4, K), 1.0).to(torch.float8_e4m3fn).to(device)
    sa = scales(torch.tensor([[255, 127], [0, 127], [0, 0], [127, 127]]), device)
    sb = scales(torch.tensor([[127, 127], [254, 127], [0, 127], [127, 255]]), device)
    got = fp8_mx_gemm(one, sa, one, sb, None, torch.float32).cpu()
    ref = dq64(one, sa) @ dq64(one, sb).t()
    assert torch.equal(torch.isnan(got), torch.isnan(ref))
    assert torch.isnan(got[0]).all() and torch.isnan(got[:, 3]).all()
    assert got[1, 1].item() == 32 * 2.0**0 + 32  # 2^-127 * 2^127 block, then a 1 * 1 block
    # block 0 of row 2 x col 2 is 32 * 2^-254, below fp32's range: it adds nothing (bound 2^-126)
    assert got[2, 2].item() == 32 * 2.0**-127
    assert got[1, 2].item() == 32.0
    assert got[3, 1].item() == float("inf")  # 32 * 2^127 + 32: beyond fp32


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # numpy, on the expected inf
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy, on NaN scales
def test_scale_byte_extremes():
    """Byte 255 is NaN (its row / column), byte 0 is 2^-127 exactly, a product of two tiny scales
    below fp32's range adds (almost) nothing instead of NaN, one above it is inf (as the fp32
    dequantized operands would be)."""
    run_scale_byte_extremes("cpu")


# ------------------------------------------------------------------------------------------------
# Through mx_gemm, mx_mm and mx_grouped_mm
# ------------------------------------------------------------------------------------------------

FP8 = MXRecipe(dim0_kernel="torch", dim1_kernel="torch", gemm_backend="fp8")
EMU = MXRecipe(dim0_kernel="torch", dim1_kernel="torch")


def test_mx_mm_fp8_matches_emulated():
    torch.manual_seed(0)
    x = torch.randn(45, 64, requires_grad=True)
    w = (torch.randn(96, 64) * 0.1).requires_grad_()
    dy = torch.randn(45, 96)
    outs = []
    for cfg in (FP8, EMU):
        x.grad = w.grad = None
        y = mx_mm(x, w.t(), cfg)
        y.backward(dy)
        outs.append((y.detach(), x.grad, w.grad))
    for got, ref in zip(outs[0], outs[1], strict=True):
        # same quantized operands, both fp32-accumulated: equal within fp32 summation
        torch.testing.assert_close(got, ref, rtol=2e-5, atol=2e-5)


def test_mx_grouped_mm_fp8_matches_emulated():
    torch.manual_seed(1)
    E, K, N = 3, 64, 32
    a = torch.randn(50, K, requires_grad=True)
    w = (torch.randn(E, N, K) * 0.1).requires_grad_()
    offs = torch.tensor([20, 20, 45], dtype=torch.int32)
    dy = torch.randn(50, N)
    outs = []
    for cfg in (FP8, EMU):
        a.grad = w.grad = None
        y = mx_grouped_mm(a, w.transpose(-2, -1), offs, cfg)
        y.backward(dy)
        outs.append((y.detach(), a.grad, w.grad))
    for got, ref in zip(outs[0], outs[1], strict=True):
        torch.testing.assert_close(got, ref, rtol=2e-5, atol=2e-5)


def test_compile_fullgraph_and_fake():
    gen = torch.Generator().manual_seed(5)
    aq, as_ = _rand_operand(32, 64, gen)
    bq, bs = _rand_operand(48, 64, gen)
    torch.library.opcheck(fp8_mx_gemm, (aq, as_, bq, bs, None, torch.bfloat16),
                          test_utils=("test_faketensor",))
    a = MXTensor(aq, as_, 1)
    b = MXTensor(bq, bs, 0)  # logical (K, N) blocked along K: storage (N, K)
    f = torch.compile(lambda a, b: mx_gemm(a, b, recipe=FP8), fullgraph=True, backend="eager")
    torch.testing.assert_close(f(a, b), mx_gemm(a, b, recipe=FP8), rtol=0, atol=0)


# ------------------------------------------------------------------------------------------------
# Errors
# ------------------------------------------------------------------------------------------------


def test_recipe_and_config_accept_fp8():
    assert recipe(gemm_backend="fp8").gemm_backend == "fp8"
    assert MXRecipe(gemm_backend="fp8").gemm_backend == "fp8"
    from mxmoe.nn.converter import MXConfig

    assert MXConfig(gemm_backend="fp8").gemm_backend == "fp8"
    with pytest.raises(ValueError, match="gemm_backend='fp9'"):
        MXRecipe(gemm_backend="fp9")


def test_unavailable_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert "TRITON_INTERPRET=1" in why_unavailable(torch.device("cpu"))
    x = to_mx(torch.randn(32, 64), axis=-1, kernel="torch")
    w = to_mx(torch.randn(64, 32), axis=0, kernel="torch")
    with pytest.raises(RuntimeError, match="gemm_backend='fp8' needs an sm_90"):
        mx_gemm(x, w, recipe=FP8)


def test_bad_operands():
    x = to_mx(torch.randn(32, 64), axis=-1, kernel="torch", elem_dtype=torch.float8_e5m2)
    w = to_mx(torch.randn(64, 32), axis=0, kernel="torch", elem_dtype=torch.float8_e5m2)
    with pytest.raises(ValueError, match="e4m3 operands with block_size=32"):
        mx_gemm(x, w, recipe=FP8)
    gen = torch.Generator().manual_seed(0)
    aq, as_ = _rand_operand(32, 64, gen)
    bq, bs = _rand_operand(32, 96, gen)
    with pytest.raises(ValueError, match="same K"):
        fp8_mx_gemm(aq, as_, bq, bs, None, torch.float32)
    with pytest.raises(TypeError, match="float8_e8m0fnu"):
        fp8_mx_gemm(aq, as_.view(torch.uint8), aq, as_, None, torch.float32)
    with pytest.raises(TypeError, match="out_dtype"):
        fp8_mx_gemm(aq, as_, aq, as_, None, torch.float16)
    with pytest.raises(ValueError, match="power of two"):
        Fp8GemmConfig(bm=96)


# ------------------------------------------------------------------------------------------------
# GPU (sm_90): larger shapes, the MMA's own adder
# ------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("M,N,K", [(512, 768, 1024), (1000, 300, 4096)])
def test_gpu_dense(M, N, K):
    gen = torch.Generator().manual_seed(M)
    aq, as_ = _rand_operand(M, K, gen, device="cuda")
    bq, bs = _rand_operand(N, K, gen, device="cuda")
    A, B = dq64(aq, as_), dq64(bq, bs)
    ref, mag = A @ B.t(), A.abs() @ B.abs().t()
    for out_dtype in (torch.float32, torch.bfloat16):
        got = fp8_mx_gemm(aq, as_, bq, bs, None, out_dtype)
        check(got, ref, A.abs(), B.abs(), K, gpu=True)
        err = (got.cpu().double() - ref).abs()
        # the measured accumulation error of the MMA, for the docs (the bound above is the test)
        print(f"{M}x{N}x{K} {out_dtype}: max |err| / sum|ab| = {(err / mag).max().item():.3e}, "
              f"max |err| / |ref| = {(err / ref.abs().clamp(min=1e-30)).max().item():.3e}")


@pytest.mark.gpu
def test_gpu_exact_and_adversarial():
    gen = torch.Generator().manual_seed(7)
    aq, as_, bq, bs = exact_case(300, 264, 2048, gen, "cuda")
    got = fp8_mx_gemm(aq, as_, bq, bs, None, torch.float32)
    assert torch.equal(got.cpu().double(), dq64(aq, as_) @ dq64(bq, bs).t())
    run_adversarial(256, 320, 1024, "cuda")


@pytest.mark.gpu
def test_gpu_grouped():
    gen = torch.Generator().manual_seed(11)
    counts = [0, 300, 1, 0, 555, 128, 0, 40]
    E, N, K = len(counts), 256, 512
    T = sum(counts) + 17
    aq, as_ = _rand_operand(T, K, gen, device="cuda")
    bq, bs = _rand_operand(E * N, K, gen, device="cuda")
    bq, bs = bq.view(E, N, K), bs.view(E, N, K // 32)
    ends = torch.tensor(counts).cumsum(0).tolist()
    got = fp8_mx_gemm(aq, as_, bq, bs, torch.tensor(ends, dtype=torch.int32, device="cuda"), torch.float32)
    A, B = dq64(aq, as_), dq64(bq, bs)
    ref = grouped_rows_ref(A, B, ends)
    bnd = grouped_rows_ref(A.abs(), B.abs(), ends) * 2.0**-7 + 2.0**-120
    assert bool(((got.cpu().double() - ref).abs() <= bnd).all())
    assert not got[ends[-1]:].any()
    kc = [0, 320, 32, 0, 640, 96]
    ek = torch.tensor(kc).cumsum(0).tolist()
    M2, N2 = 200, 136
    aq, as_ = _rand_operand(M2, sum(kc), gen, device="cuda")
    bq, bs = _rand_operand(N2, sum(kc), gen, device="cuda")
    got = fp8_mx_gemm(aq, as_, bq, bs, torch.tensor(ek, dtype=torch.int32, device="cuda"), torch.float32)
    A, B = dq64(aq, as_), dq64(bq, bs)
    start = 0
    for e, end in enumerate(ek):
        check(got[e], A[:, start:end] @ B[:, start:end].t(), A[:, start:end].abs(), B[:, start:end].abs(),
              end - start, gpu=True)
        start = end


@pytest.mark.gpu
def test_gpu_mx_ops_fp8_close_to_emulated():
    torch.manual_seed(0)
    cfg8 = MXRecipe(gemm_backend="fp8", dim0_kernel="triton", dim1_kernel="triton")
    x = torch.randn(1000, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(768, 1024, device="cuda", dtype=torch.bfloat16) * 0.03).requires_grad_()
    y8 = mx_mm(x, w.t(), cfg8)
    ye = mx_mm(x, w.t(), MXRecipe(dim0_kernel="triton", dim1_kernel="triton"))
    torch.testing.assert_close(y8, ye, rtol=2e-2, atol=2e-2)
    y8.float().square().sum().backward()
    assert torch.isfinite(x.grad).all() and torch.isfinite(w.grad).all()
    assert fp8_gemm.why_unavailable(x.device) is None


@pytest.mark.gpu
def test_gpu_mx_grouped_mm_fp8_close_to_emulated():
    """MoE experts forward, dgrad and wgrad (grouped rows and grouped K, ragged and empty groups)
    on the fp8 backend against the emulated one, same quantized operands."""
    torch.manual_seed(1)
    kw = {"dim0_kernel": "triton", "dim1_kernel": "triton"}
    E, K, N = 6, 512, 384
    counts = [0, 300, 7, 0, 650, 64]
    offs = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
    a = torch.randn(sum(counts) + 5, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(E, N, K, device="cuda", dtype=torch.bfloat16) * K**-0.5).requires_grad_()
    dy = torch.randn(a.shape[0], N, device="cuda", dtype=torch.bfloat16)
    outs = []
    for backend in ("fp8", "emulated"):
        a.grad = w.grad = None
        y = mx_grouped_mm(a, w.transpose(-2, -1), offs, MXRecipe(gemm_backend=backend, **kw))
        y.backward(dy)
        outs.append((y.detach().float(), a.grad.float(), w.grad.float()))
    for got, ref in zip(outs[0], outs[1], strict=True):
        scale = ref.abs().max().item()
        assert (got - ref).abs().max().item() <= 2e-2 * scale
    assert not outs[0][2][0].any() and not outs[0][2][3].any()  # empty experts: zero dW


# ------------------------------------------------------------------------------------------------
# The Gluon kernel (dense and grouped rows on sm_90): edges, tiles, ptxas
# ------------------------------------------------------------------------------------------------

WGMMA_CONFIGS = [  # the default and the tile paths that differ from it; every one gives the same bits
    fp8_wgmma.DEFAULT_CONFIG,  # 128x128x128, 4 stages, persistent
    WgmmaConfig(bn=64, bk=256, stages=3),  # two TMA boxes per operand and stage
    WgmmaConfig(bk=64, stages=8),  # a 64-byte TMA box (64-byte swizzle), a deep ring
    WgmmaConfig(persistent=False),  # one CTA per tile
]


@pytest.mark.parametrize("kw,msg", [({"bm": 64}, "bm=64"), ({"bn": 256}, "bn=256"), ({"bk": 512}, "bk=512"),
                                    ({"bn": 96}, "bn=96"), ({"stages": 1}, "stages=1")])
def test_wgmma_config_rejects_what_the_kernel_cannot_run(kw, msg):
    with pytest.raises(ValueError, match=msg):
        WgmmaConfig(**kw)


@pytest.mark.gpu
def test_gpu_scale_byte_extremes():
    run_scale_byte_extremes("cuda")


@pytest.mark.gpu
def test_gpu_wgmma_edges_and_tiles():
    """Ragged M and N (not multiples of 4 or of the tile), K not a multiple of the stage (33
    blocks), A with a row stride != K; every tile config gives the same bits (the same blocks
    promoted in the same order) within the bound."""
    gen = torch.Generator().manual_seed(21)
    M, N, K = 333, 250, 1056
    big, bigs = _rand_operand(M, K + 64, gen, device="cuda")
    aq, as_ = big[:, 32:32 + K], bigs[:, 1:1 + K // 32]
    bq, bs = _rand_operand(N, K, gen, device="cuda")
    A, B = dq64(aq, as_), dq64(bq, bs)
    first = None
    for cfg in WGMMA_CONFIGS:
        got = fp8_gemm.launch(aq, as_, bq, bs, None, torch.float32, cfg)
        check(got, A @ B.t(), A.abs(), B.abs(), K, gpu=True)
        first = got if first is None else first
        assert torch.equal(got, first), cfg
    counts = [0, 130, 1, 0, 70, 128, 0]
    E = len(counts)
    aq, as_ = _rand_operand(sum(counts) + 9, K, gen, device="cuda")
    bq, bs = _rand_operand(E * N, K, gen, device="cuda")
    bq, bs = bq.view(E, N, K), bs.view(E, N, K // 32)
    ends = torch.tensor(counts).cumsum(0).tolist()
    offs = torch.tensor(ends, dtype=torch.int32, device="cuda")
    A, B = dq64(aq, as_), dq64(bq, bs)
    ref = grouped_rows_ref(A, B, ends)
    bnd = grouped_rows_ref(A.abs(), B.abs(), ends) * 2.0**-7 + 2.0**-120
    first = None
    for cfg in WGMMA_CONFIGS:
        got = fp8_gemm.launch(aq, as_, bq, bs, offs, torch.float32, cfg)
        assert bool(((got.cpu().double() - ref).abs() <= bnd).all()), cfg
        assert not got[ends[-1]:].any()
        first = got if first is None else first
        assert torch.equal(got, first), cfg
    # grouped K (wgrad): group sizes 1..7 blocks past whole stages; groups 2 and 5 start with a
    # block of NaN scales (byte 255): their outputs are NaN, and the partial last stages of groups
    # 1 and 4, which load that block, must not promote it
    kc = [0, 160, 32, 0, 416, 96, 224]
    ek = torch.tensor(kc).cumsum(0).tolist()
    M2, N2, T = 200, 136, sum(kc)
    aq, as_ = _rand_operand(M2, T, gen, device="cuda")
    bq, bs = _rand_operand(N2, T, gen, device="cuda")
    for g in (2, 5):
        as_.view(torch.uint8)[:, ek[g - 1] // 32] = 255
    A, B = dq64(aq, as_), dq64(bq, bs)
    offs = torch.tensor(ek, dtype=torch.int32, device="cuda")
    first = None
    for cfg in WGMMA_CONFIGS:
        got = fp8_gemm.launch(aq, as_, bq, bs, offs, torch.float32, cfg)
        start = 0
        for e, end in enumerate(ek):
            sl = slice(start, end)
            check(got[e], A[:, sl] @ B[:, sl].t(), A[:, sl].abs(), B[:, sl].abs(), end - start, gpu=True)
            if end == start:
                assert not got[e].any()
            assert bool(torch.isnan(got[e]).all()) == (e in (2, 5))
            start = end
        first = got if first is None else first
        assert torch.equal(got.nan_to_num(), first.nan_to_num()), cfg


@pytest.mark.gpu
def test_gpu_wgmma_persistent_many_tiles():
    """More tiles than resident CTAs: a persistent CTA runs several tiles, the ring's slots and
    phases continuing across them and the next tile's loads issued before this tile's store."""
    gen = torch.Generator().manual_seed(23)
    M, N, K = 2048, 2304, 256
    aq, as_ = _rand_operand(M, K, gen, device="cuda")
    bq, bs = _rand_operand(N, K, gen, device="cuda")
    A, B = dq64(aq, as_), dq64(bq, bs)
    ref = A @ B.t()
    outs = [fp8_gemm.launch(aq, as_, bq, bs, None, torch.float32, cfg) for cfg in WGMMA_CONFIGS]
    check(outs[0], ref, A.abs(), B.abs(), K, gpu=True)
    assert all(torch.equal(o, outs[0]) for o in outs)
    counts = [700, 0, 1, 1400, 0, 333, 900, 64]
    E, N = len(counts), 1024
    aq, as_ = _rand_operand(sum(counts) + 40, K, gen, device="cuda")
    bq, bs = _rand_operand(E * N, K, gen, device="cuda")
    bq, bs = bq.view(E, N, K), bs.view(E, N, K // 32)
    ends = torch.tensor(counts).cumsum(0).tolist()
    offs = torch.tensor(ends, dtype=torch.int32, device="cuda")
    A, B = dq64(aq, as_), dq64(bq, bs)
    ref = grouped_rows_ref(A, B, ends)
    bnd = grouped_rows_ref(A.abs(), B.abs(), ends) * 2.0**-7 + 2.0**-120
    outs = [fp8_gemm.launch(aq, as_, bq, bs, offs, torch.bfloat16, cfg) for cfg in WGMMA_CONFIGS]
    assert bool(((outs[0].cpu().double() - ref).abs() <= bnd + ref.abs() * 2.0**-8).all())
    assert not outs[0][ends[-1]:].any()
    assert all(torch.equal(o, outs[0]) for o in outs)


@pytest.mark.gpu
def test_gpu_wgmma_same_bits_at_scale():
    """Every tile config against the default at sizes where every persistent CTA runs many tiles
    and the ring many laps (dense, 8 ragged groups of rows, 8 groups over K): the same bits (same
    wgmma per block, same promotion order), and the default within the GPU bound of the fp64
    product on a sample of rows."""
    default, others = WGMMA_CONFIGS[0], WGMMA_CONFIGS[1:]
    gen = torch.Generator().manual_seed(29)
    M, N, K = 4096, 3072, 2048
    aq, as_ = _rand_operand(M, K, gen, device="cuda")
    bq, bs = _rand_operand(N, K, gen, device="cuda")
    ref = fp8_gemm.launch(aq, as_, bq, bs, None, torch.float32, default)
    rows = torch.arange(0, M, 97)
    A, B = dq64(aq[rows], as_[rows]), dq64(bq, bs)
    check(ref[rows], A @ B.t(), A.abs(), B.abs(), K, gpu=True)
    for cfg in others:
        assert torch.equal(fp8_gemm.launch(aq, as_, bq, bs, None, torch.float32, cfg), ref), cfg
    E = 8
    counts = [1500, 0, 3, 2900, 777, 0, 1024, 1900]
    aq, as_ = _rand_operand(sum(counts) + 11, K, gen, device="cuda")
    bq, bs = _rand_operand(E * 1536, K, gen, device="cuda")
    bq, bs = bq.view(E, 1536, K), bs.view(E, 1536, K // 32)
    offs = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
    ref = fp8_gemm.launch(aq, as_, bq, bs, offs, torch.bfloat16, default)
    assert not ref[int(offs[-1]):].any()
    for cfg in others:
        assert torch.equal(fp8_gemm.launch(aq, as_, bq, bs, offs, torch.bfloat16, cfg), ref), cfg
    kc = [4096, 0, 32, 2048, 96, 8192, 0, 1536]
    aq, as_ = _rand_operand(1024, sum(kc), gen, device="cuda")
    bq, bs = _rand_operand(768, sum(kc), gen, device="cuda")
    offs = torch.tensor(kc, device="cuda").cumsum(0).to(torch.int32)
    ref = fp8_gemm.launch(aq, as_, bq, bs, offs, torch.float32, default)
    assert not ref[1].any() and not ref[6].any()
    for cfg in others:
        assert torch.equal(fp8_gemm.launch(aq, as_, bq, bs, offs, torch.float32, cfg), ref), cfg


def _sb_offset_to_column(W):
    """Column at each offset of the kernel's shared layout for a row of W B scales
    (`_sb_perm_layout`, a linear layout: an offset's column is the XOR of its set bits' bases)."""
    bases = [b for (b,) in fp8_wgmma._sb_perm_layout(W).offset_bases]
    return [functools.reduce(operator.xor, (b for i, b in enumerate(bases) if o >> i & 1), 0)
            for o in range(W)]


@pytest.mark.parametrize("W", [32, 64, 128, 256])
def test_sb_layout_vectorized_and_conflict_free(W):
    """The B-scale row layout (`_sb_perm_layout`): a permutation of the W columns; the W/4 columns
    a thread holds in the wgmma accumulator layout (c0 + 2 c1 + 8 c2, c1 = lane % 4) lie in
    16-byte chunks at its base 8 c1 plus offsets shared by all threads (one address register,
    16-byte loads), and each load's 4 chunks (one per c1) fall into 4 different groups of 4 banks
    (32 banks of 4 bytes)."""
    cols = _sb_offset_to_column(W)
    assert sorted(cols) == list(range(W))
    off = {c: o for o, c in enumerate(cols)}
    for c1 in range(4):
        mine = [c0 + 2 * c1 + 8 * c2 for c2 in range(W // 8) for c0 in range(2)]  # register order
        chunks = [[off[c] for c in mine[i:i + 4]] for i in range(0, len(mine), 4)]
        assert all(ch[0] % 4 == 0 and ch == list(range(ch[0], ch[0] + 4)) for ch in chunks), chunks
        assert [ch[0] - 8 * c1 for ch in chunks] == [off[8 * 2 * q] for q in range(W // 16)]
    for q in range(W // 16):
        assert len({off[2 * c1 + 16 * q] // 4 % 8 for c1 in range(4)}) == 4, q


@pytest.mark.parametrize("mode", ["dense", "rows", "k"])
def test_wgmma_launcher_host_side(mode, monkeypatch):
    """What the Gluon kernel's launcher hands the kernel, on CPU (the launch itself intercepted):
    TMA-valid descriptors (16-byte aligned bases and row strides, also for a strided A and ragged
    M, N, K), the fp32 scales decoded from the e8m0 bytes (2^(b-127), NaN for 255) with the rows
    innermost, B's in the documented per-tile column order, zero padding, and a grid covering
    every tile."""
    got = {}

    class Launch:
        def __getitem__(self, grid):
            return lambda *args, **kw: got.update(grid=grid, args=args, kw=kw)

    monkeypatch.setattr(fp8_wgmma, "_fp8_ws_kernel", Launch())
    monkeypatch.setattr(fp8_wgmma, "_resident_ctas", lambda cfg, device: 7)
    gen = torch.Generator().manual_seed(31)
    cfg = WgmmaConfig(bn=64, bk=128, stages=3)
    M, N, K, E = 333, 100, 1056, 3
    big, bigs = _rand_operand(M, K + 64, gen)
    aq, as_ = big[:, 32:32 + K], bigs[:, 1:1 + K // 32]
    as_.view(torch.uint8)[5, 3] = 255
    offs = None
    if mode == "dense":
        bq, bs = _rand_operand(N, K, gen)
        out = torch.empty(M, N, dtype=torch.bfloat16)
    elif mode == "rows":
        bq, bs = _rand_operand(E * N, K, gen)
        bq, bs = bq.view(E, N, K), bs.view(E, N, K // 32)
        offs = torch.tensor([100, 100, 300], dtype=torch.int32)
        out = torch.empty(M, N, dtype=torch.bfloat16)
    else:
        bq, bs = _rand_operand(N, K, gen)
        offs = torch.tensor([320, 320, 1056], dtype=torch.int32)
        out = torch.empty(E, M, N, dtype=torch.bfloat16)
    fp8_wgmma.launch(aq, as_, bq, bs, offs, out, cfg)
    a_desc, b_desc, sa_desc, sb_desc = got["args"][:4]
    for d in (a_desc, b_desc, sa_desc, sb_desc):
        assert d.base.data_ptr() % 16 == 0 and d.strides[-1] == 1
        assert all(st * d.base.element_size() % 16 == 0 for st in d.strides[:-1])
    assert torch.equal(a_desc.base.float(), aq.float())
    groups = E if mode == "rows" else 1
    nb, kb = cfg.bk // 32, K // 32
    kb_pad = -(-kb // nb) * nb

    def decoded(s):
        b = s.view(torch.uint8).to(torch.float64)
        return torch.where(b == 255, torch.nan, torch.exp2(b - 127))

    sa = sa_desc.base.double()
    assert sa.is_contiguous() and sa.shape[0] == kb_pad and sa.shape[1] % 4 == 0
    torch.testing.assert_close(sa[:kb, :M], decoded(as_).t(), equal_nan=True, rtol=0, atol=0)
    assert not sa[kb:].any() and not sa[:, M:].any()
    sb = sb_desc.base.double().view(groups, kb_pad, -1)
    np_ = sb.shape[-1]
    assert sb.is_contiguous() and np_ % cfg.bn == 0
    cols = torch.tensor(_sb_offset_to_column(cfg.bn))
    logical = sb.view(groups, kb_pad, np_ // cfg.bn, cfg.bn)[..., torch.argsort(cols)]  # [.., c]
    logical = logical.reshape(groups, kb_pad, np_)
    want = decoded(bs.reshape(groups, N, kb)).transpose(1, 2)
    torch.testing.assert_close(logical[:, :kb, :N], want, rtol=0, atol=0)
    assert not logical[:, kb:].any() and not logical[:, :, N:].any()
    row_tiles = -(-(M + 3 * E) // cfg.bm) + E + 1 if mode == "rows" else -(-M // cfg.bm)  # `_tile`'s bound
    tiles = row_tiles * -(-N // cfg.bn)
    assert got["kw"]["num_warps"] == 4 and got["kw"]["maxnreg"] == fp8_wgmma.WS_MAXNREG
    if mode == "k":  # one CTA per tile and group
        assert got["grid"] == (tiles, E) and got["kw"]["MODE"] == 2
    else:  # persistent: at most the resident CTAs
        assert got["grid"] == (min(tiles, 7),)
        assert got["kw"]["MODE"] == (1 if mode == "rows" else 0)


WS_AOT_CHECK = r"""
import re, subprocess, sys, tempfile, collections
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.runtime.jit import mangle_type
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.backends.nvidia.compiler import get_ptxas
from mxmoe.ops import fp8_wgmma as W

OPS = ("QGMMA", "FMUL", "FFMA", "LDS", "LDL", "STL", "BAR.SYNC", "WARPGROUP.DEPBAR", "WARPGROUP.ARRIVE",
       "SYNCS", "UTMALDG", "FENCE", "MEMBAR")


def loops(sass):
    # the loops (backward branches) of the SASS, innermost first, with their instruction counts
    lines = [ln for ln in sass.splitlines() if re.search(r"/\*[0-9a-f]{4,}\*/\s+\S", ln)]
    addr = {re.search(r"/\*([0-9a-f]{4,})\*/", ln).group(1).lstrip("0"): i for i, ln in enumerate(lines)}
    out = []
    for i, ln in enumerate(lines):
        m = re.search(r"BRA (?:`\(\.L_x_\d+\) )?0x([0-9a-f]+)", ln)
        if m and m.group(1).lstrip("0") in addr and addr[m.group(1).lstrip("0")] < i:
            body = lines[addr[m.group(1).lstrip("0")]:i + 1]
            ops = collections.Counter()
            for b in body:
                op = re.search(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", b).group(1)
                ops.update(o for o in OPS if op.startswith(o))
            out.append((len(body), ops, body))
    return sorted(out, key=lambda x: x[0])


def fp32_under_wgmmas(body):
    # per wgmma of a loop body: the FP32 ops (FMUL, FFMA) between it and its wait (the next
    # WARPGROUP.DEPBAR), i.e. issued while it runs
    ops = [re.search(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", b).group(1) for b in body]
    out = []
    for i, op in enumerate(ops):
        if op.startswith("QGMMA"):
            rest = ops[i + 1:]
            end = next((k for k, o in enumerate(rest) if o.startswith("WARPGROUP.DEPBAR")), len(rest))
            out.append(sum(o.startswith(("FMUL", "FFMA")) for o in rest[:end]))
    return out


for cfg in [W.DEFAULT_CONFIG, W.WgmmaConfig(bn=64, bk=256, stages=3)]:
    la, lb, lsa, lsb, nb = W._layouts(cfg)
    a = torch.empty(256, 256, dtype=torch.float8_e4m3fn)
    s = torch.empty(16, 256)
    for mode in (0, 1, 2):
        sig = {
            "a_desc": mangle_type(TensorDescriptor.from_tensor(a, [cfg.bm, min(cfg.bk, 128)], la)),
            "b_desc": mangle_type(TensorDescriptor.from_tensor(a, [cfg.bn, min(cfg.bk, 128)], lb)),
            "sa_desc": mangle_type(TensorDescriptor.from_tensor(s, [nb, cfg.bm], lsa)),
            "sb_desc": mangle_type(TensorDescriptor.from_tensor(s, [nb, cfg.bn], lsb)),
            "c_ptr": "*bf16", "offs_ptr": "*i32",
        }
        sig.update({n: "i32" for n in ["M", "N", "K", "E", "KB_PAD", "stride_cm", "stride_ce"]})
        const = dict(MODE=mode, BM=cfg.bm, BN=cfg.bn, BK=cfg.bk, STAGES=cfg.stages, GROUP_M=cfg.group_m,
                     num_warps=4)
        sig.update({n: "constexpr" for n in const})
        k = triton.compile(GluonASTSource(W._fp8_ws_kernel, sig, constexprs=const),
                           target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": 4, "maxnreg": W.WS_MAXNREG})
        with tempfile.TemporaryDirectory() as d:
            open(d + "/k.ptx", "w").write(k.asm["ptx"])
            r = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", d + "/k.ptx", "-o", d + "/k.cubin"],
                               capture_output=True, text=True)
            info = r.stdout + r.stderr
            assert r.returncode == 0, info
            cuobjdump = get_ptxas(90).path.replace("ptxas", "cuobjdump")
            sass = subprocess.run([cuobjdump, "-sass", d + "/k.cubin"], capture_output=True, text=True).stdout
        assert "C7514" not in info, info  # no wgmma serialization
        assert "0 bytes spill stores, 0 bytes spill loads" in info, info
        assert f"Used {W.WS_MAXNREG} registers" in info, info
        # the partitions' register budgets (setmaxnreg): consumers 240, loader 24
        assert re.search(r"USETMAXREG.TRY_ALLOC.CTAPOOL UP\d, 0xf0", sass), sass[:3000]
        assert "USETMAXREG.DEALLOC.CTAPOOL 0x18" in sass, sass[:3000]
        ls = loops(sass)
        # the consumer's stage loop: the innermost loop with wgmmas; per 32-block one m64 wgmma and
        # 2 FP32 ops per accumulator element (BN/2 per thread), no local memory, no TMA, and only
        # warpgroup-wide barriers (128 threads), no CTA-wide one
        n, ops, body = next(x for x in ls if x[1]["QGMMA"])
        nb_ = cfg.bk // 32
        assert ops["QGMMA"] == nb_ and ops["FMUL"] == ops["FFMA"] == nb_ * cfg.bn // 2, ops
        assert not ops["LDL"] and not ops["STL"] and not ops["UTMALDG"], ops
        assert not ops["FENCE"] and not ops["MEMBAR"], ops  # (the loader fences before a refill)
        bars = [b for b in body if "BAR.SYNC" in b]
        assert len(bars) <= 2 and all(re.search(r"BAR.SYNC\S* 0x\w+, 0x80 ;", b) for b in bars), bars
        # overlap within a warpgroup, in both consumers' stage loops (every mode: grouped K runs the
        # same unchecked loop): every wgmma but the stage's first is issued during the previous
        # block's promotion, at least half of its BN FP32 ops (per thread) before the wgmma's wait
        # (the grouped-K loop with a per-block branch had none)
        stage_loops = [x for x in ls if x[1]["QGMMA"] == nb_ and not x[1]["UTMALDG"]][:2]
        under = [fp32_under_wgmmas(b) for _, _, b in stage_loops]
        assert len(under) == 2 and all(u[0] == 0 and min(u[1:], default=cfg.bn) >= cfg.bn // 2
                                       for u in under), under
        # wgmma code: per consumer the stage loop, and grouped K the checked last stage after it
        assert sass.count("QGMMA") == (4 if mode == 2 else 2) * nb_, sass.count("QGMMA")
        # the loader's loop: TMA only
        ln, lops, _ = next(x for x in ls if x[1]["UTMALDG"])
        assert not lops["QGMMA"] and not lops["FFMA"], lops
        print(f"bn={cfg.bn} bk={cfg.bk} mode={mode}: consumer stage loop {n} instructions per warp "
              f"({n / nb_:.0f} per 32-block), {dict(ops)}, FP32 ops under each wgmma {under}; "
              f"loader loop {ln}: {dict(lops)}")
print("compiled")
"""


def test_ws_kernel_compiles_for_sm90():
    """Ahead-of-time compile of the kernel (every mode, the default and a 128x64x256 config) for sm_90a
    with Triton's bundled ptxas, and its SASS: no spills, no wgmma serialization (C7514), the
    partitions' register budgets, and the consumer's stage loop (BK/32 wgmmas, 2 FP32 ops per
    accumulator element and 32-block, no local memory, no TMA, no fence, no CTA-wide barrier; every
    wgmma but the stage's first issued during the previous block's promotion, grouped K included)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "0"}
    r = subprocess.run([sys.executable, "-c", WS_AOT_CHECK], env=env, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0 and "compiled" in r.stdout, (r.stdout + r.stderr)[-4000:]
    print(r.stdout)


@pytest.mark.gpu
def test_gpu_fp8_ops_capture_in_a_cuda_graph():
    """The fp8 backend's forward and backward (dense and grouped) record into a CUDA graph (the
    trainer's --training.cuda_graph): no host copy or sync inside (the B-scale column order was
    once a host index tensor), and a replay gives the eager step's bits."""
    torch.manual_seed(3)
    cfg = MXRecipe(gemm_backend="fp8")
    E, K, N = 4, 256, 384
    offs = torch.tensor([64, 64, 200, 320], device="cuda", dtype=torch.int32)
    x = torch.randn(320, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * K**-0.5).requires_grad_()
    we = (torch.randn(E, N, K, device="cuda", dtype=torch.bfloat16) * K**-0.5).requires_grad_()

    def step():
        x.grad = w.grad = we.grad = None
        y = mx_mm(x, w.t(), cfg) + mx_grouped_mm(x, we.transpose(-2, -1), offs, cfg)
        y.float().square().sum().backward()
        return y.detach(), x.grad, w.grad, we.grad

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        want = [t.clone() for t in step()]  # warm-up outside capture (kernels compiled, caches filled)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        got = step()
    g.replay()
    torch.cuda.synchronize()
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
