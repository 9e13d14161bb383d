"""`zero_rows_after`: the rows of a grouped GEMM's output after the last group set to zero in place,
every other row untouched (the Triton kernel under the interpreter on CPU, and on the GPU)."""

from __future__ import annotations

import pytest
import torch

from mxmoe.ops.tail_rows import zero_rows_after

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")


def check(device: str, T: int, N: int, end: int, dtype: torch.dtype, pad: int = 0) -> None:
    """out (T, N) with row stride N + pad, filled with NaN-free random values; offs ending at end."""
    g = torch.Generator().manual_seed(T * 1000 + end)
    full = torch.randn(T, N + pad, generator=g).to(dtype).to(device)
    out = full[:, :N]
    before = full.clone()
    offs = torch.tensor([0, end // 2, end], dtype=torch.int32, device=device)
    assert zero_rows_after(out, offs) is out
    offs_strided = torch.tensor([0, 7, end // 2, 7, end], dtype=torch.int32, device=device)[::2]
    zero_rows_after(out, offs_strided)  # offs[-1] read through its stride: the same rows (idempotent)
    want = before.clone()
    want[end:, :N] = 0
    assert torch.equal(full, want), (T, N, end, dtype, pad)  # the padding columns untouched too


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_zero_rows_after_interpreter(dtype):
    """Tails of 0, 1, 63, 64, 65 and all rows; N below, at and above one column tile (256); a
    padded row stride (as torch._grouped_mm allocates)."""
    for T, N, end in ((130, 96, 130), (130, 96, 129), (130, 300, 67), (130, 256, 66), (130, 32, 65),
                      (64, 512, 0), (1, 8, 0), (1, 8, 1)):
        check("cpu", T, N, end, dtype)
    check("cpu", 100, 40, 37, dtype, pad=8)


def test_zero_rows_after_errors():
    out = torch.zeros(8, 16)
    offs = torch.tensor([4, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match="unit column stride"):
        zero_rows_after(out.t(), offs)
    with pytest.raises(ValueError, match="offs must be a non-empty 1D int32 tensor on cpu, got torch.int64"):
        zero_rows_after(out, offs.long())
    with pytest.raises(ValueError, match="offs must be a non-empty 1D int32 tensor"):
        zero_rows_after(out, offs[:0])


@pytest.mark.gpu
def test_gpu_zero_rows_after():
    """On the GPU: the same cases, bf16 and fp32, and a large output with and without a tail."""
    for dtype in (torch.bfloat16, torch.float32):
        for T, N, end in ((130, 96, 130), (130, 300, 67), (130, 32, 65), (64, 512, 0), (1, 8, 1)):
            check("cuda", T, N, end, dtype)
        check("cuda", 100, 40, 37, dtype, pad=8)
        check("cuda", 40000, 2048, 40000, dtype)
        check("cuda", 40000, 2048, 39001, dtype)


@pytest.mark.gpu
def test_gpu_grouped_mm_hp_rows_after_last_group_are_zero():
    """grouped_mm_hp (torch._grouped_mm, bf16) on an output whose rows after the last group are
    unwritten: those rows are zero, the others equal the per-group loop on CPU (fp32 compare)."""
    from mxmoe.ops.gemm import grouped_mm_hp

    torch.manual_seed(0)
    counts = [0, 100, 333, 0, 500]
    T = sum(counts) + 67
    offs = torch.tensor(counts).cumsum(0).to(torch.int32).cuda()
    a = torch.randn(T, 256, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(5, 256, 384, device="cuda", dtype=torch.bfloat16)
    torch.empty(T * 384 * 4, device="cuda").fill_(float("nan"))  # leave garbage in the allocator
    out = grouped_mm_hp(a, b, offs)
    assert not out[sum(counts):].any()
    ref = grouped_mm_hp(a.cpu().float(), b.cpu().float(), offs.cpu())
    torch.testing.assert_close(out.float().cpu(), ref, rtol=2e-2, atol=2e-1)


AOT_CHECK = """
import re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from mxmoe.ops.tail_rows import _BLOCK_N, _BLOCK_R, _zero_rows_after_kernel

for dt in ("bf16", "fp32"):
    sig = {"out_ptr": f"*{dt}", "offs_ptr": "*i32", "last": "i32", "T": "i32", "N": "i32",
           "stride": "i32", "BLOCK_R": "constexpr", "BLOCK_N": "constexpr"}
    attrs = {(i,): [["tt.divisibility", 16]] for i in (0, 4, 5)}  # out_ptr, N, stride
    src = ASTSource(_zero_rows_after_kernel, sig, constexprs={"BLOCK_R": _BLOCK_R, "BLOCK_N": _BLOCK_N},
                    attrs=attrs)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
    assert set(re.findall(r"st\\.global[.\\w]*", ptx)) == {"st.global.v4.b32"}, dt  # 16-byte stores
print("compiled")
"""


def test_kernel_compiles_for_sm90():
    """Ahead-of-time compile for sm_90 (Triton's bundled ptxas, no GPU; a subprocess, since the
    interpreter replaces the jit functions here): bf16 and fp32, 16-byte stores only."""
    import os
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", AOT_CHECK], env={**os.environ, "TRITON_INTERPRET": "0"},
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "compiled" in r.stdout, r.stderr[-3000:]
