"""`mx_mm_shared` / `mx_grouped_mm_shared`: several MX GEMMs on one input with one cast of it, bit
for bit what the single ops give when called once per weight (outputs, the input's gradient and
every weight's gradient), with fewer quantizer calls and one saved copy of the input along M."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import assert_same_bits

import mxmoe.ops.gemm_backend as gemm_backend
import mxmoe.quant.qdq as qdq_mod
from mxmoe import to_mx
from mxmoe.ops import mx_grouped_mm, mx_grouped_mm_shared, mx_mm, mx_mm_shared
from mxmoe.quant.mx_tensor import make_grad_anchor
from mxmoe.recipe import MXRecipe
from tests.ops.recipes import CPU, CPU_BF16

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")



def rand(shape, dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype)


def bits_equal(got, want, what):
    """Byte for byte (NaN payloads included) and the same strides."""
    assert_same_bits(got, want, what, nan_payload=True)
    assert got is None or got.stride() == want.stride(), what


class Counts:
    """Counts the quantizer's calls (`mxmoe.quant.qdq._qdq_impl`, what every qdq / qdq_dim0_dim1 of
    the ops runs in eager mode) and the bytes autograd saves for backward."""

    def __init__(self, monkeypatch):
        self.qdq = 0
        impl = qdq_mod._qdq_impl

        def counted(*args):
            self.qdq += 1
            return impl(*args)

        monkeypatch.setattr(qdq_mod, "_qdq_impl", counted)

    def saved_bytes(self, fn):
        total = []

        def pack(t):
            total.append(t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = fn()
        return out, sum(total)


def run(fn, x, ws, gs, req_x, req_w, used, autocast, grad=True):
    """fn(x, ws) -> outputs; the loss sum_i <y_i, g_i> over the `used` outputs; returns (outputs,
    x.grad, [w.grad]). x and the weights are fresh leaves."""
    x = x.clone().requires_grad_(req_x and grad)
    ws = [w.clone().requires_grad_(r and grad) for w, r in zip(ws, req_w, strict=True)]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), torch.set_grad_enabled(grad):
        ys = fn(x, ws)
    if grad and used and (req_x or any(req_w)):
        loss = sum((ys[i].float() * gs[i]).sum() for i in used)
        loss.backward()
    return [y.detach() for y in ys], x.grad, [w.grad for w in ws]


def compare(got, want):
    for i, (g, w) in enumerate(zip(got[0], want[0], strict=True)):
        bits_equal(g, w, f"output {i}")
    bits_equal(got[1], want[1], "input gradient")
    for i, (g, w) in enumerate(zip(got[2], want[2], strict=True)):
        bits_equal(g, w, f"gradient of weight {i}")


MM_CASES = [  # (req_x, req_w per weight, used outputs)
    (True, (True, True, True), (0, 1, 2)),
    (True, (False, True, False), (0, 1, 2)),
    (False, (True, True, True), (0, 1, 2)),
    (True, (False, False, False), (0, 1, 2)),
    (True, (True, True, True), (0, 2)),  # an unused output: no gradient for its weight
]


def mm_operands(dtype, lead=(3, 15)):
    K, Ns = 64, (96, 32, 32)  # q, k, v-like: different N
    x = rand((*lead, K), dtype, 0)
    ws = [rand((N, K), torch.float32, 1 + i, 0.1) for i, N in enumerate(Ns)]
    gs = [rand((*lead, N), torch.float32, 10 + i) for i, N in enumerate(Ns)]
    return x, ws, gs


def separate_mm(cfg):
    return lambda x, ws: [mx_mm(x, w.t(), cfg) for w in ws]


def shared_mm(cfg):
    return lambda x, ws: mx_mm_shared(x, [w.t() for w in ws], cfg)


@pytest.mark.parametrize("case", MM_CASES)
@pytest.mark.parametrize(
    "path,dtype,autocast",
    [
        ("qdq", torch.float32, False),
        ("qdq", torch.bfloat16, False),
        ("qdq", torch.float32, True),  # fp32 x under bf16 autocast: each op's cast, one here
        ("mx", torch.float32, False),
        ("mx", torch.float32, True),
    ],
)
def test_mx_mm_shared_bit_identical(monkeypatch, case, path, dtype, autocast):
    req_x, req_w, used = case
    cfg = {"qdq": CPU_BF16 if autocast else CPU, "mx": CPU}[path]
    if path == "mx":  # the MX path with the emulated GEMM (as tests/ops/test_qdq_path.py takes it)
        monkeypatch.setattr(gemm_backend, "QDQ_BACKENDS", frozenset())
    x, ws, gs = mm_operands(dtype)
    want = run(separate_mm(cfg), x, ws, gs, req_x, req_w, used, autocast)
    got = run(shared_mm(cfg), x, ws, gs, req_x, req_w, used, autocast)
    compare(got, want)


def test_mx_mm_shared_forward_only_and_2d_input():
    x, ws, gs = mm_operands(torch.float32, lead=(45,))
    want = run(separate_mm(CPU), x, ws, gs, True, (True,) * 3, (0, 1, 2), False, grad=False)
    got = run(shared_mm(CPU), x, ws, gs, True, (True,) * 3, (0, 1, 2), False, grad=False)
    compare(got, want)
    want = run(separate_mm(CPU), x, ws, gs, True, (True,) * 3, (0, 1, 2), False)
    got = run(shared_mm(CPU), x, ws, gs, True, (True,) * 3, (0, 1, 2), False)
    compare(got, want)


def test_mx_mm_shared_one_cast_of_x_and_one_saved_copy(monkeypatch):
    """Three weights (each op casts its weight along K and N from one read in the forward and keeps
    the cast along N for the dgrad: `cast_weight`): the forward casts x once instead of three times
    (qdq_dim0_dim1: along K, and along M kept for the wgrads), 6 -> 4 quantizer calls; the backward
    casts each dy as before (3 calls) and no weight; autograd keeps x along M once: the saved bytes
    drop by two copies of it."""
    counts = Counts(monkeypatch)
    x, ws, gs = mm_operands(torch.float32)
    M, K = 45, 64
    x1_bytes = M * K * 4  # x along M, (M, K) fp32 (the compute dtype of this recipe on CPU)
    res = {}
    for name, fn in (("separate", separate_mm(CPU)), ("shared", shared_mm(CPU))):
        counts.qdq = 0
        _, saved = counts.saved_bytes(lambda fn=fn: run(fn, x, ws, gs, True, (True,) * 3, (), False))
        fwd = counts.qdq
        run(fn, x, ws, gs, True, (True,) * 3, (0, 1, 2), False)
        res[name] = (fwd, counts.qdq - 2 * fwd, saved)  # forward calls, backward calls, saved
    assert res["separate"][:2] == (6, 3) and res["shared"][:2] == (4, 3), res
    assert res["separate"][2] - res["shared"][2] == 2 * x1_bytes, res


def test_mx_mm_shared_errors():
    x = torch.randn(4, 64)
    with pytest.raises(TypeError, match="non-empty list or tuple"):
        mx_mm_shared(x, [])
    with pytest.raises(TypeError, match="non-empty list or tuple"):
        mx_mm_shared(x, torch.randn(64, 32))
    with pytest.raises(ValueError, match=r"b \(48, 32\)"):
        mx_mm_shared(x, [torch.randn(64, 32), torch.randn(48, 32)])
    with pytest.raises(ValueError, match="N=40"):
        mx_mm_shared(x, [torch.randn(64, 40)])


# ------------------------------------------------------------------------------------------------
# Grouped
# ------------------------------------------------------------------------------------------------

COUNTS = [[0, 5, 31, 33], [32, 0, 0, 1]]  # empty groups, sizes no multiple of 32, rows after offs[-1]


def grouped_operands(counts, dtype, T=80):
    E, K, Ns = len(counts), 64, (96, 96)
    a = rand((T, K), dtype, 0)
    ws = [rand((E, N, K), torch.float32, 1 + i, 0.1) for i, N in enumerate(Ns)]
    gs = [rand((T, N), torch.float32, 10 + i) for i, N in enumerate(Ns)]
    offs = torch.tensor(counts, dtype=torch.int32).cumsum(0).to(torch.int32)
    return a, ws, gs, offs


def separate_grouped(cfg, offs):
    return lambda a, ws: [mx_grouped_mm(a, w.transpose(-2, -1), offs, cfg) for w in ws]


def shared_grouped(cfg, offs):
    return lambda a, ws: mx_grouped_mm_shared(a, [w.transpose(-2, -1) for w in ws], offs, cfg)


GROUPED_CASES = [
    (True, (True, True), (0, 1)),
    (True, (True, False), (0, 1)),
    (False, (True, True), (0, 1)),
    (True, (False, False), (0, 1)),
    (True, (True, True), (1,)),
]


@pytest.mark.parametrize("case", GROUPED_CASES)
@pytest.mark.parametrize("counts", COUNTS)
@pytest.mark.parametrize(
    "path,dtype,autocast",
    [
        ("qdq", torch.float32, False),
        ("qdq", torch.bfloat16, False),
        ("qdq", torch.float32, True),
        ("mx", torch.float32, False),
    ],
)
def test_mx_grouped_mm_shared_bit_identical(monkeypatch, case, counts, path, dtype, autocast):
    req_x, req_w, used = case
    cfg = {"qdq": CPU_BF16 if autocast else CPU, "mx": CPU}[path]
    if path == "mx":
        monkeypatch.setattr(gemm_backend, "QDQ_BACKENDS", frozenset())
    a, ws, gs, offs = grouped_operands(counts, dtype)
    want = run(separate_grouped(cfg, offs), a, ws, gs, req_x, req_w, used, autocast)
    got = run(shared_grouped(cfg, offs), a, ws, gs, req_x, req_w, used, autocast)
    compare(got, want)


@pytest.mark.parametrize("path", ["qdq", "mx"])
@pytest.mark.parametrize("req_x", [True, False])
def test_mx_grouped_mm_shared_mx_input_bit_identical(monkeypatch, path, req_x):
    """An MXTensor input (the MXFP8 dispatch's output): gradients summed into its grad anchor."""
    if path == "mx":
        monkeypatch.setattr(gemm_backend, "QDQ_BACKENDS", frozenset())
    a, ws, gs, offs = grouped_operands(COUNTS[0], torch.float32)
    outs = []
    for shared in (False, True):
        am = to_mx(a, recipe=CPU)
        anchor = make_grad_anchor(am.shape, a.dtype, a.device).requires_grad_(req_x)
        am = dataclasses.replace(am, grad_anchor=anchor)
        wl = [w.clone().requires_grad_() for w in ws]
        if shared:
            ys = mx_grouped_mm_shared(am, [w.transpose(-2, -1) for w in wl], offs, CPU)
        else:
            ys = [mx_grouped_mm(am, w.transpose(-2, -1), offs, CPU) for w in wl]
        sum((y * g).sum() for y, g in zip(ys, gs, strict=True)).backward()
        outs.append(([y.detach() for y in ys], am.grad_anchor.grad, [w.grad for w in wl]))
    compare(outs[1], outs[0])


def test_mx_grouped_mm_shared_one_cast_and_one_saved_copy(monkeypatch):
    """w1 and w3 (each weight cast along K and N from one read in the forward, `cast_weight`): the
    forward casts the tokens once instead of twice (4 -> 3 quantizer calls), the backward each dy
    (2) and no weight; the tokens along M (T, K) fp32 and offs are saved once instead of twice."""
    counts = Counts(monkeypatch)
    a, ws, gs, offs = grouped_operands(COUNTS[0], torch.float32)
    res = {}
    for name, fn in (("separate", separate_grouped(CPU, offs)), ("shared", shared_grouped(CPU, offs))):
        counts.qdq = 0
        _, saved = counts.saved_bytes(lambda fn=fn: run(fn, a, ws, gs, True, (True,) * 2, (), False))
        fwd = counts.qdq
        run(fn, a, ws, gs, True, (True,) * 2, (0, 1), False)
        res[name] = (fwd, counts.qdq - 2 * fwd, saved)
    assert res["separate"][:2] == (4, 2) and res["shared"][:2] == (3, 2), res
    assert res["separate"][2] - res["shared"][2] == a.numel() * 4 + offs.numel() * 4, res


def test_mx_grouped_mm_shared_errors():
    a, ws, _, offs = grouped_operands(COUNTS[0], torch.float32)
    with pytest.raises(TypeError, match="non-empty list or tuple"):
        mx_grouped_mm_shared(a, [], offs)
    with pytest.raises(ValueError, match="b_t must be a 3D tensor"):
        mx_grouped_mm_shared(a, [ws[0].transpose(-2, -1), ws[1][0]], offs)
    with pytest.raises(ValueError, match="K=32"):
        mx_grouped_mm_shared(a[:, :32], [w.transpose(-2, -1) for w in ws], offs)


def close(got, want):
    """inductor may fuse and reorder the elementwise work (the gradient sums): equal within fp32
    rounding rather than bit for bit."""
    for g, w in zip([*got[0], got[1], *got[2]], [*want[0], want[1], *want[2]], strict=True):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_shared_ops_compile_fullgraph(backend):
    """Both ops trace into one graph (torch.compile fullgraph) with the eager results (aot_eager:
    bit for bit; inductor on CPU also checks the ops' real output strides against their fake ones)."""
    check = compare if backend == "aot_eager" else close
    x, ws, gs = mm_operands(torch.float32)
    want = run(shared_mm(CPU), x, ws, gs, True, (True,) * 3, (0, 1, 2), False)
    f = torch.compile(shared_mm(CPU), fullgraph=True, backend=backend)
    check(run(f, x, ws, gs, True, (True,) * 3, (0, 1, 2), False), want)
    a, wg, gg, offs = grouped_operands(COUNTS[0], torch.float32)
    want = run(shared_grouped(CPU, offs), a, wg, gg, True, (True,) * 2, (0, 1), False)
    g = torch.compile(shared_grouped(CPU, offs), fullgraph=True, backend=backend)
    check(run(g, a, wg, gg, True, (True,) * 2, (0, 1), False), want)


@pytest.mark.parametrize("compiled", [False, True])
def test_shared_ops_under_no_grad(monkeypatch, compiled):
    """Validation calls the ops under torch.no_grad with weights that require grad: no autograd
    node, the separate ops' outputs bit for bit, and x cast along K alone (no copy along M for a
    wgrad that cannot come); compiled with fullgraph too (dynamo once failed on the Function's ctx
    there: 'Tensor' object has no attribute 'set_materialize_grads')."""
    counts = Counts(monkeypatch)
    x, ws, _ = mm_operands(torch.float32)
    a, wg, _, offs = grouped_operands(COUNTS[0], torch.float32)
    ws = [w.requires_grad_() for w in ws]
    wg = [w.requires_grad_() for w in wg]
    for shared, separate, inp, weights in (
        (shared_mm(CPU), separate_mm(CPU), x, ws),
        (shared_grouped(CPU, offs), separate_grouped(CPU, offs), a, wg),
    ):
        fn = torch.compile(shared, fullgraph=True, backend="aot_eager") if compiled else shared
        with torch.no_grad():
            want = separate(inp, weights)
            counts.qdq = 0
            got = fn(inp, weights)
        assert all(y.grad_fn is None and not y.requires_grad for y in got)
        for g, w in zip(got, want, strict=True):
            bits_equal(g, w, "no_grad output")
        if not compiled:  # x along K once, each weight along K once
            assert counts.qdq == 1 + len(weights), counts.qdq


@pytest.mark.gpu
@pytest.mark.parametrize("gemm_backend", ["emulated"])
def test_gpu_shared_ops_bit_identical(gemm_backend):
    """On the GPU with the default kernels and recipe (bf16 activations, bf16 autocast)."""
    cfg = MXRecipe(gemm_backend=gemm_backend)
    x, ws, gs = mm_operands(torch.bfloat16, lead=(4, 200))
    x, ws, gs = x.cuda(), [w.cuda() for w in ws], [g.cuda() for g in gs]

    def run_cuda(fn, x, ws, gs, req_w, autocast):
        x = x.clone().requires_grad_()
        ws = [w.clone().requires_grad_(r) for w, r in zip(ws, req_w, strict=True)]
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            ys = fn(x, ws)
        sum((y.float() * g).sum() for y, g in zip(ys, gs, strict=True)).backward()
        return [y.detach() for y in ys], x.grad, [w.grad for w in ws]

    for autocast in (False, True):
        for req_w in ((True,) * 3, (True, False, True)):
            want = run_cuda(separate_mm(cfg), x.float() if autocast else x, ws, gs, req_w, autocast)
            got = run_cuda(shared_mm(cfg), x.float() if autocast else x, ws, gs, req_w, autocast)
            compare(got, want)
    a, wg, gg, offs = grouped_operands([0, 100, 37, 300, 1], torch.bfloat16, T=500)
    a, wg, gg, offs = a.cuda(), [w.cuda() for w in wg], [g.cuda() for g in gg], offs.cuda()
    for req_w in ((True, True), (False, True)):
        want = run_cuda(separate_grouped(cfg, offs), a, wg, gg, req_w, False)
        got = run_cuda(shared_grouped(cfg, offs), a, wg, gg, req_w, False)
        compare(got, want)
