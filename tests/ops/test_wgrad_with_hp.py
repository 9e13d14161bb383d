"""The recipe "mxfp8_rceil_wgrad_with_hp" (`MXRecipe.wgrad_with_hp`, torchao's): the weight-gradient
GEMMs in high precision, every other GEMM on MX operands. Checked against a reference written from
that definition, for every MX op (mx_mm, mx_mm_shared, mx_grouped_mm with a Tensor and with an MX
activation, mx_grouped_mm_shared, mx_grouped_mm_swiglu, mx_grouped_swiglu_mlp):

  - the output and every input gradient are mxfp8_rceil's, bit for bit;
  - each weight gradient is the high-precision GEMM dYᵀ X of the op's own unquantized operands
    (`wgrad_reference`), bit for bit: X as the op took it (after autocast; an MX activation's values), and
    per expert over its own tokens;
  - nothing is cast along the tokens (no dim1 cast of X or dY; only the weights along N).

On CPU: the emulated GEMM on its qdq path and on its MX path, the native GEMM (stand-ins for
torch's MX GEMMs that compute their documented semantics), the torch casts and the Triton casts
(interpreter). GPU (marked gpu): the same on CUDA with the cuda and the triton casts.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_same_bits

import mxmoe.ops.gemm_backend as gemm_backend
import mxmoe.ops.grouped as grouped_mod
import mxmoe.ops.linear as linear_mod
from mxmoe import MXOptions, registry, to_mx
from mxmoe.ops import (
    mx_grouped_mm,
    mx_grouped_mm_shared,
    mx_grouped_mm_swiglu,
    mx_grouped_swiglu_mlp,
    mx_mm,
    mx_mm_shared,
)
from mxmoe.quant.mx_tensor import make_grad_anchor
from mxmoe.recipe import RECIPES, recipe
from tests.ops.native import MXGemmSemantics

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")

NAME = "mxfp8_rceil_wgrad_with_hp"
COUNTS = [5, 0, 33, 1, 31, 0]  # ragged and empty groups; 10 tokens after the last group (T = 80)
K, N = 64, 96


def hp_recipe(kernel: str = "torch", **changes):
    return recipe(NAME, dim0_kernel=kernel, dim1_kernel=kernel, **changes)


def wgrad_reference(dy: torch.Tensor, x: torch.Tensor, offs: torch.Tensor | None = None) -> torch.Tensor:
    """The definition: dYᵀ X in the operands' own dtype. Dense (N, K): torch.mm. Grouped (E, N, K):
    each expert over its own tokens, torch._grouped_mm where the ops run it (CUDA, bf16), else
    torch.mm per group (empty groups zero, tokens after the last group in none)."""
    if offs is None:
        return torch.mm(dy.t(), x)
    if dy.is_cuda and dy.dtype == torch.bfloat16:
        return torch._grouped_mm(dy.t(), x, offs=offs)
    out = dy.new_zeros(offs.shape[0], dy.shape[1], x.shape[1])
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            out[e] = torch.mm(dy[start:end].t(), x[start:end])
        start = end
    return out


def operands(dtype: torch.dtype, device: str, seed: int = 0):
    """x (80, K) of dtype over several binades, dense weights (N, K) and (32, K), expert weights
    w1, w3 (E, N, K) and w2 (E, K, N) fp32, offs (E,)."""
    g = torch.Generator().manual_seed(seed)
    T, E = 80, len(COUNTS)
    x = (torch.randn(T, K, generator=g) * torch.exp2(torch.randint(-4, 4, (T, 1), generator=g))).to(dtype)
    ws = [torch.randn(N, K, generator=g) * 0.2, torch.randn(32, K, generator=g) * 0.2]
    w1, w3 = (torch.randn(E, N, K, generator=g) * 0.2 for _ in range(2))
    w2 = torch.randn(E, K, N, generator=g) * 0.1
    offs = torch.tensor(COUNTS, dtype=torch.int32).cumsum(0).to(torch.int32)
    return [t.to(device) for t in (x, *ws, w1, w3, w2, offs)]


def _leaves(*ts):
    return [t.detach().clone().requires_grad_() for t in ts]


def _dys(ys, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(y.shape, generator=g).to(y.device, y.dtype) for y in ys]


def linear_checks(r, x, w, v, autocast: bool = False):
    """(what, got, want) of mx_mm and mx_mm_shared (weights w, v) under recipe r: outputs and dx
    against mxfp8_rceil's, each dW against wgrad_reference of dy and x (the autocast dtype's x)."""
    out = []
    for shared in (False, True):
        runs = []
        for rr in (r.replace(wgrad_with_hp=False), r):
            xs, ws_ = _leaves(x), _leaves(w, v)
            with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast):
                if shared:
                    ys = mx_mm_shared(xs[0], [t.t() for t in ws_], rr)
                else:
                    ys = (mx_mm(xs[0], ws_[0].t(), rr),)
            dys = _dys(ys)
            torch.autograd.backward(ys, dys)
            runs.append((ys, xs[0].grad, [t.grad for t in ws_[: len(ys)]], dys))
        (ys0, dx0, _, _), (ys1, dx1, dws, dys) = runs
        x_op = x.to(ys1[0].dtype)  # x as the op took it (autocast's dtype)
        what = "mx_mm_shared" if shared else "mx_mm"
        out += [(f"{what} y{i}", a, b) for i, (a, b) in enumerate(zip(ys1, ys0, strict=True))]
        out.append((f"{what} dx", dx1, dx0))
        for i, (dw, dy, wt) in enumerate(zip(dws, dys, (w, v), strict=False)):
            out.append((f"{what} dW{i}", dw, wgrad_reference(dy, x_op).to(wt.dtype)))
    return out


def grouped_checks(r, x, w1, w3, w2, offs):
    """(what, got, want) of the grouped ops under recipe r (module docstring)."""
    base, out = r.replace(wgrad_with_hp=False), []

    def run(fn, leaves, rr):
        leaves = _leaves(*leaves)
        ys = fn(rr, *leaves)
        ys = ys if isinstance(ys, tuple) else (ys,)
        dys = _dys(ys)
        torch.autograd.backward(ys, dys)
        return ys, [t.grad for t in leaves], dys

    def same_fwd_dgrad(what, fn, leaves, n_in):
        """fn under both recipes: outputs and the gradients of the first n_in leaves (the inputs)
        compared; returns this recipe's weight gradients and the dys."""
        (ys0, g0, _), (ys1, g1, dys) = run(fn, leaves, base), run(fn, leaves, r)
        out.extend((f"{what} y{i}", a, b) for i, (a, b) in enumerate(zip(ys1, ys0, strict=True)))
        out.extend((f"{what} d{i}", a, b) for i, (a, b) in enumerate(zip(g1[:n_in], g0[:n_in], strict=True)))
        return g1[n_in:], dys

    def t(w):
        return w.transpose(-2, -1)

    def grouped(rr, a, w):
        return mx_grouped_mm(a, t(w), offs, rr)

    def from_mx(rr, anchor, w):  # an MX activation: its values (exactly dequantized) are the wgrad's x
        xm = to_mx(x, recipe=rr)
        xm = dataclasses.replace(xm, grad_anchor=anchor)
        return mx_grouped_mm(xm, t(w), offs, rr)

    def shared(rr, a, p, q):
        return mx_grouped_mm_shared(a, (t(p), t(q)), offs, rr)

    def swiglu(rr, g_, u_, w):
        return mx_grouped_mm_swiglu(g_, u_, t(w), offs, rr)

    def mlp(rr, a, p, q, w):
        return mx_grouped_swiglu_mlp(a, t(p), t(q), t(w), offs, rr)

    (dw,), (dy,) = same_fwd_dgrad("mx_grouped_mm", grouped, (x, w1), 1)
    out.append(("mx_grouped_mm dW", dw, wgrad_reference(dy, x, offs).to(w1.dtype)))
    anchor = make_grad_anchor(x.shape, x.dtype, x.device)
    (dw,), (dy,) = same_fwd_dgrad("MX activation", from_mx, (anchor, w1), 1)
    x_mx = to_mx(x, recipe=r).dequantize()
    out.append(("MX activation dW", dw, wgrad_reference(dy, x_mx, offs).to(w1.dtype)))
    dws, dys = same_fwd_dgrad("mx_grouped_mm_shared", shared, (x, w1, w3), 1)
    for i, (d, e) in enumerate(zip(dws, dys, strict=True)):
        out.append((f"mx_grouped_mm_shared dW{i}", d, wgrad_reference(e, x, offs).to(w1.dtype)))
    # the SwiGLU w2 GEMM: dW2 = dyᵀ h, h = F.silu(g) * u (eager's values)
    with torch.no_grad():
        g, u = shared(base, x, w1, w3)
    h = F.silu(g) * u
    (dw2,), (dy,) = same_fwd_dgrad("mx_grouped_mm_swiglu", swiglu, (g, u, w2), 2)
    out.append(("mx_grouped_mm_swiglu dW2", dw2, wgrad_reference(dy, h, offs).to(w1.dtype)))
    # the whole SwiGLU MLP: dW1 = dgᵀ x, dW3 = duᵀ x, dg and du what mxfp8_rceil's w2 dgrad and
    # autograd's SwiGLU formulas give (the op's own dgrad is checked against mxfp8_rceil's above)
    (dw1, dw3, dw2), (dy,) = same_fwd_dgrad("mx_grouped_swiglu_mlp", mlp, (x, w1, w3, w2), 1)
    g_, u_ = _leaves(g, u)
    swiglu(base, g_, u_, w2).backward(dy)
    out += [
        ("mx_grouped_swiglu_mlp dW1", dw1, wgrad_reference(g_.grad, x, offs).to(w1.dtype)),
        ("mx_grouped_swiglu_mlp dW3", dw3, wgrad_reference(u_.grad, x, offs).to(w1.dtype)),
        ("mx_grouped_swiglu_mlp dW2", dw2, wgrad_reference(dy, h, offs).to(w1.dtype)),
    ]
    return out


def check(results):
    for what, got, want in results:
        assert_same_bits(got, want, what)


def test_recipe_is_torchao_s_and_every_front_end_knows_it():
    """Every recipe name the options accept is a recipe (torchao's four); this one is RCEIL with the
    weight gradients in high precision, through `recipe`, MXOptions and the options' strings."""
    import typing

    from mxmoe.options import RecipeName
    from mxmoe.recipe import recipe_from_options

    assert set(RECIPES) == set(typing.get_args(RecipeName))
    r = RECIPES[NAME]
    assert r.wgrad_with_hp and r == RECIPES["mxfp8_rceil"].replace(wgrad_with_hp=True)
    assert not any(v.wgrad_with_hp for k, v in RECIPES.items() if k != NAME)
    assert MXOptions(recipe_name=NAME).to_recipe() == recipe_from_options(NAME) == r
    assert recipe_from_options(NAME, "cuda", "triton").wgrad_with_hp
    with pytest.raises(TypeError, match="wgrad_with_hp='yes': expected a bool"):
        r.replace(wgrad_with_hp="yes")


@pytest.mark.parametrize("path", ["qdq", "mx"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_the_definition(monkeypatch, path, dtype):
    """The emulated GEMM (CPU's "auto") on its qdq path and on its MX path, the torch casts."""
    if path == "mx":
        monkeypatch.setattr(gemm_backend, "QDQ_BACKENDS", frozenset())
    x, w, v, w1, w3, w2, offs = operands(dtype, "cpu")
    check(linear_checks(hp_recipe(), x, w, v))
    check(grouped_checks(hp_recipe(), x, w1, w3, w2, offs))


def test_autocast_wgrad_takes_the_autocast_dtype_x():
    """Under autocast (bf16 on CPU) x enters the op in bf16: the wgrad is that bf16 GEMM."""
    x, w, v, *_ = operands(torch.float32, "cpu")
    check(linear_checks(hp_recipe(), x, w, v, autocast=True))


@pytest.mark.interpreter
def test_triton_casts():
    """The Triton casts (interpreter) on the qdq path: the grouped ops."""
    x, _, _, w1, w3, w2, offs = operands(torch.bfloat16, "cpu")
    check(grouped_checks(hp_recipe("triton"), x[:48], w1[:2], w3[:2], w2[:2], offs[:2]))


def test_native_gemm(monkeypatch):
    """The native GEMM (torch's block-scaled GEMMs, here stand-ins with their semantics): the forward
    and the dgrad are mxfp8_rceil's calls, no MX wgrad GEMM is made, dW is the bf16 training GEMM."""
    sem = MXGemmSemantics()
    monkeypatch.setattr(torch, "_scaled_mm", sem.mm)
    monkeypatch.setattr(torch, "_scaled_grouped_mm", sem.grouped)
    monkeypatch.setattr(gemm_backend, "native_unavailable", lambda device: None)
    monkeypatch.setattr(registry, "RESOLVED", {})  # the GEMM backend's answers, kept, rest on it
    x, w, v, w1, *_, offs = operands(torch.bfloat16, "cpu")
    r = hp_recipe(gemm_backend="native")
    check(linear_checks(r, x, w, v))
    # per weight mxfp8_rceil makes a forward, a dgrad and a wgrad MX GEMM, wgrad_with_hp the first two:
    # mx_mm 3 + 2, mx_mm_shared (two weights) 6 + 4
    assert sem.calls["mm"] == 3 + 2 + 6 + 4
    runs = []
    for rr in (r.replace(wgrad_with_hp=False), r):
        a, we = _leaves(x, w1)
        y = mx_grouped_mm(a, we.transpose(-2, -1), offs, rr)
        (dy,) = _dys([y])
        y.backward(dy)
        runs.append((y, a.grad, we.grad))
    check([("y", runs[1][0], runs[0][0]), ("da", runs[1][1], runs[0][1])])
    check([("dW", runs[1][2], wgrad_reference(dy, x, offs).to(torch.float32))])
    assert sem.calls["grouped"] == 3 + 2


CAST_FUNCTIONS = ("qdq_trusted", "to_mx", "to_mx_dim0_dim1", "swiglu_qdq_trusted", "swiglu_bwd_qdq_trusted")


class CastSpy:
    """Records the casts the ops make: (what, input is a weight, dim0, dim1) per qdq call, and
    (what, input is a weight, axis) per MX cast."""

    def __init__(self, monkeypatch, weights):
        self.calls = []
        self.weights = {t.untyped_storage().data_ptr() for t in weights}
        for mod in (linear_mod, grouped_mod):
            for name in CAST_FUNCTIONS:
                if hasattr(mod, name):
                    monkeypatch.setattr(mod, name, self._wrap(name, getattr(mod, name)))

    def _wrap(self, name, fn):
        def spy(x, *args, **kwargs):
            is_w = x.untyped_storage().data_ptr() in self.weights
            if name == "qdq_trusted":
                self.calls.append((name, is_w, args[3], args[4]))
            elif name == "to_mx":
                self.calls.append((name, is_w, args[0] if args else kwargs.get("axis", -1)))
            else:
                self.calls.append((name, is_w))
            return fn(x, *args, **kwargs)

        return spy


@pytest.mark.parametrize("path", ["qdq", "mx"])
def test_nothing_cast_along_the_tokens(monkeypatch, path):
    """With wgrad_with_hp the ops cast x, dy, h, dg and du along K / N only (for the forward and the
    dgrads): no cast along the tokens (dim1), no fused dim0+dim1 or SwiGLU cast (they write both);
    the weights are cast along K and along N as before. mxfp8_rceil makes the token casts."""
    if path == "mx":
        monkeypatch.setattr(gemm_backend, "QDQ_BACKENDS", frozenset())
    x, w, v, w1, w3, w2, offs = operands(torch.float32, "cpu")
    params = [p.requires_grad_() for p in (w, v, w1, w3, w2)]
    spy = CastSpy(monkeypatch, params)
    for r in (hp_recipe(), hp_recipe(wgrad_with_hp=False)):
        spy.calls.clear()
        xs = x.clone().requires_grad_()
        ys = [*mx_mm_shared(xs, [w.t(), v.t()], r), mx_mm(xs, w.t(), r)]
        ws = (w1.transpose(-2, -1), w3.transpose(-2, -1), w2.transpose(-2, -1))
        ys.append(mx_grouped_swiglu_mlp(xs, *ws, offs, r))
        torch.autograd.backward([y.sum() for y in ys])
        along_tokens = [c for c in spy.calls if not c[1] and (
            c[0] in ("to_mx_dim0_dim1", "swiglu_qdq_trusted", "swiglu_bwd_qdq_trusted")
            or (c[0] == "qdq_trusted" and c[3]) or (c[0] == "to_mx" and c[2] in (0, -2)))]
        weights = {c[2:] for c in spy.calls if c[1]}
        if r.wgrad_with_hp:
            assert spy.calls and not along_tokens, along_tokens
        else:
            assert along_tokens
        # each weight cast along K (forward) and along N (dgrad): on the qdq path both from one
        # read in the forward (`cast_weight`)
        assert weights == ({(True, True)} if path == "qdq" else {(-1,), (-2,)}), weights


def test_emulated_recipe_is_the_emulated_gemm(monkeypatch):
    """"mxfp8_emulated_rceil" is mxfp8_rceil with gemm_backend="emulated": the emulated GEMM also
    where the native one runs (here: stand-ins on CPU), bit for bit the emulated GEMM's results,
    while mxfp8_rceil's "auto" takes the native GEMMs there."""
    sem = MXGemmSemantics()
    monkeypatch.setattr(torch, "_scaled_mm", sem.mm)
    monkeypatch.setattr(torch, "_scaled_grouped_mm", sem.grouped)
    monkeypatch.setattr(gemm_backend, "native_unavailable", lambda device: None)
    monkeypatch.setattr(registry, "RESOLVED", {})  # the GEMM backend's answers, kept, rest on it
    emu = recipe("mxfp8_emulated_rceil", dim0_kernel="torch", dim1_kernel="torch")
    assert emu == recipe("mxfp8_rceil", dim0_kernel="torch", dim1_kernel="torch", gemm_backend="emulated")
    assert MXOptions(recipe_name="mxfp8_emulated_rceil").to_recipe().gemm_backend == "emulated"
    cpu = torch.device("cpu")
    assert gemm_backend.resolve_gemm_backend(emu, cpu) == "emulated"
    assert gemm_backend.resolve_gemm_backend(recipe("mxfp8_rceil"), cpu) == "native"
    assert gemm_backend.op_kernels(emu, cpu).qdq
    x, w, _, w1, *_, offs = operands(torch.bfloat16, "cpu")

    def run(rr):
        a, b, we = _leaves(x, w, w1)
        ys = [mx_mm(a, b.t(), rr), mx_grouped_mm(a, we.transpose(-2, -1), offs, rr)]
        torch.autograd.backward(ys, _dys(ys))
        return [*ys, a.grad, b.grad, we.grad]

    got = run(emu)
    assert sem.calls == {"mm": 0, "grouped": 0}  # no native GEMM ran
    for i, (a, b) in enumerate(zip(got, run(emu.replace(gemm_backend="emulated")), strict=True)):
        assert_same_bits(a, b, f"result {i}")
    native = _leaves(x, w)
    mx_mm(native[0], native[1].t(), emu.replace(gemm_backend="auto")).sum().backward()
    assert sem.calls["mm"] == 3  # mxfp8_rceil there: forward, dgrad, wgrad native


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["auto", "triton"])
@pytest.mark.parametrize("path", ["qdq", "mx"])
def test_gpu_matches_the_definition(monkeypatch, kernel, path):
    """On CUDA: the cuda casts ("auto") and the triton casts, the emulated GEMM (sm_90's "auto") on
    both paths, bf16 activations: the same equalities."""
    if path == "mx":
        monkeypatch.setattr(gemm_backend, "QDQ_BACKENDS", frozenset())
    x, w, v, w1, w3, w2, offs = operands(torch.bfloat16, "cuda")
    check(linear_checks(hp_recipe(kernel), x, w, v))
    check(grouped_checks(hp_recipe(kernel), x, w1, w3, w2, offs))
