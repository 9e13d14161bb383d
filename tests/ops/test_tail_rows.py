"""`zero_rows_after`: the rows of a grouped GEMM's output after the last group set to zero in place,
every other row untouched: the Triton kernel under the interpreter on CPU; on the GPU the C++
operator `mxmoe_cuda::zero_rows_after` and the Triton kernel, each bit for bit against the same
rows zeroed by torch on the CPU, its argument checks, the "auto" choice, CUDA graphs and
torch.compile."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_same_bits, assert_sm90_check

from mxmoe.ops.tail_rows import zero_rows_after
from mxmoe.quant import backends, cuda_cast

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")


def check(device: str, T: int, N: int, end: int, dtype: torch.dtype, pad: int = 0, kernel: str = "auto",
          col: int = 0, groups: int = 3) -> None:
    """out (T, N) = columns col .. col + N - 1 of a (T, col + N + pad) buffer (that row stride; col > 0
    moves the data pointer off 16 bytes), filled with random values (signed zeros included); offs
    of `groups` groups ending at end. Every element of the buffer but the zeroed rows keeps its bits
    (the rows before end, and the columns outside out)."""
    g = torch.Generator().manual_seed(T * 1000 + end + 7 * groups)
    full = torch.randn(T, col + N + pad, generator=g)
    full[torch.rand(T, col + N + pad, generator=g) < 0.05] = -0.0
    full = full.to(dtype).to(device)
    out = full[:, col : col + N]
    want = full.cpu().clone()
    want[end:, col : col + N] = 0
    ends = torch.sort(torch.randint(0, end + 1, (groups - 1,), generator=g)).values.tolist() + [end]
    offs = torch.tensor(ends, dtype=torch.int32, device=device)
    assert zero_rows_after(out, offs, kernel=kernel) is out
    what = (T, N, end, dtype, pad, kernel, col, groups)
    assert_same_bits(full, want, str(what), nan_payload=True)
    offs_strided = torch.tensor([x for e in ends for x in (e, 0)], dtype=torch.int32, device=device)[::2]
    zero_rows_after(out, offs_strided, kernel=kernel)  # offs[-1] read through its stride (else 0: all rows)
    assert_same_bits(full, want, str((*what, "strided offs")), nan_payload=True)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_zero_rows_after_interpreter(dtype):
    """Tails of 0, 1, 63, 64, 65 and all rows; N below, at and above one column tile (256); a
    padded row stride (as torch._grouped_mm allocates)."""
    for T, N, end in ((130, 96, 130), (130, 96, 129), (130, 300, 67), (130, 256, 66), (130, 32, 65),
                      (64, 512, 0), (1, 8, 0), (1, 8, 1)):
        check("cpu", T, N, end, dtype)
    check("cpu", 100, 40, 37, dtype, pad=8)
    check("cpu", 70, 20, 3, dtype, pad=5, kernel="triton", col=3, groups=1)


def test_zero_rows_after_errors():
    out = torch.zeros(8, 16)
    offs = torch.tensor([4, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match="unit column stride"):
        zero_rows_after(out.t(), offs)
    with pytest.raises(ValueError, match="offs must be a non-empty 1D int32 tensor on cpu, got torch.int64"):
        zero_rows_after(out, offs.long())
    with pytest.raises(ValueError, match="offs must be a non-empty 1D int32 tensor"):
        zero_rows_after(out, offs[:0])
    with pytest.raises(TypeError, match="out must be bfloat16 or float32, got torch.float16"):
        zero_rows_after(out.half(), offs)
    with pytest.raises(ValueError, match=r"kernel='torch'; expected one of \['auto', 'triton', 'cuda'\]"):
        zero_rows_after(out, offs, kernel="torch")
    with pytest.raises(RuntimeError, match=r"kernel='cuda' needs a CUDA tensor \(got a cpu tensor\)"):
        zero_rows_after(out, offs, kernel="cuda")


# (T, N, end, pad, col, groups): tails of all, none, one, some rows; E = 1 and 64 groups; row
# strides with padding (16-byte aligned rows: the C++ kernel's 16-byte stores) and without 16-byte
# alignment (its element stores: odd pads, N not a multiple of 8, a data pointer off 16 bytes).
GPU_CASES = (
    (130, 96, 130, 0, 0, 3), (130, 96, 129, 0, 0, 3), (130, 300, 67, 0, 0, 3), (130, 256, 66, 0, 0, 1),
    (130, 32, 65, 0, 0, 64), (64, 512, 0, 0, 0, 1), (64, 512, 0, 0, 0, 64), (1, 8, 0, 0, 0, 1),
    (1, 8, 1, 0, 0, 2), (100, 40, 37, 8, 0, 3), (100, 40, 37, 24, 0, 64), (100, 40, 100, 8, 0, 1),
    (100, 40, 37, 3, 0, 3), (100, 13, 50, 0, 0, 3), (100, 64, 50, 0, 1, 3), (100, 64, 50, 5, 3, 1),
    (40000, 2048, 40000, 0, 0, 8), (40000, 2048, 39001, 0, 0, 8), (40000, 1000, 12345, 24, 0, 64),
)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("kernel", ["cuda", "triton", "auto"])
def test_gpu_zero_rows_after(dtype, kernel):
    """The C++ operator, the Triton kernel and "auto", each against the rows zeroed by torch on the
    CPU, bit for bit (so the two kernels agree bit for bit): every case of GPU_CASES."""
    for T, N, end, pad, col, groups in GPU_CASES:
        check("cuda", T, N, end, dtype, pad=pad, kernel=kernel, col=col, groups=groups)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["cuda", "triton"])
def test_gpu_zero_rows_after_past_2_31_elements(kernel):
    """Row offsets past 2^31 elements (int64 addressing): 2^20 + 3 rows of 2048 bf16 (4 GiB)."""
    T, N, end = (1 << 20) + 3, 2048, (1 << 20) - 5
    out = torch.ones(T, N, dtype=torch.bfloat16, device="cuda")
    zero_rows_after(out, torch.tensor([end // 3, end], dtype=torch.int32, device="cuda"), kernel=kernel)
    assert bool((out[:end] == 1).all()) and not out[end:].any()
    assert bool(out[end:].signbit().logical_not().all())  # +0, as torch's zeros


@pytest.mark.gpu
def test_gpu_auto_takes_the_cpp_operator_else_triton(monkeypatch):
    """"auto" (the grouped GEMM's call) runs the C++ operator where the extension loads, and the
    Triton kernel where resolve_kernel's "auto" says the extension cannot run."""
    from mxmoe.ops import tail_rows

    cuda_cast.load_extension()
    calls = []
    real = cuda_cast.zero_rows_after
    monkeypatch.setattr(cuda_cast, "zero_rows_after", lambda o, f: calls.append(1) or real(o, f))
    backends.clear_resolved()
    check("cuda", 130, 96, 67, torch.bfloat16)
    assert calls == [1, 1]
    dev = torch.device("cuda", torch.cuda.current_device())
    monkeypatch.setitem(backends._resolved, ("auto", dev, "dim0"), "triton")
    check("cuda", 130, 96, 67, torch.bfloat16)
    assert calls == [1, 1]
    out = torch.ones(8, 16, device="cuda")
    tail_rows.zero_rows_after_trusted(out, torch.tensor([5], dtype=torch.int32, device="cuda"))
    assert calls == [1, 1] and out[:5].eq(1).all() and not out[5:].any()


@pytest.mark.gpu
def test_gpu_cpp_operator_checks_its_arguments():
    """mxmoe_cuda::zero_rows_after checks in C++ and names the argument (called directly)."""
    cuda_cast.load_extension()
    op = torch.ops.mxmoe_cuda.zero_rows_after
    out = torch.zeros(8, 16, device="cuda")
    offs = torch.tensor([4, 8], dtype=torch.int32, device="cuda")
    with pytest.raises(RuntimeError, match="out must be a CUDA tensor, got device cpu"):
        op(out.cpu(), offs)
    bad_out = r"out must be 2D \(T, N\) with unit column stride, got shape "
    with pytest.raises(RuntimeError, match=bad_out + r"\(16, 8\) strides \(1, 16\)"):
        op(out.t(), offs)
    with pytest.raises(RuntimeError, match=bad_out + r"\(2, 4, 16\) strides \(64, 16, 1\)"):
        op(out.view(2, 4, 16), offs)
    with pytest.raises(TypeError, match="out is Half; expected BFloat16 or Float"):
        op(out.half(), offs)
    with pytest.raises(TypeError, match=r"offs must be a 1D Int tensor of cumulative group ends, got Long "
                                        r"of shape \(2\)"):
        op(out, offs.long())
    with pytest.raises(RuntimeError, match=r"offs must have at least 1 group, got shape \(0\)"):
        op(out, offs[:0])
    with pytest.raises(RuntimeError, match="offs is on cpu, out on cuda:0"):
        op(out, offs.cpu())
    op(out[:0], offs)  # an empty out: nothing to do
    assert not out.any()


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["cuda", "triton"])
def test_gpu_zero_rows_after_in_cuda_graph(kernel):
    """No host sync: captured in a CUDA graph, each replay reads offs[-1] as it is then."""
    out = torch.empty(300, 64, dtype=torch.bfloat16, device="cuda")
    offs = torch.tensor([10, 300], dtype=torch.int32, device="cuda")
    zero_rows_after(out.fill_(1), offs, kernel=kernel)  # warm-up: build / compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        zero_rows_after(out, offs, kernel=kernel)
    for end in (300, 123, 0, 299):
        out.fill_(1)
        offs[-1] = end
        graph.replay()
        assert bool((out[:end] == 1).all()) and not out[end:].any(), (kernel, end)


@pytest.mark.gpu
def test_gpu_compile_fullgraph():
    """torch.compile(fullgraph=True) traces zero_rows_after (the C++ operator through its fake
    implementation, functionalized) and the grouped GEMM that calls it, as the custom op and as the
    MX ops' `_grouped` (traced: torch._grouped_mm and the operator, no custom op); no graph break,
    compiled results equal eager bit for bit."""
    from mxmoe.ops.gemm import _grouped, grouped_mm

    cuda_cast.load_extension()

    def tail(x, offs):
        y = x * 2
        return zero_rows_after(y, offs), x + 1

    def grouped(a, b, offs):
        return (grouped_mm(a, b, offs) * 3,)

    def traced(a, b, offs):
        return (_grouped(a, b, offs) * 3,)

    torch.manual_seed(1)
    x = torch.randn(200, 96, device="cuda", dtype=torch.bfloat16)
    offs = torch.tensor([50, 120, 170], dtype=torch.int32, device="cuda")
    b = torch.randn(3, 96, 64, device="cuda", dtype=torch.bfloat16)
    for fn, args in ((tail, (x, offs)), (grouped, (x, b, offs)), (traced, (x, b, offs))):
        torch._dynamo.reset()
        explanation = torch._dynamo.explain(fn)(*args)
        assert explanation.graph_break_count == 0, explanation.break_reasons
        got, want = torch.compile(fn, fullgraph=True)(*args), fn(*args)
        for g, w in zip(got, want, strict=True):
            assert_same_bits(g, w, fn.__name__, nan_payload=True)
    for fn, args in ((tail, (x, offs)), (grouped, (x, b, offs)), (traced, (x, b, offs))):
        assert not fn(*args)[0][170:].any() and not torch.compile(fn, fullgraph=True)(*args)[0][170:].any()


@pytest.mark.gpu
def test_gpu_grouped_mm_rows_after_last_group_are_zero():
    """grouped_mm (torch._grouped_mm, bf16) on an output whose rows after the last group are
    unwritten: those rows are zero, the others equal the per-group loop on CPU (fp32 compare)."""
    from mxmoe.ops.gemm import grouped_mm

    torch.manual_seed(0)
    counts = [0, 100, 333, 0, 500]
    T = sum(counts) + 67
    offs = torch.tensor(counts).cumsum(0).to(torch.int32).cuda()
    a = torch.randn(T, 256, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(5, 256, 384, device="cuda", dtype=torch.bfloat16)
    torch.empty(T * 384 * 4, device="cuda").fill_(float("nan"))  # leave garbage in the allocator
    out = grouped_mm(a, b, offs)
    assert not out[sum(counts):].any()
    ref = grouped_mm(a.cpu().float(), b.cpu().float(), offs.cpu())
    torch.testing.assert_close(out.float().cpu(), ref, rtol=2e-2, atol=2e-1)


def test_kernel_compiles_for_sm90(triton_sm90):
    """Ahead-of-time compile for sm_90 (Triton's bundled ptxas, no GPU; tests/triton_sm90.py, run
    where the interpreter is off): bf16 and fp32, 16-byte stores only."""
    assert_sm90_check(triton_sm90, "zero_rows_after_kernel")


def test_cpp_kernel_compiles_for_sm90_with_16_byte_stores(mx_cast_sm90):
    """csrc/*.cu to PTX for sm_90 (nvcc, no GPU): zero_rows_after_kernel stores 16-byte
    vectors on aligned rows and single bf16 / fp32 elements otherwise, with one load (offs[-1])
    and no division."""
    import re

    stores = {}
    ptx = mx_cast_sm90.ptx
    for unit, body in re.findall(r"\.entry \S*zero_rows_after_kernelI(\w+?)E\S*\((.*?)\n\}", ptx, re.S):
        stores[unit] = (set(re.findall(r"st\.global[.\w]*", body)), re.findall(r"ld\.global[.\w]*", body),
                        re.findall(r"\bdiv\.", body))
    assert stores == {"5uint4": ({"st.global.v4.u32"}, ["ld.global.nc.s32"], []),
                      "t": ({"st.global.u16"}, ["ld.global.nc.s32"], []),
                      "j": ({"st.global.u32"}, ["ld.global.nc.s32"], [])}, stores
