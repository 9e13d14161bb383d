"""mxmoe's MX training ops against torchao 0.18's emulated MXFP8 training ops, on CPU.

Issue #30 asks whether MX training's loss gap on moe_2b could come from a tensor quantized along
the wrong axis. torchao's emulated MXFP8 ops (what the torchtitan peer in scripts/ runs) are an
independent implementation of the same recipe, with casts bit-equal to mxmoe's on normal data.
Here both run on identical fp32 inputs with RCEIL scales and every result is compared:

* `mx_grouped_mm` (the routed experts) against `_quantize_then_scaled_grouped_mm` with the
  recipe "mxfp8_emulated_rceil" (the call torchtitan makes): output, gradient of a, gradient of
  the expert weights;
* `mx_mm` (MXLinear's op) against `MXFP8Linear(kernel_preference=EMULATED)`: output, input
  gradient, weight gradient.

Finding (torch 2.13 CPU, torchao 0.18.0): every output and gradient agrees. All of them are
bit-identical except in one grouped case ([31, 160, 161, 200]), where y and da differ by up to
1.5 % of the tolerance below (the two CPU GEMMs sum in different orders; dW is bit-identical).
Both libraries quantize each operand along the axis its GEMM reduces over:
  forward  y   = a Wₑᵀ  : a along K,   Wₑ along K
  dgrad    da  = dy Wₑ  : dy along N,  Wₑ along N
  wgrad    dWₑ = dyₑᵀ aₑ: dyₑ and aₑ along the tokens, blocks starting at each expert's first token.
`test_axes_spelled_out` checks this directly. A reference made of torchao's casts along those
axes agrees with mxmoe bit for bit. Moving any one operand to its other axis, or letting the
wgrad's token blocks run across experts, misses mxmoe by 5·10³ to 4.5·10⁴ times the tolerance.
No tensor is quantized along the wrong axis.

The data spans 2^±8 along rows and along columns (`_wide`). An MX cast with power-of-two scales
rounds each element to e4m3's 3-bit mantissa whatever its block; the block only decides which
elements fall below e4m3's smallest normal (2^-6 of the scale, 2^-15 to 2^-14 of the block's
amax) and lose precision. On data of one magnitude (plain randn) a cast along the wrong axis
gives the same bits, and no comparison could see it. Even on this data a wrong axis moves a
GEMM's result by only 1e-6 to 5e-6 relative (Frobenius norm), while it misses single elements by
far more than the tolerance.

Tolerance: both sides multiply the same MX operands exactly (two e4m3 values times power-of-two
scales: at most 8 significant bits, exact in fp32) and sum n products in fp32 in their own order.
Two orders differ by at most 2·γₙ·Σ|products| (γₙ ≈ n·2^-24). Σ|products| is at most
(1 + 2^-4)² times the same GEMM on |inputs| (e4m3 rounds by at most 2^-4 relative), so each
element must agree within 4·n·2^-24 times that GEMM on |inputs|, n the GEMM's reduction length.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from mxmoe import MXRecipe
from mxmoe.ops import mx_grouped_mm, mx_mm

U = 2.0**-24  # fp32 unit roundoff
RECIPE = MXRecipe()  # the default: e4m3 in blocks of 32, RCEIL, emulated GEMM in fp32 on CPU
K = N = 64
E = 4


@pytest.fixture(scope="module")
def ao():
    return pytest.importorskip("torchao", minversion="0.18.0")


def _wide(g: torch.Generator, *shape: int, r: float = 8.0) -> torch.Tensor:
    """randn times a factor 2^U(-r, r) per row and one per column (see the module docstring)."""
    x = torch.randn(*shape, generator=g)
    for d in (-2, -1):
        s = [1] * len(shape)
        s[d] = shape[d]
        x = x * torch.exp2(torch.empty(s).uniform_(-r, r, generator=g))
    return x


def _assert_sum_order_close(got: torch.Tensor, ref: torch.Tensor, abs_gemm: torch.Tensor, n: int, what: str):
    """|got - ref| <= 4·n·2^-24·abs_gemm elementwise (module docstring, Tolerance)."""
    assert got.dtype == ref.dtype == torch.float32 and got.shape == ref.shape, what
    err = (got - ref).abs()
    tol = 4 * n * U * abs_gemm
    bad = err > tol
    worst = (err / tol)[bad].max() if bad.any() else 0.0
    assert not bad.any(), f"{what}: {int(bad.sum())} elements off, worst {worst:.3g}x the tolerance"


def _grouped_fp32(a: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, ends: list[int]):
    """Plain fp32 per-expert GEMMs: y = aₑ Wₑᵀ, da = dyₑ Wₑ, dWₑ = dyₑᵀ aₑ for a (T, K), w (E, N, K),
    dy (T, N), group e = rows ends[e]:ends[e + 1]; rows after the last group zero."""
    y, da, dw = torch.zeros(a.shape[0], w.shape[1]), torch.zeros_like(a), torch.zeros_like(w)
    for e in range(len(ends) - 1):
        s, t = ends[e], ends[e + 1]
        y[s:t] = a[s:t] @ w[e].t()
        da[s:t] = dy[s:t] @ w[e]
        dw[e] = dy[s:t].t() @ a[s:t]
    return y, da, dw


def _grads(fn, a: torch.Tensor, w: torch.Tensor, dy: torch.Tensor):
    """(y, da, dw) of y = fn(a, w) backpropagating dy."""
    a, w = a.clone().requires_grad_(), w.clone().requires_grad_()
    y = fn(a, w)
    y.backward(dy)
    return y.detach(), a.grad, w.grad


@pytest.fixture
def fp32_grouped_mm(monkeypatch):
    """torchao's emulation dequantizes its MX operands to bf16 (exact: e4m3 times a power of two)
    and calls torch._grouped_mm with out_dtype=float32, which CUDA runs as bf16 operands summed in
    fp32. torch's CPU _grouped_mm refuses an out_dtype other than the operands' own, so within this
    fixture it takes the operands upcast to fp32 (exact) and sums in fp32, as CUDA's does."""
    grouped_mm = torch._grouped_mm

    def fp32_sum(a, b, offs=None, bias=None, out_dtype=None):
        return grouped_mm(a.float(), b.float(), offs=offs, bias=bias).to(out_dtype or a.dtype)

    monkeypatch.setattr(torch, "_grouped_mm", fp32_sum)


def _torchao_grouped(pad: bool, wgrad_with_hp: bool = False):
    """torchao's grouped GEMM as torchtitan calls it, with the recipe "mxfp8_emulated_rceil" and an
    fp32 output (the recipe's bf16 output would hide summation-order differences behind bf16
    rounding). pad: pad_token_groups_for_grouped_mm; wgrad_with_hp: the weight gradient in high
    precision (torchao's "mxfp8_rceil_wgrad_with_hp" on its emulated kernels)."""
    from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig, MXFP8TrainingRecipe
    from torchao.prototype.moe_training.utils import _quantize_then_scaled_grouped_mm

    cfg = MXFP8TrainingOpConfig.from_recipe(MXFP8TrainingRecipe.MXFP8_EMULATED_RCEIL)
    cfg = dataclasses.replace(
        cfg, out_dtype=torch.float32, pad_token_groups_for_grouped_mm=pad, wgrad_with_hp=wgrad_with_hp
    )
    return lambda a, b_t, offs: _quantize_then_scaled_grouped_mm(a, b_t, config=cfg, offs=offs)


# What torchao 0.18's emulated grouped GEMM accepts: its wgrad casts dyᵀ and aᵀ along the tokens in
# blocks of 32 counted from token 0 across all groups, so every group must be a multiple of 32
# tokens, or be padded to one (pad_token_groups_for_grouped_mm=True, as torchtitan's token-group
# alignment does). Its torch padding path also needs offs[-1] == T (no tokens after the last group).
# mxmoe takes any group sizes (each expert's blocks start at its first token) and tokens after the
# last group. These cases are ones both accept: ragged and empty groups padded by torchao, and
# 32-aligned groups without padding.
GROUPED_CASES = [
    ([0, 64, 64, 200], True),  # empty first and third group, T = 200
    ([5, 5, 77, 200], True),  # empty second group, groups of 5, 72, 123
    ([31, 160, 161, 200], True),  # groups of 31, 129, 1, 39
    ([64, 128, 200, 200], True),  # empty last group
    ([32, 32, 96, 192], False),  # 32-aligned groups, an empty one
]


@pytest.mark.parametrize(
    "offs,pad,wgrad_with_hp", [(o, p, False) for o, p in GROUPED_CASES] + [([5, 5, 77, 200], True, True)]
)
def test_grouped_mm_matches_torchao(ao, fp32_grouped_mm, offs, pad, wgrad_with_hp):
    """mx_grouped_mm (fp32 in, default recipe) and torchao's emulated MXFP8 grouped GEMM give the same
    output, input gradient and weight gradient up to fp32 summation order; with wgrad_with_hp, both with the
    weight gradient in high precision (recipe mxfp8_rceil_wgrad_with_hp, torchao's wgrad_with_hp)."""
    T, ends = offs[-1], [0, *offs]
    g = torch.Generator().manual_seed(sum(offs))
    a, w, dy = _wide(g, T, K), _wide(g, E, N, K), _wide(g, T, N)
    o = torch.tensor(offs, dtype=torch.int32)
    ref_mm = _torchao_grouped(pad, wgrad_with_hp)
    r = RECIPE.replace(wgrad_with_hp=wgrad_with_hp)
    mine = _grads(lambda a_, w_: mx_grouped_mm(a_, w_.transpose(-2, -1), o, r), a, w, dy)
    ref = _grads(lambda a_, w_: ref_mm(a_, w_.transpose(-2, -1), o), a, w, dy)
    abs_gemm = _grouped_fp32(a.abs(), w.abs(), dy.abs(), ends)
    for name, got, want, bound, n in zip(("y", "da", "dw"), mine, ref, abs_gemm, (K, N, T), strict=True):
        _assert_sum_order_close(got, want, bound, n, name)
    for e in range(E):  # an empty expert gets no weight gradient
        if ends[e] == ends[e + 1]:
            assert not mine[2][e].any() and not ref[2][e].any()


def _qdq(x: torch.Tensor, dim: int) -> torch.Tensor:
    """torchao's torch MXFP8 cast (RCEIL) of x along `dim`, zero-padded to a multiple of 32 there,
    dequantized to fp32."""
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import to_mx

    x = x.movedim(dim, -1)
    n = x.shape[-1]
    xp = F.pad(x, (0, -n % 32)).contiguous()
    scale, q = to_mx(xp, torch.float8_e4m3fn, 32, ScaleCalculationMode.RCEIL)
    deq = q.float().unflatten(-1, (-1, 32)) * scale.float().unsqueeze(-1)
    return deq.flatten(-2)[..., :n].movedim(-1, dim)


def _along_tokens_per_group(x: torch.Tensor, ends: list[int]) -> torch.Tensor:
    """x (T, C) cast along the tokens, each group's blocks starting at its first token."""
    out = torch.zeros_like(x)
    for e in range(len(ends) - 1):
        out[ends[e] : ends[e + 1]] = _qdq(x[ends[e] : ends[e + 1]], 0)
    return out


def test_axes_spelled_out(ao):
    """Which operand mxmoe quantizes along which axis, checked by value: each GEMM of mx_grouped_mm
    agrees with the plain GEMM of torchao's casts along the axes in the module docstring, and
    misses by far more than the tolerance when any one operand is cast along its other axis, or
    when the wgrad's blocks along the tokens run across experts (what torchao does with ragged
    groups unpadded)."""
    offs = [40, 40, 100, 192]  # groups of 40, 0, 60, 92: blocks from token 0 straddle experts
    T, ends = offs[-1], [0, *offs]
    g = torch.Generator().manual_seed(3)
    a, w, dy = _wide(g, T, K), _wide(g, E, N, K), _wide(g, T, N)
    # the first expert's tokens 2^-16 below the third's, which share their last block when blocks
    # run across experts: there the first expert's tokens fall below e4m3's normals
    a[:40] *= 2.0**-16
    dy[:40] *= 2.0**-16
    mine = _grads(
        lambda a_, w_: mx_grouped_mm(a_, w_.transpose(-2, -1), torch.tensor(offs, dtype=torch.int32), RECIPE),
        a, w, dy,
    )
    y, da, dw = (0, 1, 2)
    a_k, a_m, a_m_global = _qdq(a, 1), _along_tokens_per_group(a, ends), _qdq(a, 0)
    dy_n, dy_m, dy_m_global = _qdq(dy, 1), _along_tokens_per_group(dy, ends), _qdq(dy, 0)
    w_k, w_n = _qdq(w, 2), _qdq(w, 1)
    right = {  # GEMM: its operands on the axes both libraries use
        y: (a_k, w_k, dy),
        da: (a, w_n, dy_n),
        dw: (a_m, w, dy_m),
    }
    wrong = {  # one operand on the other axis
        "y: a along the tokens": (y, (a_m, w_k, dy)),
        "y: W along N": (y, (a_k, w_n, dy)),
        "da: W along K": (da, (a, w_k, dy_n)),
        "da: dy along the tokens": (da, (a, w_n, dy_m)),
        "dw: a along K": (dw, (a_k, w, dy_m)),
        "dw: dy along N": (dw, (a_m, w, dy_n)),
        "dw: token blocks across experts": (dw, (a_m_global, w, dy_m_global)),
    }
    abs_gemm = _grouped_fp32(a.abs(), w.abs(), dy.abs(), ends)
    n = (K, N, T)
    for i, ops in right.items():
        _assert_sum_order_close(mine[i], _grouped_fp32(*ops, ends)[i], abs_gemm[i], n[i], f"gemm {i}")
    for what, (i, ops) in wrong.items():
        miss = (mine[i] - _grouped_fp32(*ops, ends)[i]).abs() / (4 * n[i] * U * abs_gemm[i])
        assert miss.nan_to_num().max() > 100, what


@pytest.mark.parametrize("M,wgrad_with_hp", [(224, False), (200, False), (200, True)])
def test_mx_mm_matches_torchao_mxfp8_linear(ao, M, wgrad_with_hp):
    """mx_mm (fp32 in, default recipe) and torchao's MXFP8Linear with kernel_preference EMULATED give
    the same output, input gradient and weight gradient up to fp32 summation order. torchao's
    wgrad casts dy and x along the tokens and needs their number to be a multiple of 32; for M=200
    it gets x and dy zero-padded to 224 rows (mxmoe's short last block is that zero padding) and
    its first 200 rows are compared. wgrad_with_hp: both with the weight gradient in high precision (recipe
    mxfp8_rceil_wgrad_with_hp, torchao's wgrad_with_hp)."""
    from torchao.prototype.moe_training.mxfp8_linear import MXFP8Linear
    from torchao.quantization.quantize_.common import KernelPreference

    g = torch.Generator().manual_seed(M)
    x, w, dy = _wide(g, M, K), _wide(g, N, K), _wide(g, M, N)
    r = RECIPE.replace(wgrad_with_hp=wgrad_with_hp)
    mine = _grads(lambda x_, w_: mx_mm(x_, w_.t(), r), x, w, dy)

    lin = MXFP8Linear(
        K, N, bias=False, kernel_preference=KernelPreference.EMULATED, wgrad_with_hp=wgrad_with_hp
    )
    assert lin.scale_calculation_mode.value == "rceil"
    pad = -M % 32

    def torchao_linear(x_, w_):  # the module's forward with w_ (the leaf _grads differentiates)
        return torch.func.functional_call(lin, {"weight": w_}, (x_,))

    ref = _grads(torchao_linear, F.pad(x, (0, 0, 0, pad)), w, F.pad(dy, (0, 0, 0, pad)))
    ref = (ref[0][:M], ref[1][:M], ref[2])
    abs_y, abs_dx, abs_dw = x.abs() @ w.abs().t(), dy.abs() @ w.abs(), dy.abs().t() @ x.abs()
    for name, got, want, bound, n in zip(("y", "dx", "dw"), mine, ref, (abs_y, abs_dx, abs_dw), (K, N, M),
                                         strict=True):
        _assert_sum_order_close(got, want, bound, n, name)
