"""MXGroupedExperts with the fused SwiGLU + qdq cast of the w2 input and, in backward, the fused
SwiGLU backward + qdq casts of dg and du (`mx_grouped_swiglu_mlp`): the loss and every gradient (x,
w1, w2, w3) equal bit for bit to the unfused experts (h = F.silu(g) * u written, then
mx_grouped_mm; dg and du written by autograd, then cast), bf16 and fp32, ragged and empty groups
and tokens after the last group; torch.compile(fullgraph=True) traces it; GPU (marked gpu) with the
default recipe."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_same_bits

import mxmoe.quant.qdq as qdq_mod
from mxmoe.nn import MXGroupedExperts
from mxmoe.nn.experts import offsets_from_counts
from mxmoe.ops import mx_grouped_mm, mx_grouped_mm_shared
from mxmoe.ops.gemm import autocast_input
from mxmoe.recipe import MXRecipe

CFG = MXRecipe(dim0_kernel="torch", dim1_kernel="torch")
CASES = [[9, 0, 40, 15], [0, 0, 64, 0], [30, 1, 0, 2]]  # the last: 31 tokens after the last group


def unfused_forward(ex: MXGroupedExperts, x, counts):
    """MXGroupedExperts.forward as it was before the fused cast: h in memory."""
    cfg = ex.recipe
    offs = offsets_from_counts(counts)
    x = autocast_input(x)
    g, u = mx_grouped_mm_shared(x, (ex.w1.transpose(-2, -1), ex.w3.transpose(-2, -1)), offs, cfg)
    return mx_grouped_mm(F.silu(g) * u, ex.w2.transpose(-2, -1), offs, cfg)


def loss_and_grads(ex, fwd, x, counts, dy):
    ex.zero_grad(set_to_none=True)
    xl = x.clone().requires_grad_()
    y = fwd(ex, xl, counts)
    loss = (y.float() * dy).sum()
    loss.backward()
    return [loss.detach(), y.detach(), xl.grad, *(p.grad for p in (ex.w1, ex.w2, ex.w3))]


def assert_bits(got, want):
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert_same_bits(a, b, str(i), nan_payload=True)


def make(dtype, device="cpu", cfg=CFG, T=64):
    torch.manual_seed(0)
    ex = MXGroupedExperts(64, 96, 4, recipe=cfg).to(device=device, dtype=dtype)
    with torch.no_grad():
        for p in ex.parameters():
            p.normal_(0, 0.2)
    x = (torch.randn(T, 64) * 2).to(device=device, dtype=dtype)
    dy = torch.randn(T, 64, device=device)
    return ex, x, dy


@pytest.mark.parametrize("counts", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_experts_fused_swiglu_bit_identical(monkeypatch, counts, dtype):
    calls, bwd_calls = [], []
    impl, bwd_impl = qdq_mod._swiglu_qdq_impl, qdq_mod._swiglu_bwd_qdq_impl
    monkeypatch.setattr(qdq_mod, "_swiglu_qdq_impl", lambda *a, **k: calls.append(1) or impl(*a, **k))
    monkeypatch.setattr(qdq_mod, "_swiglu_bwd_qdq_impl",
                        lambda *a, **k: bwd_calls.append(1) or bwd_impl(*a, **k))
    ex, x, dy = make(dtype)
    c = torch.tensor(counts)
    want = loss_and_grads(ex, unfused_forward, x, c, dy)
    assert not calls and not bwd_calls
    got = loss_and_grads(ex, MXGroupedExperts.forward, x, c, dy)
    assert calls == [1]  # the w2 input cast: the fused op
    assert bwd_calls == [1]  # the casts of dg and du: the fused backward op
    assert_bits(got, want)


def test_experts_fused_swiglu_compiles_fullgraph():
    """fullgraph with aot_eager: the eager (and unfused) bits; the fused op traced via its fake."""
    ex, x, dy = make(torch.float32)
    c = torch.tensor(CASES[0])
    want = loss_and_grads(ex, unfused_forward, x, c, dy)
    compiled = torch.compile(MXGroupedExperts.forward, fullgraph=True, backend="aot_eager")
    assert_bits(loss_and_grads(ex, compiled, x, c, dy), want)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_gpu_experts_fused_swiglu_bit_identical(dtype):
    """Default recipe on the GPU (the cuda fused cast): loss and gradients equal to the unfused
    experts bit for bit; 4096 tokens in ragged groups with an empty one."""
    ex, x, dy = make(dtype, "cuda", None, T=4096)
    c = torch.tensor([1000, 0, 2500, 596], device="cuda")
    assert_bits(loss_and_grads(ex, MXGroupedExperts.forward, x, c, dy),
                loss_and_grads(ex, unfused_forward, x, c, dy))
