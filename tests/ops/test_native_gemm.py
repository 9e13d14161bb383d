"""The native (Blackwell) GEMM backend against the peer, on CPU.

Swizzled scales: `mxmoe.quant.scale_layout` byte-equal to torchao 0.18's `to_blocked` and its
per-group rearrangements (2D grouped along M, along K, 3D weights) on every shape class. The
grouped GEMM: for the same inputs, the tensors (values, shapes, strides), scales and offsets that
mx_grouped_mm hands torch._scaled_grouped_mm (forward, dgrad, wgrad) byte-identical to those
torchao's MXFP8 grouped GEMM hands it, both captured by a stand-in op on CPU (torchao's CUDA-only
casts replaced by torchao's own torch references). torchao is a test-only dependency (skipped
without it). The dispatch ("auto", "native") is tested on CPU here; the GEMMs themselves need a
B200 (docs/training-ops.md, Blackwell).
"""

from __future__ import annotations

import logging

import pytest
import torch

from mxmoe import MXRecipe, registry
from mxmoe.ops import gemm_backend, mx_gemm, mx_grouped_mm, mx_mm
from mxmoe.quant import backends
from mxmoe.quant import scale_layout as sl
from mxmoe.quant.mx_tensor import to_mx, to_mx_dim0_dim1
from tests.ops.native import MXGemmSemantics

E8 = torch.float8_e8m0fnu
NATIVE = MXRecipe(dim0_kernel="torch", dim1_kernel="torch", gemm_backend="native")


def _scales(*shape: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 255, shape, generator=g, dtype=torch.uint8).view(E8)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


# shape classes: rows / columns below, at and above a tile, not multiples of 128 / 4
DENSE_SHAPES = [(1, 1), (5, 3), (128, 4), (129, 5), (200, 6), (300, 8), (256, 12)]
# group ends: ragged, empty groups (first, middle, last), a group of exactly 128, one of 1
M_OFFS = [[5, 5, 200, 300], [0, 130, 131, 257], [128, 256], [1, 1, 1], [64, 64, 64, 200]]
K_OFFS = [[1, 1, 9, 12], [0, 5, 6, 20], [4, 8], [3, 3, 3], [2, 7, 7]]


@pytest.fixture(scope="module")
def ao():
    pytest.importorskip("torchao")
    from torchao.prototype.moe_training.kernels.mxfp8 import quant
    from torchao.prototype.mx_formats.utils import to_blocked

    return to_blocked, quant


@pytest.mark.parametrize("rows,cols", DENSE_SHAPES)
def test_to_swizzled_matches_torchao(ao, rows, cols):
    ao_to_blocked, _ = ao
    s = _scales(rows, cols)
    b = sl.to_swizzled(s)
    assert b.shape == sl.swizzled_shape(rows, cols) and b.dtype == E8
    assert torch.equal(_bytes(b).flatten(), _bytes(ao_to_blocked(s)))
    assert torch.equal(_bytes(sl.from_swizzled(b, rows, cols)), _bytes(s))


@pytest.mark.parametrize("E,rows,cols", [(1, 5, 3), (3, 200, 8), (2, 128, 4), (4, 64, 6)])
def test_to_swizzled_3d_matches_torchao(ao, E, rows, cols):
    _, quant = ao
    s = _scales(E, rows, cols, seed=1)
    b = sl.to_swizzled(s)
    assert torch.equal(_bytes(b).reshape(E, -1), _bytes(quant.torch_to_blocked_per_group_3d(s)))
    assert torch.equal(_bytes(sl.from_swizzled(b, rows, cols)), _bytes(s))


@pytest.mark.parametrize("offs", M_OFFS)
@pytest.mark.parametrize("tail", [0, 7])
def test_m_groups_match_torchao(ao, offs, tail):
    """Groups along the rows; `tail` rows after the last group (in no group) are left out."""
    _, quant = ao
    o = torch.tensor(offs, dtype=torch.int32)
    R = offs[-1] + tail
    s = _scales(R, 8, seed=2)
    ref, _ = quant.torch_to_blocked_2d_M_groups(s, o)
    mine = sl.to_swizzled_m_groups(s, o)
    assert mine.shape == ref.shape and mine.dtype == E8
    assert torch.equal(_bytes(mine), _bytes(ref))
    back = _bytes(sl.from_swizzled_m_groups(mine, o, R, 8))
    assert torch.equal(back[: offs[-1]], _bytes(s)[: offs[-1]])
    assert not back[offs[-1] :].any()


@pytest.mark.parametrize("offs", K_OFFS)
@pytest.mark.parametrize("rows", [7, 128, 200])
def test_k_groups_match_torchao(ao, offs, rows):
    """Groups along the scale columns (token ends // 32) of a cast along the tokens."""
    _, quant = ao
    o = torch.tensor(offs, dtype=torch.int32)
    s = _scales(rows, offs[-1], seed=3)
    ref, _ = quant.torch_to_blocked_2d_K_groups(s, o)
    mine = sl.to_swizzled_k_groups(s, o)
    assert mine.shape == ref.shape and mine.dtype == E8
    assert torch.equal(_bytes(mine), _bytes(ref))
    assert torch.equal(_bytes(sl.from_swizzled_k_groups(mine, o, rows, offs[-1])), _bytes(s))


def test_to_mx_swizzled_scales():
    """to_mx(scale_layout="swizzled") keeps the elements and the storage scales (scale_blocked: one
    per block, blocks contiguous) and adds them swizzled (per group with offs); it dequantizes to
    what the plain layout gives, and to_scale_layout("plain") drops the swizzled copy."""
    x = torch.randn(224, 96) * torch.logspace(-3, 3, 96)
    offs = torch.tensor([0, 64, 64, 160], dtype=torch.int32)
    for axis in (-1, 0):
        plain = to_mx(x, axis)
        ref = plain.dequantize(torch.float32)
        b = to_mx(x, axis, scale_layout="swizzled")
        assert plain.scale_layout == "plain" and plain.scale_swizzled is None
        assert b.scale_layout == "swizzled" and torch.equal(b.qdata_blocked, plain.qdata_blocked)
        assert torch.equal(_bytes(b.scale_blocked), _bytes(plain.scale_blocked))
        assert torch.equal(_bytes(b.scale_swizzled), _bytes(sl.to_swizzled(plain.scale_blocked)))
        assert torch.equal(b.dequantize(torch.float32), ref)
        assert torch.equal(_bytes(b.scale), _bytes(plain.scale))
        g = to_mx(x, axis, scale_layout="swizzled", offs=offs)
        grouped = sl.to_swizzled_m_groups if axis == -1 else sl.to_swizzled_k_groups
        want = grouped(plain.scale_blocked, offs if axis == -1 else offs // 32)
        assert torch.equal(_bytes(g.scale_swizzled), _bytes(want)) and g.offs is offs
        assert torch.equal(g.dequantize(torch.float32), ref)
        back = g.to_scale_layout("plain")
        assert back.scale_swizzled is None and back.offs is None and back.scale_blocked is g.scale_blocked
        assert plain.to_scale_layout("plain") is plain and g.to_scale_layout("swizzled", offs) is g
    d0, d1 = to_mx_dim0_dim1(x[:192], scale_layout="swizzled", offs=offs)
    assert d0.scale_swizzled.shape == (192 + 128 * 4, 4)  # M groups, 3 scale columns padded to 4
    assert d1.scale_swizzled.shape == (128, 192 // 32 + 4 * 4)  # K groups along the tokens
    w = torch.randn(3, 64, 96)
    p, b = to_mx(w, -2), to_mx(w, -2, scale_layout="swizzled")
    assert b.scale_swizzled.shape == (3, 128, 4)
    assert torch.equal(b.dequantize(torch.float32), p.dequantize(torch.float32))


def test_to_mx_layout_errors():
    x = torch.randn(64, 64)
    with pytest.raises(ValueError, match="scale_layout='tiled' is not a scale layout"):
        to_mx(x, scale_layout="tiled")
    # the old spelling of the swizzled layout: "blocked" means only the storage with blocks contiguous
    with pytest.raises(ValueError, match=r"scale_layout='blocked' is now scale_layout='swizzled'"):
        to_mx(x, scale_layout="blocked")
    with pytest.raises(ValueError, match=r"scale_layout='blocked' is now scale_layout='swizzled'"):
        to_mx(x).to_scale_layout("blocked")
    with pytest.raises(AttributeError, match="mxmoe.quant.scale_layout.to_blocked is now to_swizzled"):
        sl.to_blocked  # noqa: B018
    with pytest.raises(ValueError, match="pass scale_layout='swizzled' with it"):
        to_mx(x, offs=torch.tensor([64], dtype=torch.int32))
    with pytest.raises(ValueError, match="multiple of block_size=32"):
        to_mx(x, 0, scale_layout="swizzled", offs=torch.tensor([5, 64], dtype=torch.int32))
    with pytest.raises(ValueError, match="non-decreasing group ends <= x.shape"):
        to_mx(x, scale_layout="swizzled", offs=torch.tensor([40, 20], dtype=torch.int32))


def test_emulated_gemm_takes_both_layouts():
    """The emulated mx_gemm gives the same bits for plain and swizzled operands (dense, 2D x 3D)."""
    cfg = MXRecipe(gemm_backend="emulated")
    a, b = torch.randn(100, 64), torch.randn(64, 96)
    ref = mx_gemm(to_mx(a), to_mx(b, 0), recipe=cfg)
    got = mx_gemm(to_mx(a, scale_layout="swizzled"), to_mx(b, 0, scale_layout="swizzled"), recipe=cfg)
    assert torch.equal(got, ref)
    w = torch.randn(3, 96, 64)
    offs = torch.tensor([10, 10, 100], dtype=torch.int32)
    bt = to_mx(w, -1).to_scale_layout("plain")
    from mxmoe.ops.linear import swap_last2

    ref = mx_gemm(to_mx(a), swap_last2(bt), offs, cfg)
    a_b = to_mx(a, scale_layout="swizzled", offs=offs)
    got = mx_gemm(a_b, swap_last2(to_mx(w, -1, scale_layout="swizzled")), offs, cfg)
    assert torch.equal(got, ref)


@pytest.fixture
def fresh_resolution(monkeypatch):
    """A private cache of resolved answers (native availability, op_kernels, the GEMM backend
    registry's) and of logged lines."""
    monkeypatch.setattr(backends, "_resolved", {})
    monkeypatch.setattr(registry, "RESOLVED", {})
    monkeypatch.setattr(gemm_backend, "_logged", set())


def test_auto_is_emulated_on_cpu_with_one_log_line(fresh_resolution, caplog):
    """"auto" (the default) runs the emulated GEMM on CPU, bit for bit what "emulated" gives, and
    says why once."""
    assert MXRecipe().gemm_backend == "auto"
    x, w = torch.randn(40, 64), torch.randn(64, 32)
    with caplog.at_level(logging.INFO, logger="mxmoe.ops.gemm_backend"):
        y = mx_mm(x, w, MXRecipe())
        mx_mm(x, w, MXRecipe())
    assert torch.equal(y, mx_mm(x, w, MXRecipe(gemm_backend="emulated")))
    lines = [r.getMessage() for r in caplog.records if "gemm_backend='auto'" in r.getMessage()]
    assert len(lines) == 1 and "compute capability 10.x" in lines[0] and "cpu" in lines[0]
    assert gemm_backend.resolve_gemm_backend(MXRecipe(), torch.device("cpu")) == "emulated"


def test_native_where_it_cannot_run_is_a_clear_error(fresh_resolution, monkeypatch):
    x, w = torch.randn(40, 64), torch.randn(64, 32)
    with pytest.raises(RuntimeError, match=r"needs a CUDA device of compute capability 10\.x .*cpu"):
        mx_mm(x, w, NATIVE)
    # where the device can: a recipe the op cannot take is named; "auto" falls back instead
    monkeypatch.setattr(gemm_backend, "native_unavailable", lambda device: None)
    e5 = NATIVE.replace(elem_dtype=torch.float8_e5m2)
    with pytest.raises(ValueError, match="takes e4m3 operands in blocks of 32.*float8_e5m2"):
        mx_mm(x, w, e5)
    cpu = torch.device("cpu")
    assert gemm_backend.resolve_gemm_backend(e5.replace(gemm_backend="auto"), cpu) == "emulated"
    assert gemm_backend.resolve_gemm_backend(NATIVE.replace(gemm_backend="auto"), cpu) == "native"


class _Capture:
    """A stand-in for torch._scaled_grouped_mm / torch._scaled_mm: records each call (the
    tensors' dtype, shape, strides and bytes) and returns zeros of the output's shape."""

    def __init__(self):
        self.calls = []

    def grouped(self, a, b, scale_a, scale_b, offs=None, bias=None, scale_result=None, out_dtype=None,
                use_fast_accum=False):
        assert bias is None and scale_result is None and not use_fast_accum
        self.calls.append({"a": a, "b": b, "scale_a": scale_a, "scale_b": scale_b, "offs": offs,
                           "out_dtype": out_dtype})
        shape = (a.shape[0], b.shape[-1]) if b.ndim == 3 else (offs.shape[0], a.shape[0], b.shape[-1])
        return torch.zeros(shape, dtype=out_dtype)


def _same(x: torch.Tensor, y: torch.Tensor) -> bool:
    return (
        x.dtype == y.dtype and x.shape == y.shape and x.stride() == y.stride()
        and torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8))
    )


def _torchao_calls(monkeypatch, cap, a, w_t, offs, dy, mode: str):
    """torchao 0.18's MXFP8 grouped GEMM with its CUDA-only casts replaced by torchao's own torch
    references. Returns the captured (forward, dgrad) calls of its forward and dgrad steps on the
    unpadded tokens (`_compute_fwd`, `_compute_dgrad`, as _MXFP8GroupedMM runs them without
    token padding) and the wgrad call of its whole autograd function with
    pad_token_groups_for_grouped_mm=True (ragged groups need it for the wgrad)."""
    from torchao.prototype.moe_training import mxfp8_grouped_mm as m
    from torchao.prototype.moe_training.kernels.mxfp8 import quant
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import to_mx as ao_to_mx
    from torchao.quantization.quantize_.common import KernelPreference

    def dim0(x, scaling_mode):
        scale, data = ao_to_mx(x.contiguous(), torch.float8_e4m3fn, 32, ScaleCalculationMode(scaling_mode))
        return data, scale.reshape(*x.shape[:-1], x.shape[-1] // 32)

    def quantize_m_groups(x, scaling_mode="rceil", offs=None, **_):
        data, scale = dim0(x, scaling_mode)
        return data, quant.torch_to_blocked_2d_M_groups(scale, offs)[0]

    wrapper = m._to_mxfp8_dim1_kernel_wrapper

    def dim1(*args, **kwargs):  # the torch cast (torchao's EMULATED kernel preference)
        kwargs["kernel_preference"] = KernelPreference.EMULATED
        return wrapper(*args, **kwargs)

    def quantize_3d(x, block_size, scale_block_dim1, scale_block_dim2, scaling_mode):
        return quant._mxfp8_quantize_reference_3d(
            x, block_size=block_size, scale_block_dim1=scale_block_dim1, scale_block_dim2=scale_block_dim2,
            scaling_mode=scaling_mode, blocked_scale_output=True,
        )

    monkeypatch.setattr(m, "_SM100_KERNELS_AVAILABLE", True)
    monkeypatch.setattr(m, "mxfp8_quantize_2d_1x32_cutedsl", quantize_m_groups)
    monkeypatch.setattr(m, "triton_to_mxfp8_dim0", lambda x, bs, mode: dim0(x, mode))
    monkeypatch.setattr(m, "triton_mx_block_rearrange_per_group_3d", quant.torch_to_blocked_per_group_3d)
    monkeypatch.setattr(m, "mxfp8_quantize_cuda_3d", quantize_3d)
    monkeypatch.setattr(m, "_to_mxfp8_dim1_kernel_wrapper", dim1)
    monkeypatch.setattr(m, "triton_mx_block_rearrange_2d_K_groups",
                        lambda s, o: quant.torch_to_blocked_2d_K_groups(s, o)[0])
    sm = ScaleCalculationMode(mode)
    auto, bf16 = KernelPreference.AUTO, torch.bfloat16
    start = len(cap.calls)
    m._compute_fwd(a, w_t, offs, 32, bf16, sm, auto)
    m._compute_dgrad(dy, w_t, offs, 32, bf16, sm, auto)
    y = m._to_mxfp8_then_scaled_grouped_mm(
        a.detach().requires_grad_(), w_t.detach().requires_grad_(), offs, scale_calculation_mode=sm,
        pad_token_groups_for_grouped_mm=True,
    )
    y.backward(dy)
    fwd, dgrad, _, _, wgrad = cap.calls[start:]
    return fwd, dgrad, wgrad


@pytest.mark.parametrize(
    "offs,K,N",
    [
        ([5, 5, 77, 200], 128, 256),  # ragged groups, an empty first group, T no multiple of 128
        ([64, 64, 64, 192], 256, 128),  # empty groups in the middle and at the end
        ([31, 160, 161, 300], 128, 384),  # groups of 1 and of a block minus one
    ],
)
@pytest.mark.parametrize("mode", ["rceil", "floor"])
def test_grouped_gemm_calls_match_torchao(ao, monkeypatch, fresh_resolution, offs, K, N, mode):
    """mx_grouped_mm with gemm_backend="native" hands torch._scaled_grouped_mm the same bytes as
    torchao's MXFP8 grouped GEMM: forward and dgrad on the T tokens with the real offs (as torchao
    without token padding: the op takes any group sizes along M, each group's scales swizzled from
    a multiple of 128 rows), the wgrad on the group-padded copy with the padded offs (as torchao
    with pad_token_groups_for_grouped_mm: groups along K a multiple of 32)."""
    E, T = len(offs), offs[-1]
    g = torch.Generator().manual_seed(7)
    a = torch.randn(T, K, generator=g, dtype=torch.bfloat16)
    w = (torch.randn(E, N, K, generator=g) * 0.05).to(torch.bfloat16)  # (E, N, K) row-major
    dy = torch.randn(T, N, generator=g, dtype=torch.bfloat16)
    o = torch.tensor(offs, dtype=torch.int32)
    cap = _Capture()
    monkeypatch.setattr(torch, "_scaled_grouped_mm", cap.grouped)
    monkeypatch.setattr(gemm_backend, "native_unavailable", lambda device: None)

    ao_fwd, ao_dgrad, ao_wgrad = _torchao_calls(monkeypatch, cap, a, w.transpose(-2, -1), o, dy, mode)

    cfg = NATIVE.replace(scaling_mode=mode)
    a_ = a.clone().requires_grad_()
    w_ = w.clone().requires_grad_()
    start = len(cap.calls)
    y = mx_grouped_mm(a_, w_.transpose(-2, -1), o, cfg)
    y.backward(dy)
    mine = cap.calls[start:]
    assert len(mine) == 3
    by_kind = {("wgrad" if c["b"].ndim == 2 else "fwd" if c["b"].shape[1] == K else "dgrad"): c for c in mine}
    for kind, ref in (("fwd", ao_fwd), ("dgrad", ao_dgrad), ("wgrad", ao_wgrad)):
        got = by_kind[kind]
        for name in ("a", "b", "scale_a", "scale_b", "offs"):
            assert _same(got[name], ref[name]), (kind, name, got[name].shape, ref[name].shape)
        assert got["out_dtype"] == ref["out_dtype"] == torch.bfloat16



def _grads(fn, *args):
    args = [t.clone().requires_grad_() for t in args]
    y = fn(*args)
    g = torch.Generator().manual_seed(11)
    dy = torch.randn(y.shape, generator=g).to(y.dtype)
    y.backward(dy)
    return (y, *(t.grad for t in args))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_native_path_computes_the_mx_products(monkeypatch, fresh_resolution, dtype):
    """With stand-ins that compute torch's documented semantics, the native path gives the
    emulated path's outputs and gradients (mx_mm, mx_grouped_mm with ragged, empty and tail
    groups) up to the bf16 rounding of torch's output: orientation, strides and scales are
    right by value, not only by layout."""
    sem = MXGemmSemantics()
    monkeypatch.setattr(torch, "_scaled_mm", sem.mm)
    monkeypatch.setattr(torch, "_scaled_grouped_mm", sem.grouped)
    monkeypatch.setattr(gemm_backend, "native_unavailable", lambda device: None)
    emu = NATIVE.replace(gemm_backend="emulated")
    g = torch.Generator().manual_seed(5)
    x = torch.randn(45, 128, generator=g).to(dtype)
    w = (torch.randn(96, 128, generator=g) * 0.1).to(dtype)
    for got, ref in zip(
        _grads(lambda a, b: mx_mm(a, b.t(), NATIVE), x, w), _grads(lambda a, b: mx_mm(a, b.t(), emu), x, w),
        strict=True,
    ):
        assert got.dtype == ref.dtype
        torch.testing.assert_close(got, ref.to(torch.bfloat16).to(ref.dtype), atol=1e-5, rtol=1 / 128)
    assert sem.calls == {"mm": 3, "grouped": 0}  # forward, dgrad, wgrad
    offs = torch.tensor([0, 37, 37, 100], dtype=torch.int32)  # empty groups, 10 tail rows
    a = torch.randn(110, 64, generator=g).to(dtype)
    we = (torch.randn(4, 96, 64, generator=g) * 0.1).to(dtype)
    got = _grads(lambda a_, w_: mx_grouped_mm(a_, w_.transpose(-2, -1), offs, NATIVE), a, we)
    ref = _grads(lambda a_, w_: mx_grouped_mm(a_, w_.transpose(-2, -1), offs, emu), a, we)
    for gt, rf in zip(got, ref, strict=True):
        assert gt.dtype == rf.dtype
        torch.testing.assert_close(gt, rf.to(torch.bfloat16).to(rf.dtype), atol=1e-5, rtol=1 / 128)
    assert not got[0][100:].any() and not got[1][100:].any()
    assert sem.calls == {"mm": 3, "grouped": 3}


def _capability() -> tuple[int, int]:
    return torch.cuda.get_device_capability() if torch.cuda.is_available() else (0, 0)


@pytest.mark.gpu
def test_gpu_auto_resolves_by_capability(fresh_resolution, caplog):
    """On a CUDA GPU "auto" is "native" exactly where torch runs the MX GEMMs on a 10.x device, and
    "emulated" (with the reason logged once) elsewhere, e.g. on sm_90."""
    dev = torch.device("cuda")
    with caplog.at_level(logging.INFO, logger="mxmoe.ops.gemm_backend"):
        got = gemm_backend.resolve_gemm_backend(MXRecipe(), dev)
    reason = gemm_backend.native_unavailable(dev)
    assert got == ("native" if reason is None else "emulated")
    if _capability()[0] != 10:
        assert reason is not None and "compute capability" in reason
        assert any("gemm_backend='auto' runs the emulated GEMM" in r.getMessage() for r in caplog.records)
        with pytest.raises(RuntimeError, match="compute capability 10.x"):
            mx_mm(torch.randn(64, 64, device=dev), torch.randn(64, 64, device=dev), NATIVE)


@pytest.mark.gpu
@pytest.mark.skipif(_capability()[0] != 10, reason="needs a compute capability 10.x GPU (B200)")
@pytest.mark.parametrize("T,offs", [(4096, [0, 1000, 1000, 3000, 4000]), (256, [256])])
def test_gpu_native_matches_emulated_on_blackwell(T, offs):
    """On a B200: the native GEMMs' outputs and gradients (mx_mm, mx_grouped_mm) match the emulated
    path's within bf16 accumulation-order error (same casts, same scales)."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    native = MXRecipe(gemm_backend="native")
    emu = MXRecipe(gemm_backend="emulated")
    x = torch.randn(T, 512, device=dev, generator=g, dtype=torch.bfloat16)
    w = torch.randn(1024, 512, device=dev, generator=g, dtype=torch.bfloat16) * 0.05
    for got, ref in zip(
        _grads(lambda a, b: mx_mm(a, b.t(), native), x, w), _grads(lambda a, b: mx_mm(a, b.t(), emu), x, w),
        strict=True,
    ):
        torch.testing.assert_close(got.float(), ref.float(), rtol=2e-2, atol=2e-2)
    o = torch.tensor(offs, dtype=torch.int32, device=dev)
    we = torch.randn(len(offs), 1024, 512, device=dev, generator=g, dtype=torch.bfloat16) * 0.05
    got = _grads(lambda a_, w_: mx_grouped_mm(a_, w_.transpose(-2, -1), o, native), x, we)
    ref = _grads(lambda a_, w_: mx_grouped_mm(a_, w_.transpose(-2, -1), o, emu), x, we)
    for gt, rf in zip(got, ref, strict=True):
        torch.testing.assert_close(gt.float(), rf.float(), rtol=2e-2, atol=2e-2)
