"""mx_mm / mx_grouped_mm against an fp64 reference of the same quantized math, against bf16
autograd, the MXTensor input path, and torch.compile(fullgraph=True)."""

import dataclasses
import itertools

import pytest
import torch
import torch.nn.functional as F
from conftest import recipe_for

from mxmoe import to_mx
from mxmoe.formats import format_of
from mxmoe.nn import GroupedExperts, MXGroupedExperts, MXLinear
from mxmoe.ops import mx_gemm, mx_grouped_mm, mx_mm
from mxmoe.quant import custom_ops
from mxmoe.quant.mx_tensor import make_grad_anchor
from mxmoe.recipe import MXRecipe

CFG = MXRecipe(dim0_kernel="torch", dim1_kernel="torch")


def dq(t, axis, cfg=CFG):
    """fp64 of the MX values of t quantized along axis (rows zero-padded to the block size)."""
    if axis == 0 and t.shape[0] % cfg.block_size:
        t = torch.cat([t, t.new_zeros(-t.shape[0] % cfg.block_size, *t.shape[1:])])
    r = cfg.replace(dim0_kernel="torch", dim1_kernel="torch")
    return to_mx(t.detach(), axis=axis, recipe=r).dequantize(torch.float32, recipe=r).double()


def assert_close_sum(got, ref, a_abs, b_abs, k):
    """|got - ref| within fp32 summation error of a k-term dot product (plus output rounding)."""
    bound = (a_abs @ b_abs) * (k + 2) * 2.0**-23 + 1e-30
    if got.dtype == torch.bfloat16:
        bound = bound + ref.abs() * 2.0**-8
    err = (got.double() - ref).abs()
    assert bool((err <= bound).all()), f"max err {err.max().item()}, max excess {(err - bound).max().item()}"


def ref_mm(x, w, dy, cfg=CFG):
    M = x.shape[0]
    xq, wq = dq(x, -1, cfg), dq(w, -1, cfg)
    y = xq @ wq.t()
    dyq0, wq1 = dq(dy, -1, cfg), dq(w, 0, cfg)
    dx = dyq0 @ wq1
    dyq1, xq1 = dq(dy, 0, cfg)[:M], dq(x, 0, cfg)[:M]
    dw = dyq1.t() @ xq1
    return (y, (xq.abs(), wq.abs().t())), (dx, (dyq0.abs(), wq1.abs())), (dw, (dyq1.abs().t(), xq1.abs()))


@pytest.mark.parametrize("mode", ["rceil", "floor"])
@pytest.mark.parametrize("M", [32, 45])
def test_mx_mm_matches_quantized_reference(mode, M):
    cfg = MXRecipe(scaling_mode=mode, dim0_kernel="torch", dim1_kernel="torch")
    torch.manual_seed(M)
    x = torch.randn(M, 64, requires_grad=True)
    w = (torch.randn(96, 64) * 0.1).requires_grad_()
    y = mx_mm(x, w.t(), cfg)
    dy = torch.randn_like(y)
    y.backward(dy)
    (yr, yab), (dxr, dxab), (dwr, dwab) = ref_mm(x, w, dy, cfg)
    assert_close_sum(y, yr, *yab, 64)
    assert_close_sum(x.grad, dxr, *dxab, 96)
    assert_close_sum(w.grad, dwr, *dwab, M)


def test_mx_mm_batched_and_bf16_close_to_bf16_autograd():
    torch.manual_seed(1)
    x = torch.randn(2, 24, 128, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(64, 128, dtype=torch.bfloat16, requires_grad=True)
    y = mx_mm(x, w.t(), CFG)
    assert y.shape == (2, 24, 64) and y.dtype == torch.bfloat16
    dy = torch.randn_like(y)
    y.backward(dy)
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    y2 = x2 @ w2.t()
    y2.backward(dy)
    for got, ref in ((y, y2), (x.grad, x2.grad), (w.grad, w2.grad)):
        rel = (got.float() - ref.float()).norm() / ref.float().norm()
        assert rel < 0.05, rel


def test_mx_mm_only_one_grad():
    torch.manual_seed(2)
    x = torch.randn(32, 64)
    w = torch.randn(32, 64, requires_grad=True)
    dy = torch.randn(32, 32)
    mx_mm(x, w.t(), CFG).backward(dy)
    *_, (dwr, _) = ref_mm(x, w, dy)
    torch.testing.assert_close(w.grad.double(), dwr, rtol=1e-5, atol=1e-5)
    x.requires_grad_()
    w2 = w.detach()
    mx_mm(x, w2.t(), CFG).backward(dy)
    _, (dxr, _), _ = ref_mm(x, w, dy)
    torch.testing.assert_close(x.grad.double(), dxr, rtol=1e-5, atol=1e-5)


def test_mx_mm_errors():
    with pytest.raises(ValueError, match="N=40"):
        mx_mm(torch.randn(4, 64), torch.randn(64, 40), CFG)
    with pytest.raises(ValueError, match="K=48"):
        mx_mm(torch.randn(4, 48), torch.randn(48, 64), CFG)
    with pytest.raises(ValueError, match="gemm_backend"):
        MXRecipe(gemm_backend="cublas")
    with pytest.raises(ValueError, match="dim1_kernel"):
        MXRecipe(dim1_kernel="tirton")
    # the dtypes, checked once per call (the casts below trust them), as the casts take them
    with pytest.raises(TypeError, match=r"a has dtype torch.float16; expected one of \['torch.bfloat16'"):
        mx_mm(torch.randn(4, 64, dtype=torch.float16), torch.randn(64, 32), CFG)
    with pytest.raises(TypeError, match="b has dtype torch.float64"):
        mx_mm(torch.randn(4, 64), torch.randn(64, 32, dtype=torch.float64), CFG)
    # through a module: the error says what `a` is and what to do (it named only the op's argument)
    lin = MXLinear(64, 32, recipe=CFG)
    with pytest.raises(TypeError, match=r"a: the activations, the input x of an MXLinear .* torch.autocast"):
        lin(torch.randn(4, 64, dtype=torch.float16))
    with torch.autocast("cpu", dtype=torch.float16):  # a as autocast casts it: autocast named
        with pytest.raises(TypeError, match=r"torch.autocast\(dtype=torch.float16\) is on for cpu"):
            mx_mm(torch.randn(4, 64), torch.randn(64, 32), CFG)


def test_operands_on_two_devices_or_on_meta():
    """a and the weight on different devices are refused naming both (a weight left on meta gave a
    tensor of garbage, a on meta torch's autocast error); the ops run on meta as nn.Linear does
    (shapes and dtypes, forward and backward), the grouped ones too (they failed reading offs)."""
    a, w = torch.randn(8, 64), torch.randn(32, 64)
    with pytest.raises(ValueError, match="mx_mm: a is on cpu but b on meta; they must share a device"):
        mx_mm(a, w.t().to("meta"), CFG)
    with pytest.raises(ValueError, match="mx_mm: a is on meta but b on cpu"):
        mx_mm(a.to("meta"), w.t(), CFG)
    am, wm = a.to("meta").bfloat16().requires_grad_(), w.to("meta").requires_grad_()
    y = mx_mm(am, wm.t(), CFG)
    assert (y.device.type, y.shape, y.dtype) == ("meta", (8, 32), torch.bfloat16)
    y.sum().backward()
    assert am.grad.shape == am.shape and wm.grad.shape == wm.shape
    b_t, offs = torch.randn(2, 64, 32), torch.tensor([3, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match="a is on meta but b_t on cpu; they must share a device"):
        mx_grouped_mm(a.to("meta"), b_t, offs, CFG)
    am, bm = a.to("meta").requires_grad_(), b_t.to("meta").requires_grad_()
    y = mx_grouped_mm(am, bm, offs.to("meta"), CFG)
    assert (y.device.type, y.shape) == ("meta", (8, 32))
    y.sum().backward()
    assert am.grad.shape == am.shape and bm.grad.shape == bm.shape
    with torch.device("meta"):
        experts = [GroupedExperts(64, 32, 2), MXGroupedExperts(64, 32, 2, CFG)]
    for m in experts:  # (GroupedExperts failed on meta too: torch's autocast error)
        assert m(am, torch.tensor([3, 5], device="meta")).shape == (8, 64)


def grouped_reference(a, w, counts, dy, cfg=CFG):
    """Per-expert fp64 reference: y, da, dw (and the abs operands for error bounds)."""
    ys, das, dws, bounds = [], [], [], []
    s = 0
    for e, c in enumerate(counts):
        ae, dye, we = a[s : s + c], dy[s : s + c], w[e]
        aq, wq, dyq, wq1 = dq(ae, -1, cfg), dq(we, -1, cfg), dq(dye, -1, cfg), dq(we, 0, cfg)
        ys.append(aq @ wq.t())
        das.append(dyq @ wq1)
        if c:
            dy1, a1 = dq(dye, 0, cfg), dq(ae, 0, cfg)
            dws.append(dy1.t() @ a1)
            bounds.append((dy1.abs().t() @ a1.abs()) * (c + 2) * 2.0**-23)
        else:
            dws.append(torch.zeros(w.shape[1:], dtype=torch.float64))
            bounds.append(torch.zeros(w.shape[1:], dtype=torch.float64))
        s += c
    return torch.cat(ys), torch.cat(das), torch.stack(dws), torch.stack(bounds)


@pytest.mark.parametrize("counts", [[0, 5, 31, 33, 64], [32, 0, 0, 1], [0, 0, 0]])
def test_mx_grouped_mm_matches_quantized_reference(counts):
    torch.manual_seed(sum(counts))
    E, N, K = len(counts), 64, 96
    T = sum(counts)
    a = torch.randn(T, K, requires_grad=True)
    w = (torch.randn(E, N, K) * 0.1).requires_grad_()
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    y = mx_grouped_mm(a, w.transpose(-2, -1), offs, CFG)
    assert y.shape == (T, N)
    dy = torch.randn_like(y)
    y.backward(dy)
    yr, dar, dwr, dwb = grouped_reference(a.detach(), w.detach(), counts, dy)
    assert bool(((y.double() - yr).abs() <= 1e-5 * (1 + yr.abs())).all())
    assert bool(((a.grad.double() - dar).abs() <= 1e-5 * (1 + dar.abs())).all())
    assert bool(((w.grad.double() - dwr).abs() <= dwb + 1e-30).all())
    for e, c in enumerate(counts):
        if c == 0:
            assert bool((w.grad[e] == 0).all())


def test_mx_grouped_mm_close_to_bf16():
    torch.manual_seed(3)
    counts = [40, 7, 0, 17]
    a = torch.randn(sum(counts), 64, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(4, 32, 64, dtype=torch.bfloat16, requires_grad=True)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    y = mx_grouped_mm(a, w.transpose(-2, -1), offs, CFG)
    dy = torch.randn_like(y)
    y.backward(dy)
    a2, w2 = a.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    y2 = torch._grouped_mm(a2, w2.transpose(-2, -1), offs=offs)
    y2.backward(dy)
    for got, ref in ((y, y2), (a.grad, a2.grad), (w.grad, w2.grad)):
        rel = (got.float() - ref.float()).norm() / ref.float().norm()
        assert rel < 0.05, rel


@pytest.mark.parametrize("mode", ["rceil", "floor"])
def test_mx_input_path_equals_plain_path(mode):
    cfg = MXRecipe(scaling_mode=mode, dim0_kernel="torch", dim1_kernel="torch")
    torch.manual_seed(4)
    counts = [5, 0, 33, 26]
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    x = torch.randn(sum(counts), 64, dtype=torch.bfloat16)
    a_mx = to_mx(x, axis=-1, recipe=recipe_for("torch", scaling_mode=mode))
    anchor = make_grad_anchor(a_mx.shape, torch.bfloat16, x.device).requires_grad_()
    a_mx = dataclasses.replace(a_mx, grad_anchor=anchor)
    w = torch.randn(4, 32, 64, dtype=torch.bfloat16, requires_grad=True)
    y = mx_grouped_mm(a_mx, w.transpose(-2, -1), offs, cfg)
    dy = torch.randn_like(y)
    y.backward(dy)
    a_plain = a_mx.dequantize(torch.bfloat16, recipe=recipe_for("torch")).detach().requires_grad_()
    w2 = w.detach().clone().requires_grad_()
    y2 = mx_grouped_mm(a_plain, w2.transpose(-2, -1), offs, cfg)
    y2.backward(dy)
    assert torch.equal(y, y2)
    assert torch.equal(a_mx.grad_anchor.grad, a_plain.grad)
    assert torch.equal(w.grad, w2.grad)


def test_grouped_errors():
    w = torch.randn(2, 32, 64)
    with pytest.raises(TypeError, match="int32"):
        mx_grouped_mm(torch.randn(4, 64), w.transpose(-2, -1), torch.tensor([2, 4]), CFG)
    with pytest.raises(ValueError, match="E=2"):
        mx_grouped_mm(torch.randn(4, 64), w.transpose(-2, -1), torch.tensor([4], dtype=torch.int32), CFG)
    with pytest.raises(ValueError, match="N=40"):
        mx_grouped_mm(
            torch.randn(4, 64), torch.randn(2, 64, 40), torch.tensor([2, 4], dtype=torch.int32), CFG
        )
    offs2 = torch.tensor([2, 4], dtype=torch.int32)
    with pytest.raises(TypeError, match="a has dtype torch.float16"):
        mx_grouped_mm(torch.randn(4, 64, dtype=torch.float16), w.transpose(-2, -1), offs2, CFG)
    with pytest.raises(TypeError, match="b_t has dtype torch.float64"):
        mx_grouped_mm(torch.randn(4, 64), w.double().transpose(-2, -1), offs2, CFG)
    with pytest.raises(ValueError, match="offs has 4097 groups; expected 1 to 4096"):
        offs = torch.full((4097,), 4, dtype=torch.int32)
        mx_grouped_mm(torch.randn(4, 64), torch.randn(4097, 64, 32), offs, CFG)
    a = to_mx(torch.randn(4, 64))
    with pytest.raises(ValueError, match="axis"):
        mx_gemm(a, to_mx(torch.randn(64, 32), axis=-1))


def test_mx_gemm_checks_offs_and_devices():
    """mx_gemm's offs (none of it was checked: decreasing ends, ends past the rows or not whole
    blocks over K gave wrong products silently, another length or int64 a deep error or garbage)
    and the operands' devices (b on meta gave NaNs) are refused naming them."""
    a, b3 = to_mx(torch.randn(8, 64)), to_mx(torch.randn(3, 64, 32), axis=1)
    o = lambda ends, dtype=torch.int32: torch.tensor(ends, dtype=dtype)  # noqa: E731
    with pytest.raises(TypeError, match=r"offs must be a 1D torch.int32 .* got torch.int64 \(3,\) on cpu"):
        mx_gemm(a, b3, o([2, 5, 8], torch.int64), CFG)
    with pytest.raises(ValueError, match=r"offs has 2 groups but b \(3, 64, 32\) has E=3"):
        mx_gemm(a, b3, o([2, 8]), CFG)
    with pytest.raises(ValueError, match=r"offs\[1\]=2 < offs\[0\]=5: expected non-decreasing"):
        mx_gemm(a, b3, o([5, 2, 8]), CFG)
    with pytest.raises(ValueError, match=r"offs\[-1\]=80 is past the 8 rows of a"):
        mx_gemm(a, b3, o([2, 5, 80]), CFG)
    b2 = to_mx(torch.randn(64, 16), axis=0)  # 2D b: groups over K (the wgrad)
    with pytest.raises(ValueError, match=r"offs=\[20, 64\]: with a 2D b the groups run over K, every end"):
        mx_gemm(a, b2, o([20, 64]), CFG)
    with pytest.raises(ValueError, match=r"offs\[-1\]=96 is past the 64 rows of b"):
        mx_gemm(a, b2, o([32, 96]), CFG)
    assert mx_gemm(a, b2, o([32, 64]), CFG).shape == (2, 8, 16)
    with pytest.raises(ValueError, match="mx_gemm: a is on cpu but b on meta; they must share a device"):
        mx_gemm(a, to_mx(torch.randn(64, 16, device="meta"), axis=0), recipe=CFG)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_fullgraph_same_results(backend):
    """Compiled (fullgraph) mx_mm -> mx_grouped_mm: the same loss and gradients as eager. inductor on
    CPU asserts the custom ops' real output strides against their fake ones (caught the torch
    backend's transposed dim1 output for a single block of rows)."""
    torch.manual_seed(5)
    counts = [5, 0, 27]
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)

    def step(x, w_lin, w_exp):
        h = mx_mm(x, w_lin.t(), CFG)
        y = mx_grouped_mm(h, w_exp.transpose(-2, -1), offs, CFG)
        return (y.float() ** 2).mean()

    x = torch.randn(32, 64)
    w_lin = torch.randn(32, 64) * 0.2
    w_exp = torch.randn(3, 64, 32) * 0.2
    grads = []
    for fn in (step, torch.compile(step, fullgraph=True, backend=backend)):
        ps = [x.clone().requires_grad_(), w_lin.clone().requires_grad_(), w_exp.clone().requires_grad_()]
        loss = fn(*ps)
        loss.backward()
        grads.append([loss.detach()] + [p.grad for p in ps])
    for g0, g1 in zip(*grads, strict=True):
        torch.testing.assert_close(g0, g1, rtol=1e-6, atol=1e-7)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["torch", "triton", "cuda"])
def test_gpu_compile_inductor_grads_match_eager(kernel):
    """mx_mm -> mx_grouped_mm on the GPU (bf16 emulated GEMMs), inductor vs eager: same loss and
    gradients up to the rounding of dy by a differently fused (y**2).mean() backward, which can move
    single fp8 elements of dy by one step; never zero or garbage gradients."""
    cfg = MXRecipe(dim0_kernel=kernel, dim1_kernel=kernel)
    torch.manual_seed(5)
    offs = torch.tensor([5, 0, 27, 64]).cumsum(0).to(torch.int32).cuda()

    def step(x, w_lin, w_exp):
        h = mx_mm(x, w_lin.t(), cfg)
        y = mx_grouped_mm(h, w_exp.transpose(-2, -1), offs, cfg)
        return (y.float() ** 2).mean()

    x = torch.randn(96, 64, device="cuda", dtype=torch.bfloat16)
    w_lin = (torch.randn(64, 64, device="cuda") * 0.2).bfloat16()
    w_exp = (torch.randn(4, 64, 64, device="cuda") * 0.2).bfloat16()
    grads = []
    for fn in (step, torch.compile(step, fullgraph=True)):
        ps = [t.clone().requires_grad_() for t in (x, w_lin, w_exp)]
        loss = fn(*ps)
        loss.backward()
        grads.append([loss.detach()] + [p.grad.float() for p in ps])
    for name, g0, g1 in zip(("loss", "x", "w_lin", "w_exp"), *grads, strict=True):
        rel = ((g1 - g0).norm() / g0.norm()).item()
        assert rel < 1e-2, f"{name}: relative difference {rel}"


@pytest.mark.parametrize(
    "requires", [r for r in itertools.product([True, False], repeat=3) if any(r)], ids=str
)
def test_compile_grads_for_every_requires_grad_combination(requires):
    """silu -> mx_mm -> mx_grouped_mm -> mx_mm compiled (fullgraph, aot_eager) gives eager's gradients
    for every subset of inputs that require grad (frozen weights, frozen activations). On torch
    2.11 a no-op `.to()` on the ops' outputs made every gradient zero under compile."""
    offs = torch.tensor([5, 0, 27]).cumsum(0).to(torch.int32)

    def step(x, w_lin, w_exp):
        h = mx_mm(F.silu(x), w_lin.t(), CFG)
        y = mx_grouped_mm(h, w_exp.transpose(-2, -1), offs, CFG)
        return (mx_mm(y, w_lin.t(), CFG).float() ** 2).mean()

    torch.manual_seed(0)
    inputs = (torch.randn(32, 64), torch.randn(32, 64) * 0.2, torch.randn(3, 64, 32) * 0.2)
    grads = []
    for fn in (step, torch.compile(step, fullgraph=True, backend="aot_eager")):
        ps = [t.clone().requires_grad_(r) for t, r in zip(inputs, requires, strict=True)]
        fn(*ps).backward()
        grads.append([p.grad for p in ps])
    for r, g0, g1 in zip(requires, *grads, strict=True):
        if not r:
            assert g0 is None and g1 is None
        else:
            assert g1.abs().max() > 0
            torch.testing.assert_close(g1, g0, rtol=1e-5, atol=1e-6)



def _fake_vs_real(op, *args):
    """(shape, stride, dtype, storage offset) of op's outputs run for real and on fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    def meta(outs):
        outs = outs if isinstance(outs, tuple) else (outs,)
        return [(tuple(t.shape), t.stride(), t.dtype, t.storage_offset()) for t in outs]

    real = meta(op(*args))
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = meta(op(*[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]))
    return real, fake


def check_custom_op_layouts(device, kernel):
    """Every mxmoe custom op's real outputs have exactly the layout its fake promises (torch.compile
    builds on the fake: inductor asserts strides, AOTAutograd replays views with them)."""
    from mxmoe.ops.gemm import grouped_mm

    for rows, cols in ((32, 64), (64, 96), (96, 32)):  # one block of rows is the transposed case
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(rows, cols, dtype=dtype, device=device)
            for elem in (torch.float8_e4m3fn, torch.float8_e5m2):
                args = (format_of(elem, 32, "rceil").name, kernel)
                for op, inp in (
                    (custom_ops.quantize_dim0, x),
                    (custom_ops.quantize_dim1, x.view(1, rows, cols)),
                    (custom_ops.quantize_dim0_dim1, x),
                ):
                    real, fake = _fake_vs_real(op, inp, *args)
                    assert real == fake, (op, rows, cols, dtype, elem)
                q, sc = custom_ops.quantize_dim0(x, *args)
                for out_dtype in (torch.float32, torch.bfloat16):
                    real, fake = _fake_vs_real(custom_ops.dequantize, q, sc, 32, out_dtype, kernel)
                    assert real == fake, ("dequantize", rows, cols, dtype, elem, out_dtype)
    offs = torch.tensor([5, 5, 40], dtype=torch.int32, device=device)
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.randn(48, 64, dtype=dtype, device=device)
        b = torch.randn(3, 64, 32, dtype=dtype, device=device)
        real, fake = _fake_vs_real(grouped_mm, a, b, offs)
        assert real == fake, ("grouped_mm 3D", dtype)
        # 2D x 2D: group boundaries along T multiples of 8 (torch._grouped_mm on CUDA needs 16-byte
        # aligned groups; mx_grouped_mm's wgrad always passes multiples of 32)
        offs2 = torch.tensor([8, 8, 40], dtype=torch.int32, device=device)
        real, fake = _fake_vs_real(grouped_mm, a.t().contiguous(), a, offs2)
        assert real == fake, ("grouped_mm 2D", dtype)


def test_custom_op_layouts_cpu():
    check_custom_op_layouts("cpu", "torch")


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["torch", "triton", "cuda"])
def test_custom_op_layouts_gpu(kernel):
    check_custom_op_layouts("cuda", kernel)


def _run(fn, x, w, autocast):
    x = x.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_()
    if autocast:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = fn(x, w)
    else:
        y = fn(x.to(torch.bfloat16), w)
    (y.float() * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
    return y, x.grad, w.grad


@pytest.mark.parametrize("op", ["mm", "grouped"])
def test_autocast_casts_the_activations_as_torch_mm_does(op):
    # under autocast an MX op takes the activation in the autocast dtype (as torch.mm) and keeps its
    # own GEMM dtype inside (no recasting of its fp32 CPU GEMMs): bit for bit the op on x.to(bf16)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(70, 64, generator=g)
    if op == "mm":
        w = torch.randn(96, 64, generator=g)

        def fn(a, b):
            return mx_mm(a, b.t(), CFG)
    else:
        w = torch.randn(3, 64, 96, generator=g)  # b_t (E, K, N)
        offs = torch.tensor([20, 20, 66], dtype=torch.int32)

        def fn(a, b):
            return mx_grouped_mm(a, b, offs, CFG)

    y, dx, dw = _run(fn, x, w, autocast=True)
    y_ref, dx_ref, dw_ref = _run(fn, x, w, autocast=False)
    assert y.dtype == torch.bfloat16 and dx.dtype == torch.float32 and dw.dtype == torch.float32
    for got, ref in ((y, y_ref), (dx, dx_ref), (dw, dw_ref)):
        assert torch.equal(got, ref)


def test_mx_linear_under_autocast_returns_the_autocast_dtype_like_nn_linear():
    from mxmoe.nn import MXLinear

    lin = torch.nn.Linear(64, 32)
    mx = MXLinear.from_linear(lin, CFG)
    x = torch.randn(8, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert lin(x).dtype == mx(x).dtype == torch.bfloat16
    assert mx(x).dtype == torch.float32


def test_float16_autocast_is_named():
    """Under torch.autocast(dtype=float16) the MX modules and ops said "a has dtype torch.float16"
    of fp32 tensors; the error names autocast and its dtype."""
    from mxmoe.nn import MXLinear

    why = r"^torch.autocast\(dtype=torch.float16\) is on for cpu: MX ops take bfloat16 or float32 operands"
    x = torch.randn(8, 64)
    calls = (
        lambda: MXLinear(64, 32, recipe=CFG)(x),
        lambda: mx_mm(x, torch.randn(64, 32), CFG),
        lambda: mx_grouped_mm(x, torch.randn(2, 64, 32), torch.tensor([4, 8], dtype=torch.int32), CFG),
        lambda: MXGroupedExperts(64, 32, 2, CFG)(x, torch.tensor([4, 4])),
    )
    for call in calls:
        with torch.autocast("cpu", dtype=torch.float16), pytest.raises(TypeError, match=why):
            call()


def test_autocast_inside_compile_fullgraph_same_results():
    x = torch.randn(64, 64, requires_grad=True)
    w = torch.randn(96, 64, requires_grad=True)

    def f(x, w):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = mx_mm(x, w.t(), CFG)
        return (y.float() * torch.linspace(-1, 1, y.numel()).view_as(y)).sum()

    ref = f(x, w)
    ref.backward()
    grads = (x.grad.clone(), w.grad.clone())
    x.grad = w.grad = None
    out = torch.compile(f, fullgraph=True, backend="aot_eager")(x, w)
    out.backward()
    assert torch.equal(out, ref) and torch.equal(x.grad, grads[0]) and torch.equal(w.grad, grads[1])


def test_renamed_names_say_where_they_went():
    """The GEMM module's old names (issue 47: one name per idea; the backend resolution in its own
    module) are refused with the new one named."""
    import mxmoe.ops.gemm as gemm_mod

    for old, new in (("grouped_mm_hp", "mxmoe.ops.gemm.grouped_mm"), ("hp_gemm", "mxmoe.ops.gemm.gemm"),
                     ("op_plan", "mxmoe.ops.gemm_backend.op_kernels"),
                     ("QDQ_BACKENDS", "mxmoe.ops.gemm_backend.QDQ_BACKENDS")):
        with pytest.raises(AttributeError, match=f"mxmoe.ops.gemm.{old} is now {new}"):
            getattr(gemm_mod, old)


def _double_backward_cases():
    """(op name, a function of (x, w) through one MX op): x (64, 64), w (64, 64)."""
    from mxmoe.nn.mx_experts import run_on_mx_rounded_rows
    from mxmoe.ops import mx_grouped_mm_shared, mx_grouped_mm_swiglu, mx_grouped_swiglu_mlp, mx_mm_shared

    offs = torch.tensor([16, 64], dtype=torch.int32)
    e = lambda w: w.view(1, 64, 64).expand(2, 64, 64)  # two experts' (K, N) weights
    hp = CFG.replace(wgrad_with_hp=True)  # the weight gradient's GEMM unquantized: still refused
    return [
        ("mx_mm", lambda x, w: mx_mm(x, w, CFG)),
        ("mx_mm", lambda x, w: mx_mm(x, w, hp)),
        ("mx_mm_shared", lambda x, w: mx_mm_shared(x, [w, w], CFG)[1]),
        ("mx_grouped_mm", lambda x, w: mx_grouped_mm(x, e(w), offs, CFG)),
        ("mx_grouped_mm_shared", lambda x, w: mx_grouped_mm_shared(x, [e(w)], offs, CFG)[0]),
        ("mx_grouped_mm_swiglu", lambda x, w: mx_grouped_mm_swiglu(x, x * 2, e(w), offs, CFG)),
        ("mx_grouped_swiglu_mlp", lambda x, w: mx_grouped_swiglu_mlp(x, e(w), e(w), e(w), offs, CFG)),
        ("run_on_mx_rounded_rows", lambda x, w: run_on_mx_rounded_rows(x, CFG, lambda r: r @ w)),
    ]


@pytest.mark.parametrize("case", range(8))
def test_double_backward_is_refused_naming_the_op(case):
    """create_graph=True through an MX op: its gradients have no derivative (MX casts). The first
    backward says so, naming the op (the second differentiation failed inside a cast's or grouped
    GEMM's backward, or took a second derivative through the unquantized parts only)."""
    name, f = _double_backward_cases()[case]
    torch.manual_seed(case)
    x = torch.randn(64, 64, requires_grad=True)
    w = torch.randn(64, 64, requires_grad=True)
    y = f(x, w)
    with pytest.raises(RuntimeError, match=rf"{name}.* has no double backward \(create_graph=True\)"):
        torch.autograd.grad(y.pow(2).sum(), (x, w), create_graph=True)
    # one differentiation is unchanged
    gx, gw = torch.autograd.grad(f(x, w).pow(2).sum(), (x, w))
    assert gx.shape == x.shape and gw.shape == w.shape and not gx.requires_grad


def test_double_backward_of_a_gradient_without_history_is_refused():
    """With dy of no history (loss = y.sum()) the gradient of x came back not requiring grad, though
    it depends on w: d(||dx||^2 + ||w||^2)/dw was 2w alone, silently."""
    x = torch.randn(64, 64, requires_grad=True)
    w = torch.randn(64, 32, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"^mxmoe.ops.mx_mm has no double backward"):
        torch.autograd.grad(mx_mm(x, w, CFG).sum(), x, create_graph=True)


def test_torch_func_transforms_are_refused_naming_the_op():
    """torch.func.grad (once, or of itself) of an MX op: torch's "must override the setup_context
    staticmethod" named neither the op nor what to do."""
    w = torch.randn(64, 32)
    f = lambda x: mx_mm(x, w, CFG).sum()
    for g in (torch.func.grad(f), torch.func.grad(lambda x: torch.func.grad(f)(x).sum())):
        with pytest.raises(RuntimeError, match=r"^mxmoe.ops.mx_mm does not run under torch.func transforms"):
            g(torch.randn(64, 64))
    offs = torch.tensor([64], dtype=torch.int32)
    with pytest.raises(RuntimeError, match=r"^mxmoe.ops.mx_grouped_mm does not run under torch.func"):
        torch.func.grad(lambda x: mx_grouped_mm(x, w.view(1, 64, 32), offs, CFG).sum())(torch.randn(64, 64))
