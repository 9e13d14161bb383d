"""`mx_grouped_swiglu_mlp(x, w1_t, w3_t, w2_t, offs)` == `mx_grouped_mm_swiglu(*mx_grouped_mm_shared(x,
(w1_t, w3_t), offs), w2_t, offs)` (the composition MXGroupedExperts ran before) bit for bit: the
output and the gradients of x, w1, w3 and w2, on the qdq path (one autograd Function whose backward
casts dg and du straight from dh, g and u, `swiglu_bwd_qdq_dim0_dim1`) and elsewhere (the
composition itself); ragged and empty groups, rows after the last group, bf16 and fp32, every subset
of inputs requiring grad, an MX activation, CPU autocast recasting x (not h), no_grad, the fp8
backend; what it saves for backward; torch.compile(fullgraph=True). GPU (marked gpu): the same
equalities with the default recipe (the cuda kernels)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import mxmoe.ops.gemm_backend as gemm_backend
import mxmoe.quant.qdq as qdq_mod
from mxmoe import to_mx
from mxmoe.ops import mx_grouped_mm, mx_grouped_mm_shared, mx_grouped_mm_swiglu, mx_grouped_swiglu_mlp
from mxmoe.quant.mx_tensor import make_grad_anchor
from mxmoe.recipe import MXRecipe
from tests.ops.recipes import CPU, CPU_BF16
from tests.ops.recipes import SWIGLU_COUNTS as COUNTS

D, H = 64, 96


def operands(counts, dtype, T=80, device="cpu"):
    """x (T, D) of dtype spread over several binades, w1, w3 (E, H, D), w2 (E, D, H) fp32, the loss
    weights dy (T, D), offs."""
    gen = torch.Generator().manual_seed(0)
    E = len(counts)
    spread = torch.exp2(torch.randint(-4, 4, (T, 1), generator=gen))
    x = (torch.randn(T, D, generator=gen) * 2 * spread).to(dtype)
    w1, w3 = (torch.randn(E, H, D, generator=gen) * 0.3 for _ in range(2))
    w2 = torch.randn(E, D, H, generator=gen) * 0.1
    dy = torch.randn(T, D, generator=gen)
    offs = torch.tensor(counts, dtype=torch.int32).cumsum(0).to(torch.int32)
    return [t.to(device) for t in (x, w1, w3, w2, dy, offs)]


def composed(x, w1_t, w3_t, w2_t, offs, cfg):
    g, u = mx_grouped_mm_shared(x, (w1_t, w3_t), offs, cfg)
    return mx_grouped_mm_swiglu(g, u, w2_t, offs, cfg)


def run(fn, ops, cfg, req, autocast=False, grad=True, mx_input=False):
    """fn on fresh leaves x, w1, w2, w3 (requiring grad as `req` = (x, w1, w3, w2) says), the loss
    <y, dy>; returns (y, x.grad, w1.grad, w3.grad, w2.grad) (x.grad: the MX activation's anchor's)."""
    x, w1, w3, w2, dy, offs = ops
    w1, w3, w2 = (t.clone().requires_grad_(r and grad) for t, r in zip((w1, w3, w2), req[1:], strict=True))
    if mx_input:
        xm = to_mx(x, recipe=cfg)
        leaf = make_grad_anchor(xm.shape, x.dtype, x.device).requires_grad_(req[0] and grad)
        xm = dataclasses.replace(xm, grad_anchor=leaf)
    else:
        xm = leaf = x.clone().requires_grad_(req[0] and grad)
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast), torch.set_grad_enabled(grad):
        y = fn(xm, w1.transpose(-2, -1), w3.transpose(-2, -1), w2.transpose(-2, -1), offs, cfg)
    if grad and any(req):
        (y.float() * dy).sum().backward()
    return y.detach(), leaf.grad, w1.grad, w3.grad, w2.grad


def compare(got, want):
    for name, a, b in zip(("output", "x.grad", "w1.grad", "w3.grad", "w2.grad"), got, want, strict=True):
        if b is None:
            assert a is None, name
            continue
        assert a is not None and a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), name


class Spy:
    """Counts the fused backward cast's calls (`mxmoe.quant.qdq._swiglu_bwd_qdq_impl`)."""

    def __init__(self, monkeypatch):
        self.calls = 0
        impl = qdq_mod._swiglu_bwd_qdq_impl

        def counted(*args, **kw):
            self.calls += 1
            return impl(*args, **kw)

        monkeypatch.setattr(qdq_mod, "_swiglu_bwd_qdq_impl", counted)


REQS = [  # (x, w1, w3, w2) requiring grad
    (True, True, True, True), (False, True, True, True), (True, False, False, False),
    (False, False, False, True), (False, True, False, False), (True, False, True, True),
]


@pytest.mark.parametrize("req", REQS)
@pytest.mark.parametrize("counts", COUNTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_swiglu_mlp_bit_identical(monkeypatch, req, counts, dtype):
    """Output and every gradient equal bit for bit to the composition and to single mx_grouped_mm
    calls; the fused backward cast ran once where dh is needed (x, w1 or w3 wants a gradient)."""
    ops = operands(counts, dtype)
    cfg = CPU_BF16 if dtype == torch.bfloat16 else CPU
    want = run(composed, ops, cfg, req)

    def single_ops(x, w1_t, w3_t, w2_t, offs, c):
        h = torch.nn.functional.silu(mx_grouped_mm(x, w1_t, offs, c)) * mx_grouped_mm(x, w3_t, offs, c)
        return mx_grouped_mm(h, w2_t, offs, c)

    single = run(single_ops, ops, cfg, req)
    compare(want, single)
    spy = Spy(monkeypatch)
    compare(run(mx_grouped_swiglu_mlp, ops, cfg, req), want)
    assert spy.calls == (1 if any(req[:3]) else 0)


def test_swiglu_mlp_mx_activation(monkeypatch):
    """An MX activation (the MXFP8 dispatch's output, its gradient through the grad anchor): equal to
    the composition on it, the fused backward cast used."""
    spy = Spy(monkeypatch)
    ops = operands(COUNTS[0], torch.bfloat16)
    for req in ((True, True, True, True), (True, False, False, False)):
        compare(run(mx_grouped_swiglu_mlp, ops, CPU_BF16, req, mx_input=True),
                run(composed, ops, CPU_BF16, req, mx_input=True))
    assert spy.calls == 2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_swiglu_mlp_under_cpu_autocast(monkeypatch, dtype):
    """Under CPU bf16 autocast x is cast to bf16 inside (its gradient summed in x's dtype after each
    cast back, as the composition's); g, u and h are bf16 (no recast of h): the fused path, equal to
    the composition, for fp32 and bf16 x. An MX activation of fp32 under bf16 autocast (h would be
    recast): the composition."""
    spy = Spy(monkeypatch)
    ops = operands(COUNTS[0], dtype)
    req = (True, True, True, True)
    compare(run(mx_grouped_swiglu_mlp, ops, CPU_BF16, req, autocast=True),
            run(composed, ops, CPU_BF16, req, autocast=True))
    assert spy.calls == 1
    if dtype == torch.float32:
        compare(run(mx_grouped_swiglu_mlp, ops, CPU_BF16, req, autocast=True, mx_input=True),
                run(composed, ops, CPU_BF16, req, autocast=True, mx_input=True))
        assert spy.calls == 1


def test_swiglu_mlp_other_backends_are_the_composition(monkeypatch):
    """Off the qdq path (the MX path, taken here by the emulated backend): the composition, equal
    results, no fused backward cast."""
    spy = Spy(monkeypatch)
    monkeypatch.setattr(gemm_backend, "QDQ_BACKENDS", frozenset())
    ops = operands(COUNTS[0], torch.float32)
    req = (True, True, True, True)
    compare(run(mx_grouped_swiglu_mlp, ops, CPU, req), run(composed, ops, CPU, req))
    assert spy.calls == 0


def test_swiglu_mlp_no_grad_and_errors():
    """Under no_grad (validation): no graph, the composition's output. Bad arguments: the
    composition's errors, naming the argument."""
    ops = operands(COUNTS[0], torch.bfloat16)
    x, w1, w3, w2, _, offs = ops
    with torch.no_grad():
        y = mx_grouped_swiglu_mlp(x, *(w.transpose(-2, -1) for w in (w1, w3, w2)), offs, CPU)
    assert y.grad_fn is None
    compare(run(mx_grouped_swiglu_mlp, ops, CPU, (True,) * 4, grad=False),
            run(composed, ops, CPU, (True,) * 4, grad=False))
    w1r, w3r, w2r = (w.transpose(-2, -1).requires_grad_() for w in (w1.clone(), w3.clone(), w2.clone()))
    # the weights' shapes are named as the weights (the composition named g and u, `a` for h, and
    # blamed offs for a w2 of another expert count)
    with pytest.raises(ValueError, match=r"w3_t has shape \(6, 64, 64\); expected w1_t's shape \(6, 64, 96"):
        mx_grouped_swiglu_mlp(x, w1r, w3r[..., :64], w2r, offs, CPU)
    with pytest.raises(ValueError, match=r"w2_t has shape \(6, 32, 64\); expected \(6, 96, D'\)"):
        mx_grouped_swiglu_mlp(x, w1r, w3r, w2r[:, :32], offs, CPU)
    with pytest.raises(ValueError, match=r"w2_t has shape \(3, 96, 64\); expected \(6, 96, D'\)"):
        mx_grouped_swiglu_mlp(x, w1r, w3r, w2r[:3], offs, CPU)
    with pytest.raises(TypeError, match="offs has dtype torch.int64"):
        mx_grouped_swiglu_mlp(x, w1r, w3r, w2r, offs.long(), CPU)
    with pytest.raises(TypeError, match="b_t has dtype torch.float16"):
        mx_grouped_swiglu_mlp(x, w1r, w3r, w2r.half(), offs, CPU)
    with pytest.raises(ValueError, match="a has K=32"):
        mx_grouped_swiglu_mlp(x[:, :32], w1r, w3r, w2r, offs, CPU)


def test_swiglu_mlp_saves_what_the_composition_saves():
    """The same tensors kept for backward as the composition (distinct storages and their bytes): x
    along M, g, u, h along M, the weights, offs (which the composition saves twice); dg and du are
    never kept."""
    ops = operands(COUNTS[0], torch.bfloat16)
    saved = {}
    for name, fn in (("composed", composed), ("fused", mx_grouped_swiglu_mlp)):
        kept = {}

        def pack(t, kept=kept):
            kept[t.untyped_storage().data_ptr()] = t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            x, w1, w3, w2 = (t.clone().requires_grad_() for t in ops[:4])
            fn(x, w1.transpose(-2, -1), w3.transpose(-2, -1), w2.transpose(-2, -1), ops[5], CPU_BF16)
        saved[name] = sorted(kept.values())
    assert saved["fused"] == saved["composed"], saved


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_swiglu_mlp_compiles_fullgraph(dtype):
    """One graph (fullgraph; the fused casts through their fakes): aot_eager gives the eager (and the
    composition's) bits."""
    ops = operands(COUNTS[0], dtype)
    cfg = CPU_BF16 if dtype == torch.bfloat16 else CPU
    req = (True, True, True, True)
    torch._dynamo.reset()
    compiled = torch.compile(mx_grouped_swiglu_mlp, fullgraph=True, backend="aot_eager")
    compare(run(compiled, ops, cfg, req), run(composed, ops, cfg, req))


@pytest.mark.gpu
@pytest.mark.parametrize("counts", COUNTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_gpu_swiglu_mlp_bit_identical(counts, dtype):
    """The default recipe on the GPU (the cuda fused casts, "auto"): output and gradients equal to
    the composition bit for bit, in and out of bf16 autocast, 4096 tokens in ragged groups too."""
    cfg = MXRecipe()
    for ops in (operands(counts, dtype, device="cuda"),
                operands([1000, 0, 2500, 590], dtype, T=4096, device="cuda")):
        for autocast in (False, True):
            for req in ((True, True, True, True), (True, False, False, True)):
                compare(run(mx_grouped_swiglu_mlp, ops, cfg, req, autocast),
                        run(composed, ops, cfg, req, autocast))


@pytest.mark.gpu
@pytest.mark.parametrize("counts, T", [(COUNTS[0], 80), ([1000, 0, 2500, 590], 4096)])
def test_gpu_swiglu_mlp_compiles_fullgraph(counts, T):
    """inductor on the GPU: one forward graph; its backward calls the C++ operator of the fused
    backward cast (the op decomposed, no mxmoe::swiglu_bwd_qdq left); the grouped GEMMs are
    torch._grouped_mm called from the graph (no mxmoe::grouped_mm custom op and its Python
    dispatch); rows after the last group (T > offs[-1]) come out zero; the output and the gradients
    close to eager's (inductor may fuse the elementwise rest)."""
    from torch._inductor.utils import run_and_get_code

    x, w1, w3, w2, dy, offs = operands(counts, torch.bfloat16, T=T, device="cuda")
    cfg = MXRecipe()

    def fwd(x, w1, w3, w2):
        return mx_grouped_swiglu_mlp(x, *(w.transpose(-2, -1) for w in (w1, w3, w2)), offs, cfg)

    def step(fn):
        leaves = [t.clone().requires_grad_() for t in (x, w1, w3, w2)]
        y = fn(*leaves)
        (y.float() * dy).sum().backward()
        return [y.detach()] + [t.grad for t in leaves]

    torch._dynamo.reset()
    compiled = torch.compile(fwd, fullgraph=True)
    got, codes = run_and_get_code(step, compiled)
    code = "\n".join(codes)
    assert "mxmoe_cuda.swiglu_bwd_qdq_dim0_dim1" in code and "torch.ops.mxmoe.swiglu_bwd_qdq" not in code
    assert "_grouped_mm" in code and "mxmoe.grouped_mm" not in code
    assert not got[0][int(offs[-1]):].any()
    for a, b in zip(got, step(fwd), strict=True):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=1e-3)
