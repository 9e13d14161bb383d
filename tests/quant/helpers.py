"""Glue between torch tensors, the cast API and the NumPy oracle, for the MX cast tests."""

from __future__ import annotations

import functools
import hashlib

import numpy as np
import torch

from tests.quant import cases as D
from tests.quant import oracle as O

MODES = ("floor", "rceil", "ceil", "even")
ELEMS = (torch.float8_e4m3fn, torch.float8_e5m2)
DTYPES = (torch.bfloat16, torch.float32)
COMBOS = [(m, e, d) for m in MODES for e in ELEMS for d in DTYPES]


def dname(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def combos(kernel: str) -> list[tuple[str, torch.dtype, torch.dtype]]:
    """(mode, elem, dtype) triples the looping tests (odd shapes, non-contiguous inputs, block sizes)
    go through: all 16, or a spread of 4 for the Triton interpreter on CPU, which is slow (the
    per-combo tests still cover all 16 for it)."""
    if kernel == "triton" and not torch.cuda.is_available():
        return [
            ("floor", torch.float8_e4m3fn, torch.bfloat16),
            ("rceil", torch.float8_e5m2, torch.float32),
            ("ceil", torch.float8_e4m3fn, torch.float32),
            ("even", torch.float8_e5m2, torch.bfloat16),
        ]
    return COMBOS


def level(kernel: str) -> str:
    return "small" if kernel == "triton" and not torch.cuda.is_available() else "full"


@functools.lru_cache(maxsize=256)
def data(rows: int, bs: int, mode: str, elem: torch.dtype, dtype: torch.dtype, lvl: str, seed: int = 0,
         nb: int = 1):
    """Cached cases.dataset(): float32 (rows, C >= nb * bs), read-only."""
    x = D.dataset(rows, bs, mode, dname(elem), dname(dtype), lvl, seed, nb)
    x.setflags(write=False)
    return x


def to_torch(x32: np.ndarray, dtype: torch.dtype, device: str | torch.device = "cpu") -> torch.Tensor:
    """float32 numpy array (values representable in dtype) -> a contiguous torch tensor of dtype,
    bit-exact (NaN payloads kept)."""
    x32 = np.ascontiguousarray(x32, dtype=np.float32)
    if dtype == torch.float32:
        t = torch.from_numpy(x32.copy())
    elif dtype == torch.bfloat16:
        b = x32.view(np.uint32)
        assert np.all(b & 0xFFFF == 0), "not representable in bfloat16"
        t = torch.from_numpy((b >> 16).astype(np.uint16).view(np.int16)).view(torch.bfloat16)
    else:
        raise AssertionError(dtype)
    return t.to(device)


def to_f32_numpy(t: torch.Tensor) -> np.ndarray:
    """bf16/fp32 tensor -> float32 numpy (widening is exact; NaN payloads kept)."""
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return (t.view(torch.int16).numpy().view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    assert t.dtype == torch.float32
    return t.numpy().copy()


def ubytes(t: torch.Tensor) -> np.ndarray:
    """Raw bytes of a float8 / e8m0 tensor as uint8 numpy, same shape (any strides)."""
    assert t.element_size() == 1, t.dtype
    return t.detach().view(torch.uint8).cpu().numpy()


def _hex32(v) -> str:
    return f"0x{int(np.asarray(v, dtype=np.float32).view(np.uint32)):08x}"


def assert_bytes(got, want: np.ndarray, what: str, x32: np.ndarray | None = None, bs: int | None = None):
    """got (tensor or uint8 array) == want, bit for bit; the message lists the first mismatches with
    the input bits (x32: the float32 input with blocks along the last axis, same rows as want)."""
    g = ubytes(got) if isinstance(got, torch.Tensor) else np.asarray(got)
    assert g.shape == want.shape, f"{what}: shape {g.shape}, expected {want.shape}"
    bad = np.argwhere(g != want)
    if not len(bad):
        return
    lines = [f"{what}: {len(bad)} of {want.size} bytes differ"]
    for idx in bad[:8]:
        idx = tuple(int(i) for i in idx)
        line = f"  at {idx}: got 0x{g[idx]:02x}, expected 0x{want[idx]:02x}"
        if x32 is not None and bs is not None:
            if want.shape == x32.shape:  # element bytes
                line += f"; x = {_hex32(x32[idx])} ({float(x32[idx])!r})"
            else:  # scale bytes: show the block
                blk = x32[idx[:-1]][idx[-1] * bs : (idx[-1] + 1) * bs]
                amax = int(np.max(blk.view(np.uint32) & 0x7FFFFFFF))
                line += f"; block amax bits 0x{amax:08x} ({float(np.uint32(amax).view(np.float32))!r})"
        lines.append(line)
    raise AssertionError("\n".join(lines))


_ORACLE: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}


def oracle_quantize(x32: np.ndarray, bs: int, mode: str, elem) -> tuple[np.ndarray, np.ndarray]:
    """O.oracle_quantize(x32, ...), remembered by the input's bytes: the cast tests check the same
    data against it many times (dim0, dim1, 3D, fused, dequantize; each combo), the results are
    read-only."""
    x32 = np.ascontiguousarray(x32, dtype=np.float32)
    key = (hashlib.blake2b(x32.view(np.uint8), digest_size=16).digest(), x32.shape, bs, mode, dname(elem))
    hit = _ORACLE.get(key)
    if hit is None:
        if len(_ORACLE) >= 256:
            _ORACLE.clear()
        hit = _ORACLE[key] = O.oracle_quantize(x32, bs, mode, dname(elem))
        for a in hit:
            a.setflags(write=False)
    return hit


def check_quant(
    scale: torch.Tensor, qdata: torch.Tensor, x32: np.ndarray, bs: int, mode: str, elem, what: str,
    want: tuple[np.ndarray, np.ndarray] | None = None,
):
    """scale (R, C//bs) e8m0 and qdata (R, C) elem bytes == oracle_quantize(x32) (blocks along the
    last axis of x32, float32 (R, C); `want`: that result if already computed). Returns the oracle's
    (scale, elem) bytes."""
    assert scale.dtype == torch.float8_e8m0fnu, f"{what}: scale dtype {scale.dtype}"
    assert qdata.dtype == elem, f"{what}: qdata dtype {qdata.dtype}, expected {elem}"
    ws, wq = want if want is not None else oracle_quantize(x32, bs, mode, elem)
    assert_bytes(scale, ws, f"{what} scale bytes", x32, bs)
    assert_bytes(qdata, wq, f"{what} element bytes", x32, bs)
    return ws, wq


def check_dequant(got: torch.Tensor, scale_bytes, elem_bytes, bs: int, elem, what: str) -> None:
    """got (R, C) bf16/fp32 == oracle_dequantize(scale_bytes, elem_bytes) bit for bit (NaN where
    NaN, any payload)."""
    out = dname(got.dtype)
    want = O.oracle_dequantize(scale_bytes, elem_bytes, bs, dname(elem), out)
    g = got.detach().cpu()
    gbits = (g.view(torch.int16).numpy().view(np.uint16) if out == "bfloat16"
             else g.view(torch.int32).numpy().view(np.uint32))
    gnan = np.isnan(to_f32_numpy(g))
    wnan = np.isnan(want)
    assert g.shape == want.shape, f"{what}: shape {tuple(g.shape)}, expected {want.shape}"
    bad_nan = np.argwhere(gnan != wnan)
    assert not len(bad_nan), f"{what}: NaN mask differs at {bad_nan[:8].tolist()}"
    wbits = O.value_bits(np.where(wnan, 0.0, want), out)
    bad = np.argwhere((gbits != wbits) & ~wnan)
    if len(bad):
        lines = [f"{what}: {len(bad)} of {want.size} values differ"]
        for idx in bad[:8]:
            idx = tuple(int(i) for i in idx)
            sidx = (*idx[:-1], idx[-1] // bs)
            lines.append(
                f"  at {idx}: got 0x{int(gbits[idx]):x}, expected 0x{int(wbits[idx]):x} "
                f"(elem 0x{int(elem_bytes[idx]):02x}, scale 0x{int(scale_bytes[sidx]):02x})"
            )
        raise AssertionError("\n".join(lines))
