"""`mx_grouped_mm_swiglu(g, u, b_t, offs)` == `mx_grouped_mm(F.silu(g) * u, b_t, offs)` bit for bit:
the output and the gradients of g, u and the weights, on the qdq path (the fused SwiGLU + qdq
cast, h never in memory) and on the others (the composition); ragged and empty groups, rows
after the last group, bf16 and fp32, every subset of inputs requiring grad, CPU autocast,
no_grad, torch.compile(fullgraph=True); what it saves for backward. GPU (marked gpu): the same
equalities with the default recipe (the cuda kernels)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_same_bits

import mxmoe.ops.gemm_backend as gemm_backend
import mxmoe.quant.qdq as qdq_mod
from mxmoe.ops import mx_grouped_mm, mx_grouped_mm_swiglu
from mxmoe.recipe import MXRecipe
from tests.ops.recipes import CPU, CPU_BF16
from tests.ops.recipes import SWIGLU_COUNTS as COUNTS


def rand(shape, dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype)


def operands(counts, dtype, T=80, device="cpu"):
    """g, u (T, 64) of dtype (g spread over several binades: silu's both tails), w (E, 96, 64) fp32,
    the loss weights (T, 96), offs."""
    E, K, N = len(counts), 64, 96
    g = rand((T, K), dtype, 0, 4.0) * torch.exp2(torch.randint(-6, 6, (T, 1), generator=torch.Generator()
                                                                .manual_seed(9))).to(dtype)
    u = rand((T, K), dtype, 1)
    w = rand((E, N, K), torch.float32, 2, 0.1)
    dy = rand((T, N), torch.float32, 3)
    offs = torch.tensor(counts, dtype=torch.int32).cumsum(0).to(torch.int32)
    return [t.to(device) for t in (g, u, w, dy, offs)]


def unfused(g, u, w, offs, cfg):
    return mx_grouped_mm(F.silu(g) * u, w.transpose(-2, -1), offs, cfg)


def fused(g, u, w, offs, cfg):
    return mx_grouped_mm_swiglu(g, u, w.transpose(-2, -1), offs, cfg)


def run(fn, ops, cfg, req, autocast=False, grad=True):
    """fn on fresh leaves g, u, w (requiring grad as `req` says); the loss <y, dy>; returns
    (y, g.grad, u.grad, w.grad)."""
    g, u, w, dy, offs = ops
    g, u, w = (t.clone().requires_grad_(r and grad) for t, r in zip((g, u, w), req, strict=True))
    with torch.autocast(g.device.type, dtype=torch.bfloat16, enabled=autocast), torch.set_grad_enabled(grad):
        y = fn(g, u, w, offs, cfg)
    if grad and any(req):
        (y.float() * dy).sum().backward()
    return y.detach(), g.grad, u.grad, w.grad


def compare(got, want):
    for name, a, b in zip(("output", "g.grad", "u.grad", "w.grad"), got, want, strict=True):
        assert_same_bits(a, b, name, nan_payload=True)


class Spy:
    """Counts the fused cast's calls (`mxmoe.quant.qdq._swiglu_qdq_impl`)."""

    def __init__(self, monkeypatch):
        self.calls = 0
        impl = qdq_mod._swiglu_qdq_impl

        def counted(*args, **kw):
            self.calls += 1
            return impl(*args, **kw)

        monkeypatch.setattr(qdq_mod, "_swiglu_qdq_impl", counted)


REQS = [  # (g, u, w) requiring grad
    (True, True, True), (False, False, True), (True, True, False), (True, False, True), (False, True, False),
]


@pytest.mark.parametrize("req", REQS)
@pytest.mark.parametrize("counts", COUNTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_swiglu_grouped_bit_identical(monkeypatch, req, counts, dtype):
    """Output and every gradient equal bit for bit; the fused cast ran once where the weights need
    their gradient (the wgrad keeps h along M), not at all otherwise (h along K alone)."""
    spy = Spy(monkeypatch)
    ops = operands(counts, dtype)
    cfg = CPU_BF16 if dtype == torch.bfloat16 else CPU
    want = run(unfused, ops, cfg, req)
    assert spy.calls == 0
    got = run(fused, ops, cfg, req)
    compare(got, want)
    assert spy.calls == (1 if req[2] else 0)


def test_swiglu_grouped_other_backends_are_the_composition(monkeypatch):
    """Off the qdq path (the MX path, taken here by the emulated backend) the op is the composition:
    equal results, no fused cast."""
    spy = Spy(monkeypatch)
    monkeypatch.setattr(gemm_backend, "QDQ_BACKENDS", frozenset())
    ops = operands(COUNTS[0], torch.float32)
    compare(run(fused, ops, CPU, (True, True, True)), run(unfused, ops, CPU, (True, True, True)))
    assert spy.calls == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_swiglu_grouped_under_cpu_autocast(monkeypatch, dtype):
    """Under CPU bf16 autocast: bf16 g and u take the fused cast (no cast of h to make); fp32 g and
    u take the composition (autocast casts h to bf16); both equal the unfused code."""
    spy = Spy(monkeypatch)
    ops = operands(COUNTS[0], dtype)
    want = run(unfused, ops, CPU_BF16, (True, True, True), autocast=True)
    got = run(fused, ops, CPU_BF16, (True, True, True), autocast=True)
    compare(got, want)
    assert spy.calls == (1 if dtype == torch.bfloat16 else 0)


def test_swiglu_grouped_no_grad_and_mixed_dtypes():
    """Under no_grad (validation): no graph, the unfused output; g and u of different dtypes: the
    composition (mul promotes)."""
    ops = operands(COUNTS[0], torch.bfloat16)
    with torch.no_grad():
        y = fused(*ops[:3], ops[4], CPU_BF16)
        assert_same_bits(y, unfused(*ops[:3], ops[4], CPU_BF16), "no_grad output", nan_payload=True)
    assert y.grad_fn is None
    g, u, w, _, offs = ops
    mixed = fused(g, u.float(), w, offs, CPU), unfused(g, u.float(), w, offs, CPU)
    assert_same_bits(*mixed, "mixed dtypes", nan_payload=True)


def test_swiglu_grouped_saves_less(monkeypatch):
    """The fused op keeps g, u, h along M, the weights and offs; the unfused code keeps F.silu(g) too
    (mul's saved operand): one (T, K) tensor of g's dtype less."""
    ops = operands(COUNTS[0], torch.bfloat16)
    saved = {}
    for name, fn in (("unfused", unfused), ("fused", fused)):
        total = []

        def pack(t, total=total):
            total.append(t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            g, u, w = (t.clone().requires_grad_() for t in ops[:3])
            fn(g, u, w, ops[4], CPU_BF16)
        saved[name] = sum(total)
    assert saved["unfused"] - saved["fused"] == ops[0].numel() * 2, saved


def test_swiglu_grouped_errors():
    g, u, w, _, offs = operands(COUNTS[0], torch.float32)
    with pytest.raises(TypeError, match="u must be a Tensor, got float"):
        mx_grouped_mm_swiglu(g, 1.0, w.transpose(-2, -1), offs, CPU)
    with pytest.raises(ValueError, match=r"u has shape \(80, 32\); expected g's shape \(80, 64\)"):
        mx_grouped_mm_swiglu(g, u[:, :32], w.transpose(-2, -1), offs, CPU)
    with pytest.raises(ValueError, match="a has K=32"):
        mx_grouped_mm_swiglu(g[:, :32], u[:, :32], w.transpose(-2, -1), offs, CPU)
    with pytest.raises(TypeError, match="offs has dtype torch.int64"):
        mx_grouped_mm_swiglu(g, u, w.transpose(-2, -1), offs.long(), CPU)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_swiglu_grouped_compiles_fullgraph(backend):
    """One graph (fullgraph; the fused cast through its fake implementation): aot_eager gives the
    eager bits; inductor (which may fuse the backward's elementwise work) equal within rounding."""
    ops = operands(COUNTS[0], torch.float32)
    want = run(fused, ops, CPU, (True, True, True))
    got = run(torch.compile(fused, fullgraph=True, backend=backend), ops, CPU, (True, True, True))
    if backend == "aot_eager":
        compare(got, want)
        compare(got, run(unfused, ops, CPU, (True, True, True)))
    else:
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("counts", COUNTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_gpu_swiglu_grouped_bit_identical(counts, dtype):
    """The default recipe on the GPU (the cuda fused cast, "auto"): output and gradients equal to the
    unfused code bit for bit, in and out of bf16 autocast."""
    cfg = MXRecipe()
    ops = operands(counts, dtype, device="cuda")
    for autocast in (False, True):
        compare(run(fused, ops, cfg, (True, True, True), autocast),
                run(unfused, ops, cfg, (True, True, True), autocast))
