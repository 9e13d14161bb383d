"""The emulated GEMM's fused quantize-dequantize path against the MX path (quantize, write, read
back, dequantize): bit-identical forward and backward from the same GEMM calls (operands of the
same values and strides), the same bytes saved for backward; the recipe as the ops' one
parameter."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import assert_same_bits
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import mxmoe.ops.gemm_backend as gemm_backend
from mxmoe import to_mx
from mxmoe.ops import mx_gemm, mx_grouped_mm, mx_mm
from mxmoe.quant.mx_tensor import make_grad_anchor
from mxmoe.recipe import MXRecipe

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")


def rec(mode="rceil", elem=torch.float8_e4m3fn, kernel="torch", gemm_dtype=None) -> MXRecipe:
    return MXRecipe(
        scaling_mode=mode, elem_dtype=elem, dim0_kernel=kernel, dim1_kernel=kernel, gemm_dtype=gemm_dtype
    )


def wide_range(shape, dtype, seed):
    """Random data whose 32-blocks span the whole range, tiny blocks (scale byte < 3, where bf16
    compute rounds the dequantized values) and zero rows included."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    k = torch.randint(-135, 100, shape[:-1] + (shape[-1] // 32,), generator=g).float()
    x = x * torch.exp2(k).repeat_interleave(32, dim=-1)
    x[..., 1, :] = 0
    return x.to(dtype)


def run_mm(x, w, dy, cfg, req):
    xs = x.clone().requires_grad_(req[0])
    ws = w.clone().requires_grad_(req[1])
    y = mx_mm(xs, ws.t(), cfg)
    y.backward(dy)
    return [y, xs.grad, ws.grad]


def run_grouped(a, w, offs, dy, cfg, req, mx_input=False):
    ws = w.clone().requires_grad_(req[1])
    if mx_input:
        am = to_mx(a, recipe=cfg)
        anchor = make_grad_anchor(am.shape, a.dtype, a.device).requires_grad_(req[0])
        am = dataclasses.replace(am, grad_anchor=anchor)
        y = mx_grouped_mm(am, ws.transpose(-2, -1), offs, cfg)
        y.backward(dy)
        return [y, am.grad_anchor.grad, ws.grad]
    as_ = a.clone().requires_grad_(req[0])
    y = mx_grouped_mm(as_, ws.transpose(-2, -1), offs, cfg)
    y.backward(dy)
    return [y, as_.grad, ws.grad]


QDQ_BACKENDS = gemm_backend.QDQ_BACKENDS  # as shipped (both_paths patches the module's)
GEMM_OPS = {"mm", "addmm", "bmm", "_grouped_mm", "grouped_mm"}


class GemmCalls(TorchDispatchMode):
    """Records every GEMM (aten mm / bmm / _grouped_mm, mxmoe::grouped_mm) as (op name, and per
    tensor argument its shape, strides, dtype and a contiguous copy of its values)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in GEMM_OPS:
            ts = [(tuple(t.shape), t.stride(), t.dtype, t.detach().contiguous().clone())
                  for t in (*args, *(kwargs or {}).values()) if isinstance(t, torch.Tensor)]
            self.calls.append((name, ts))
        return func(*args, **(kwargs or {}))


def assert_same_gemms(got, want, what):
    """Both paths made the same GEMM calls: same ops, operand shapes, strides, dtypes and bytes."""
    assert [c[0] for c in got] == [c[0] for c in want], what
    for i, ((name, gs), (_, ws)) in enumerate(zip(got, want, strict=True)):
        layouts = [g[:3] for g in gs], [w[:3] for w in ws]  # shapes, strides, dtypes
        assert layouts[0] == layouts[1], (what, i, name, *layouts)
        for g, w in zip(gs, ws, strict=True):
            assert torch.equal(g[3].view(-1).view(torch.uint8), w[3].view(-1).view(torch.uint8)), (what, i)


def both_paths(monkeypatch, fn):
    """(qdq path result, MX path result, saved bytes of each) of fn(), after checking that the two
    paths made the same GEMM calls (the qdq path's forward, dgrad and wgrad, on the same operand
    values and layouts: a GEMM's result depends on its operands' strides, not only their values)."""
    out, gemms = [], []
    for qdq_backends in (QDQ_BACKENDS, frozenset()):
        monkeypatch.setattr(gemm_backend, "QDQ_BACKENDS", qdq_backends)
        saved: list[int] = []

        def pack(t, saved=saved):
            saved.append(t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), GemmCalls() as log:
            res = fn()
        out.append((res, sum(saved)))
        gemms.append(log.calls)
    assert gemms[0], "no GEMM recorded"
    assert_same_gemms(gemms[0], gemms[1], "GEMM calls, qdq path vs MX path")
    return out


def assert_same(got, want, what):
    """Each pair byte for byte (NaN payloads included), with the same strides; None only for None."""
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert_same_bits(g, w, f"{what} {i}", nan_payload=True)
        assert g is None or g.stride() == w.stride(), (what, i)


REQS = [(True, True), (True, False), (False, True)]


def fp8_dim1_bytes(rows_padded: int, cols: int) -> int:
    """Bytes of an MX cast along the rows of a (rows_padded, cols) tensor: elements and scales."""
    return rows_padded * cols + rows_padded // 32 * cols


def saved_delta_mm(M: int, K: int, compute: torch.dtype, need_dw: bool) -> int:
    """qdq path minus MX path saved bytes of mx_mm: x along M in the compute dtype (M, K) instead
    of its MX cast of the zero-padded (M_pad, K)."""
    if not need_dw:
        return 0
    m_pad = -(-M // 32) * 32
    return M * K * compute.itemsize - fp8_dim1_bytes(m_pad, K)


def saved_delta_grouped(T: int, K: int, E: int, compute: torch.dtype, need_dw: bool, mx_input: bool) -> int:
    """qdq path minus MX path saved bytes of mx_grouped_mm: the qdq path keeps neither the padding
    map (pos (T,) int64, offs_pad (E,) int32) nor the padded MX cast; it keeps the tokens along M in
    the compute dtype (T, K), or for an MX input the same MX input as the MX path."""
    if not need_dw:
        return 0
    cap = -(-(T + 32 * E) // 32) * 32
    delta = -(T * 8 + E * 4)
    if not mx_input:
        delta += T * K * compute.itemsize - fp8_dim1_bytes(cap, K)
    return delta


@pytest.mark.parametrize("mode", ["rceil", "floor"])
@pytest.mark.parametrize("dtype,gemm_dtype", [(torch.float32, None), (torch.bfloat16, torch.bfloat16)])
def test_mx_mm_qdq_path_bit_identical(monkeypatch, mode, dtype, gemm_dtype):
    """mx_mm: y, dx, dW equal bit for bit, layouts included, for every requires-grad combination
    and a row count that is no multiple of 32; the qdq path saves x along M in the compute dtype
    where the MX path saves its MX cast."""
    cfg = rec(mode, gemm_dtype=gemm_dtype)
    x = wide_range((45, 128), dtype, 0)
    w = wide_range((96, 128), dtype, 1) * 0.1
    dy = wide_range((45, 96), dtype, 2)
    for req in REQS:
        (new, nb), (old, ob) = both_paths(monkeypatch, lambda req=req: run_mm(x, w, dy, cfg, req))
        assert_same(new, old, f"mx_mm {req}")
        assert nb - ob == saved_delta_mm(45, 128, cfg.compute_dtype(x.device), req[1]), (req, nb, ob)


@pytest.mark.parametrize("mode,elem", [("rceil", torch.float8_e4m3fn), ("even", torch.float8_e5m2)])
@pytest.mark.parametrize("mx_input", [False, True])
def test_mx_grouped_mm_qdq_path_bit_identical(monkeypatch, mode, elem, mx_input):
    """mx_grouped_mm (plain and MX-activation input), groups of size 0, not multiples of 32, and
    rows past the last group; bf16 operands with bf16 compute. The qdq path casts the tokens and dy
    along M group by group without a padded copy and saves the tokens' cast in bf16."""
    cfg = rec(mode, elem, gemm_dtype=torch.bfloat16)
    counts = [0, 5, 33, 0, 40]
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    T = sum(counts) + 3
    a = wide_range((T, 64), torch.bfloat16, 3)
    w = wide_range((5, 96, 64), torch.bfloat16, 4)
    dy = wide_range((T, 96), torch.bfloat16, 5)
    for req in REQS:
        (new, nb), (old, ob) = both_paths(
            monkeypatch, lambda req=req: run_grouped(a, w, offs, dy, cfg, req, mx_input)
        )
        assert_same(new, old, f"grouped {req}")
        want = saved_delta_grouped(T, 64, 5, torch.bfloat16, req[1], mx_input)
        assert nb - ob == want, (req, nb, ob)


@pytest.mark.interpreter
def test_qdq_path_triton_interpreter_bit_identical(monkeypatch):
    """The Triton qdq kernel (interpreter) in the ops == the MX path with the torch casts: mx_mm
    (M no multiple of 32) and mx_grouped_mm (ragged and empty groups, rows after the last)."""
    x = wide_range((40, 64), torch.bfloat16, 6)
    w = wide_range((32, 64), torch.bfloat16, 7)
    dy = wide_range((40, 32), torch.bfloat16, 8)
    counts = [7, 0, 33, 1]
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    we = wide_range((4, 32, 64), torch.bfloat16, 9)
    a = torch.cat([x, x[:5]])  # 45 rows: 4 after the last group
    dya = torch.cat([dy, dy[:5]])
    cfg_t = rec(kernel="triton", gemm_dtype=torch.bfloat16)
    monkeypatch.setattr(gemm_backend, "QDQ_BACKENDS", frozenset())
    old = run_mm(x, w, dy, rec(gemm_dtype=torch.bfloat16), (True, True))
    old_g = run_grouped(a, we, offs, dya, rec(gemm_dtype=torch.bfloat16), (True, True))
    monkeypatch.undo()
    assert_same(run_mm(x, w, dy, cfg_t, (True, True)), old, "triton qdq")
    assert_same(run_grouped(a, we, offs, dya, cfg_t, (True, True)), old_g, "triton qdq grouped")


def test_grouped_compile_matches_eager():
    """MXGroupedExperts-style weights: a second eager step gives the same weight gradient bit for
    bit, and torch.compile (aot_eager) matches eager."""
    cfg = rec()
    torch.manual_seed(1)
    w = nn.Parameter(torch.randn(3, 64, 32) * 0.1)
    offs = torch.tensor([5, 5, 40], dtype=torch.int32)
    a = torch.randn(40, 32, requires_grad=True)

    def step(a):
        return mx_grouped_mm(a, w.transpose(-2, -1), offs, cfg).square().sum()

    step(a).backward()
    ref = w.grad.clone()
    w.grad = None
    step(a).backward()
    assert torch.equal(w.grad, ref)
    w.grad = None
    torch.compile(step, fullgraph=True, backend="aot_eager")(a).backward()
    torch.testing.assert_close(w.grad, ref, rtol=1e-5, atol=1e-6)


def _profiled_ranges(fn) -> set[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {e.name for e in prof.events()}


def test_profiler_sees_the_casts_and_gemms_of_forward_and_backward():
    """The ops ask once per forward and once per backward whether they run in plain eager mode
    (OpKernels.direct); under the profiler, on for the whole step or only for the backward, the
    casts and grouped GEMMs still run in their named ranges, with the unprofiled results bit for
    bit."""
    cfg = rec(gemm_dtype=torch.bfloat16)
    x, dy = wide_range((40, 64), torch.bfloat16, 3), wide_range((40, 32), torch.bfloat16, 4)
    w, we = wide_range((32, 64), torch.bfloat16, 5), wide_range((3, 32, 64), torch.bfloat16, 6)
    offs = torch.tensor([5, 5, 40], dtype=torch.int32)
    ref = run_mm(x, w, dy, cfg, (True, True))
    ref_g = run_grouped(x, we, offs, dy, cfg, (True, True))
    out = []
    names = _profiled_ranges(lambda: out.extend(run_mm(x, w, dy, cfg, (True, True))))
    assert "mxmoe::qdq" in names
    assert_same(out, ref, "mx_mm profiled")
    out = []
    names = _profiled_ranges(lambda: out.extend(run_grouped(x, we, offs, dy, cfg, (True, True))))
    assert {"mxmoe::qdq", "mxmoe::grouped_mm"} <= names
    assert_same(out, ref_g, "mx_grouped_mm profiled")
    # forward unprofiled (direct), backward profiled: the backward's casts and GEMMs in their ranges
    a, ws = x.clone().requires_grad_(), we.clone().requires_grad_()
    y = mx_grouped_mm(a, ws.transpose(-2, -1), offs, cfg)
    names = _profiled_ranges(lambda: y.backward(dy))
    assert {"mxmoe::qdq", "mxmoe::grouped_mm"} <= names
    assert_same([y, a.grad, ws.grad], ref_g, "mx_grouped_mm, backward profiled")


# ---------------------------------------------------------------------------------------------
# the recipe as the ops' parameter
# ---------------------------------------------------------------------------------------------


def test_ops_take_the_recipe():
    """The ops' parameter is `recipe` (positional or by name); anything but an MXRecipe or None is a
    TypeError naming it."""
    r = MXRecipe(scaling_mode="floor", dim0_kernel="torch", dim1_kernel="torch", gemm_dtype=torch.float32)
    torch.manual_seed(0)
    a, b = torch.randn(4, 32), torch.randn(32, 64)
    assert torch.equal(mx_mm(a, b, recipe=r), mx_mm(a, b, r))
    assert not torch.equal(mx_mm(a, b, r), mx_mm(a, b, MXRecipe(dim0_kernel="torch", dim1_kernel="torch")))
    with pytest.raises(TypeError, match="recipe must be an mxmoe.MXRecipe .* got dict"):
        mx_mm(torch.randn(4, 32), torch.randn(32, 32), {"block_size": 32})
    with pytest.raises(TypeError, match="recipe must be an mxmoe.MXRecipe"):
        mx_gemm(to_mx(torch.randn(4, 32)), to_mx(torch.randn(32, 32), axis=0), None, "mxfp8")


@pytest.mark.parametrize(
    "quant,match",
    [
        (dict(scaling_mode="floor"), "scaling_mode='floor' \\(recipe: 'rceil'\\)"),
        (dict(elem_dtype=torch.float8_e5m2), "elem_dtype=torch.float8_e5m2 \\(recipe: torch.float8_e4m3"),
        (dict(block_size=16), "block_size=16 \\(recipe: 32\\)"),
    ],
)
def test_grouped_mx_input_must_match_recipe(quant, match):
    a = to_mx(torch.randn(8, 64), **quant)
    w = torch.randn(2, 32, 64)
    with pytest.raises(ValueError, match="does not match the op's recipe: it has " + match):
        mx_grouped_mm(a, w.transpose(-2, -1), torch.tensor([4, 8], dtype=torch.int32), rec())


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["auto", "triton", "cuda"])
@pytest.mark.parametrize("mode", ["rceil", "floor"])
def test_gpu_qdq_path_bit_identical(monkeypatch, kernel, mode):
    """On the H200 (bf16 emulated GEMMs: torch.mm and torch._grouped_mm): the Triton qdq path ==
    the MX path with the same recipe's casts (auto / triton / cuda), bit for bit, layouts included
    (saved bytes as expected), for mx_mm and mx_grouped_mm (plain and MX input), all grad subsets."""
    cfg = rec(mode, kernel=kernel)
    dev = "cuda"
    x = wide_range((1000, 512), torch.bfloat16, 0).to(dev)
    w = wide_range((768, 512), torch.bfloat16, 1).to(dev)
    dy = wide_range((1000, 768), torch.bfloat16, 2).to(dev)
    counts = [0, 100, 333, 0, 567]
    offs = torch.tensor(counts).cumsum(0).to(torch.int32).to(dev)
    a = wide_range((1000, 512), torch.bfloat16, 3).to(dev)
    we = wide_range((5, 768, 512), torch.bfloat16, 4).to(dev)
    for req in REQS:
        (new, nb), (old, ob) = both_paths(monkeypatch, lambda req=req: run_mm(x, w, dy, cfg, req))
        assert_same(new, old, f"gpu mx_mm {req}")
        assert nb - ob == saved_delta_mm(1000, 512, torch.bfloat16, req[1])
        for mx_input in (False, True):
            (new, nb), (old, ob) = both_paths(
                monkeypatch, lambda req=req, m=mx_input: run_grouped(a, we, offs, dy, cfg, req, m)
            )
            assert_same(new, old, f"gpu grouped {req} mx_input={mx_input}")
            assert nb - ob == saved_delta_grouped(1000, 512, 5, torch.bfloat16, req[1], mx_input)
            if req[1]:  # empty experts (torch._grouped_mm's K-grouped GEMM over 0 rows): dW = 0
                assert not new[2][[0, 3]].any()


@pytest.mark.gpu
def test_gpu_eager_repeats_and_compile_matches():
    """On the GPU: a repeated eager step gives the same gradients bit for bit; inductor (fullgraph)
    matches eager closely."""
    cfg = rec(kernel="auto")
    torch.manual_seed(0)
    lin = nn.Linear(512, 256, bias=False, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(300, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def step(x):
        return mx_mm(x, lin.weight.t(), cfg).float().square().mean()

    step(x).backward()
    ref = [x.grad.clone(), lin.weight.grad.clone()]
    x.grad = lin.weight.grad = None
    for _ in range(2):
        step(x).backward()
        assert torch.equal(x.grad, ref[0]) and torch.equal(lin.weight.grad, ref[1])
        x.grad = lin.weight.grad = None
    torch.compile(step, fullgraph=True)(x).backward()
    for g, r in zip((x.grad, lin.weight.grad), ref, strict=True):
        assert ((g.float() - r.float()).norm() / r.float().norm()).item() < 1e-2
