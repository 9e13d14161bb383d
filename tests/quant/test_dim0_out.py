"""quantize_dim0(x, spec, out=(q, s)): every backend writes into caller-provided buffers (e.g. slices of
a communication buffer) exactly what it returns without `out`, and touches nothing else."""

from __future__ import annotations

import pytest
import torch

from mxmoe.formats import make_spec
from mxmoe.quant import available_kernels
from mxmoe.quant.backends import backend
from mxmoe.quant.checks import check_dim0_out
from tests.comm.test_comm_a2a import make_rows

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KERNELS = available_kernels(DEVICE)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("mode", ["rceil", "floor"])
def test_out_writes_into_slices_only(kernel, dtype, mode):
    spec = make_spec(32, mode, torch.float8_e4m3fn)
    R, C = 37, 96
    x = make_rows(R, C, dtype, seed=5).to(DEVICE)
    q_ref, s_ref = backend(kernel).quantize_dim0(x, spec)
    qbuf = torch.full((R + 9, C), 0xA5, dtype=torch.uint8, device=DEVICE)
    sbuf = torch.full((R + 9, C // 32), 0x5A, dtype=torch.uint8, device=DEVICE)
    q, s = backend(kernel).quantize_dim0(x, spec, out=(qbuf[4 : 4 + R], sbuf[4 : 4 + R]))
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float8_e8m0fnu
    assert q.data_ptr() == qbuf[4].data_ptr() and s.data_ptr() == sbuf[4].data_ptr()
    assert torch.equal(qbuf[4 : 4 + R], q_ref.view(torch.uint8))
    assert torch.equal(sbuf[4 : 4 + R], s_ref.view(torch.uint8))
    for part in (qbuf[:4], qbuf[4 + R :]):
        assert bool((part == 0xA5).all()), "bytes outside out[0] changed"
    for part in (sbuf[:4], sbuf[4 + R :]):
        assert bool((part == 0x5A).all()), "bytes outside out[1] changed"


def test_out_rejects_bad_buffers():
    """checks.check_dim0_out (what callers with their own buffers run once) names the bad buffer."""
    spec = make_spec(32, "rceil", torch.float8_e4m3fn)
    x = torch.ones(4, 64, device=DEVICE)
    q = torch.empty(4, 64, dtype=torch.uint8, device=DEVICE)
    s = torch.empty(4, 2, dtype=torch.uint8, device=DEVICE)
    with pytest.raises(ValueError, match=r"out\[0\] has shape \(4, 32\)"):
        check_dim0_out(x, spec, (q[:, :32], s))
    with pytest.raises(ValueError, match=r"out\[1\].*contiguous: False"):
        check_dim0_out(x, spec, (q, torch.empty(2, 4, dtype=torch.uint8, device=DEVICE).t()))
    with pytest.raises(TypeError, match=r"out\[0\] must be a torch.float8_e4m3fn \(or uint8\) tensor"):
        check_dim0_out(x, spec, (q.float(), s))
    with pytest.raises(TypeError, match="pair"):
        check_dim0_out(x, spec, q)
    qv, sv = check_dim0_out(x, spec, (q, s))
    assert qv.dtype == torch.float8_e4m3fn and sv.dtype == torch.float8_e8m0fnu
