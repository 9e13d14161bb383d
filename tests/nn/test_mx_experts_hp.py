"""MXGroupedExperts with the recipe's expert_gemm="bf16" (the exchange only), one process: the output
and every gradient equal, bit for bit, an independent reference — `GroupedExperts` (the bf16 experts)
on the rows quantized and dequantized by `to_mx` (Q(x)), the gradient of x straight through, the
output's gradient Q(dy) — for Tensor rows (no exchange: rounded here) and for the MXFP8 dispatch's
MXTensor rows (dequantized; Q(dy) is then the combine's job); fp32 and CPU bf16 autocast; ragged
and empty groups; torch.compile(fullgraph=True) traces it."""

from __future__ import annotations

import pytest
import torch

import mxmoe
from mxmoe.comm import a2a_dispatch_mxfp8
from mxmoe.nn import GroupedExperts, MXGroupedExperts
from mxmoe.recipe import recipe

HP = recipe("mxfp8_rceil", dim0_kernel="torch", dim1_kernel="torch", expert_gemm="bf16")
HP_FLOOR = HP.replace(scaling_mode="floor")
COUNTS = [9, 0, 40, 15]


def make():
    torch.manual_seed(0)
    ex = GroupedExperts(64, 96, 4)
    with torch.no_grad():
        for p in ex.parameters():
            p.normal_(0, 0.2)
    x = torch.randn(64, 64) * 2
    x[3] *= 1e-3  # a row of another scale: its own block exponents
    dy = torch.randn(64, 64)
    return ex, x, dy


def q(t: torch.Tensor, r) -> torch.Tensor:
    """The reference rounding: to_mx along the last dim, dequantized to t's dtype."""
    return mxmoe.to_mx(t.detach(), axis=-1, recipe=r).dequantize()


def grads(ex, y, dy, x):
    y.backward(dy)
    out = [y.detach(), x.grad, *(p.grad for p in (ex.w1, ex.w2, ex.w3))]
    ex.zero_grad(set_to_none=True)
    return out


def assert_bits(got, want):
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.dtype == b.dtype and a.shape == b.shape, (i, a.dtype, b.dtype)
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), i


def reference(ex, x, dy, counts, r, round_dy: bool, autocast: bool):
    """GroupedExperts on Q(x) (x in the autocast dtype first, as the EP dispatch sends it); dx is
    the gradient at Q(x) unchanged; the experts' backward starts from Q(dy) when round_dy."""
    xl = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        xs = xl.to(torch.bfloat16) if autocast else xl
        xq = q(xs, r).requires_grad_()
        y = ex(xq, counts)
    y.backward(q(dy.to(y.dtype), r).to(dy.dtype) if round_dy else dy)
    xs.backward(xq.grad)  # straight through, then the autocast cast's backward
    out = [y.detach(), xl.grad, *(p.grad for p in (ex.w1, ex.w2, ex.w3))]
    ex.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("r", [HP, HP_FLOOR], ids=["rceil", "floor"])
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "autocast_bf16"])
def test_tensor_rows_are_rounded_and_so_is_the_output_gradient(r, autocast):
    ex, x, dy = make()
    counts = torch.tensor(COUNTS)
    want = reference(ex, x, dy, counts, r, round_dy=True, autocast=autocast)
    m = MXGroupedExperts.from_experts(ex, r)
    xl = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = m(xl, counts)
    got = grads(ex, y, dy, xl)
    assert_bits(got, want)
    # not the bf16 experts on x itself: the rounding is there
    plain = ex(x, counts)
    assert not torch.allclose(want[0].float(), plain.float(), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("r", [HP, HP_FLOOR], ids=["rceil", "floor"])
def test_dispatched_rows_are_dequantized_and_the_gradient_goes_straight_through(r):
    """Rows from a2a_dispatch_mxfp8 (one rank, no process group): the experts see Q(x) exactly;
    dx is the high-precision gradient at Q(x); dy is used as given (the combine rounds it)."""
    ex, x, dy = make()
    counts = torch.tensor(COUNTS)
    want = reference(ex, x, dy, counts, r, round_dy=False, autocast=False)
    m = MXGroupedExperts.from_experts(ex, r)
    xl = x.clone().requires_grad_()
    rows = a2a_dispatch_mxfp8(xl, [64], [64], recipe=r)
    assert rows.scaling_mode == r.scaling_mode
    got = grads(ex, m(rows, counts), dy, xl)
    assert_bits(got, want)


def test_mx_rows_must_be_blocked_along_dim():
    ex, x, _ = make()
    m = MXGroupedExperts.from_experts(ex, HP)
    cols = mxmoe.to_mx(x, axis=0, recipe=HP)
    with pytest.raises(ValueError, match="x must be a 2D MXTensor blocked along dim"):
        m(cols, torch.tensor(COUNTS))


def test_bf16_experts_compile_fullgraph():
    """fullgraph with aot_eager (as the trainer compiles a local MoE layer): eager's bits."""
    ex, x, dy = make()
    counts = torch.tensor(COUNTS)
    m = MXGroupedExperts.from_experts(ex, HP)
    xl = x.clone().requires_grad_()
    want = grads(ex, m(xl, counts), dy, xl)
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    xl = x.clone().requires_grad_()
    assert_bits(grads(ex, compiled(xl, counts), dy, xl), want)


@pytest.mark.gpu
def test_gpu_tensor_rows_under_bf16_autocast():
    """The default recipe's kernels ("auto": the CUDA qdq operator in the module, the CUDA casts in
    the reference) under CUDA bf16 autocast, as the trainer runs: the output bit for bit the
    reference; the gradients to bf16 rounding (the GPU's grouped GEMM reductions may reorder)."""
    r = recipe(expert_gemm="bf16")
    ex, x, dy = make()
    ex, x, dy = ex.cuda(), x.cuda(), dy.cuda()
    counts = torch.tensor(COUNTS, device="cuda")
    xl = x.clone().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        xs = xl.to(torch.bfloat16)
        xq = q(xs, r).requires_grad_()
        y = ex(xq, counts)
    y.backward(q(dy.to(y.dtype), r))
    xs.backward(xq.grad)
    want = [y.detach(), xl.grad, *(p.grad for p in (ex.w1, ex.w2, ex.w3))]
    ex.zero_grad(set_to_none=True)
    m = MXGroupedExperts.from_experts(ex, r)
    xl = x.clone().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = m(xl, counts)
    got = grads(ex, y, dy.to(y.dtype), xl)
    assert_bits(got[:1], want[:1])
    for a, b in zip(got[1:], want[1:], strict=True):
        assert a.dtype == b.dtype and float((a.float() - b.float()).norm() / b.float().norm()) < 1e-2
