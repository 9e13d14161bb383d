"""The `torch` cast backend: plain PyTorch, eager or under torch.compile, CPU or GPU.

This is the executable form of docs/mx-format.md; the Triton and CUDA backends must agree with it
bit for bit. All functions take contiguous inputs and quantize along the *last* dim in blocks of
`spec.block_size`; scales come back as `SCALE_DTYPE` (E8M0).

Scale exponents are derived from integer views of fp32 bit patterns so the result does not depend
on how a device treats fp32 subnormals (flush-to-zero): see the RCEIL thresholds in formats.py.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mxmoe.formats import E8M0_BIAS, E8M0_NAN, SCALE_DTYPE, CastSpec, ScalingMode
from mxmoe.quant.checks import dim0_outputs
from mxmoe.quant.groups import group_padding, in_groups, pad_groups

# The backend's declarations (`mxmoe.quant.backends.CAST_BACKENDS`)


def why_unavailable(device: torch.device, cast: str) -> str | None:
    """None: the torch casts run on every device, every cast."""
    return None


def auto_rank(device: torch.device, cast: str) -> int:
    """"auto"'s last choice: the kernels are faster where they run (CUDA), and the only one
    elsewhere."""
    return 2

_ABS_MASK = 0x7FFFFFFF
_F32_INF_BITS = 0x7F800000
_MANT_MASK = 0x7FFFFF


def scale_exponent(amax_bits: torch.Tensor, spec: CastSpec) -> torch.Tensor:
    """Unbiased block exponent e (int32, clamped to [-127, 127]) from the fp32 bit pattern of each
    finite block amax (int32, >= 0)."""
    emax = spec.elem.emax
    mode = spec.mode
    if mode is ScalingMode.FLOOR:
        e = (amax_bits >> 23) - 127 - emax
    elif mode is ScalingMode.CEIL:
        e = (amax_bits >> 23) - 127 + ((amax_bits & _MANT_MASK) != 0).to(torch.int32) - emax
    elif mode is ScalingMode.EVEN:
        e = ((amax_bits + (1 << (22 - spec.elem.mbits))) >> 23) - 127 - emax
    elif mode is ScalingMode.RCEIL:
        d = (amax_bits.view(torch.float32) * spec.rceil_c).view(torch.int32)
        e = (d >> 23) - 127 + ((d & _MANT_MASK) != 0).to(torch.int32)
        e = torch.where(amax_bits <= spec.rceil_t126, -126, e)
        e = torch.where(amax_bits <= spec.rceil_t127, -127, e)
    else:  # pragma: no cover - ScalingMode is closed
        raise ValueError(f"unknown scaling mode {mode}")
    return e.clamp(-127, 127)


def quantize_dim0(x: torch.Tensor, spec: CastSpec, *, out=None) -> tuple[torch.Tensor, torch.Tensor]:
    """x: (..., C) bf16/fp32 contiguous -> qdata x's shape elem dtype, scale (..., C // bs) e8m0.
    out (x 2D): optional preallocated (q, s) to write into (checked by checks.check_dim0_out)."""
    if out is not None:
        qo, so = dim0_outputs(x, spec, out)
        q, s = quantize_dim0(x, spec)
        return qo.copy_(q), so.view(torch.uint8).copy_(s.view(torch.uint8)).view(SCALE_DTYPE)
    *lead, C = x.shape
    bs = spec.block_size
    xf = x.float().reshape(*lead, C // bs, bs)
    amax_bits = (xf.view(torch.int32) & _ABS_MASK).amax(dim=-1)
    nonfinite = amax_bits >= _F32_INF_BITS
    e = scale_exponent(amax_bits, spec)
    # 2^-e as fp32 built from its bits; e <= 120 for any finite fp32 input, so it is normal.
    recip = ((127 - e) << 23).view(torch.float32)
    y = (xf * recip.unsqueeze(-1)).clamp(-spec.elem.max_normal, spec.elem.max_normal)
    y = torch.where(nonfinite.unsqueeze(-1), float("nan"), y)
    q = y.to(spec.elem.dtype).reshape(x.shape)
    s = torch.where(nonfinite, E8M0_NAN, e + E8M0_BIAS).to(torch.uint8)
    return q, s.view(SCALE_DTYPE)


def quantize_dim1(x: torch.Tensor, spec: CastSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """x: (..., R, C) contiguous, ndim >= 2, blocks along R -> qdata (..., C, R), scale
    (..., C, R // bs): every matrix x[..., :, :] cast along its rows, stored transposed."""
    return quantize_dim0(x.transpose(-2, -1).contiguous(), spec)


def quantize_dim0_dim1(x: torch.Tensor, spec: CastSpec):
    """x: (R, C) -> (q0 (R, C), s0 (R, C//bs), q1 (C, R), s1 (C, R//bs))."""
    return (*quantize_dim0(x, spec), *quantize_dim1(x, spec))


def scale_to_f32(s: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes (uint8 view) -> fp32 2^(s-127), built from bits: byte 0 is the subnormal 2^-127,
    0xFF is NaN."""
    si = s.to(torch.int32)
    bits = torch.where(si == 0, 0x00400000, si << 23)
    bits = torch.where(si == E8M0_NAN, 0x7FC00000, bits)
    return bits.view(torch.float32)


def dequantize(
    q: torch.Tensor, s: torch.Tensor, block_size: int, out_dtype: torch.dtype, *, out: Tensor | None = None
) -> torch.Tensor:
    """q: (R, C) elem dtype, s: (R, C // bs) e8m0 (or uint8) -> (R, C) out_dtype, contiguous.
    out: optional contiguous (R, C) out_dtype tensor to write into (e.g. rows of a larger output).

    Value = q * 2^(s - 127): exact in fp32 (q has <= 4 significant bits), then one rounding to
    out_dtype."""
    R, C = q.shape
    scale = scale_to_f32(s.view(torch.uint8))
    y = (q.float().reshape(R, C // block_size, block_size) * scale.unsqueeze(-1)).reshape(R, C)
    return y.to(out_dtype) if out is None else out.copy_(y)


def qdq_rows(
    x: Tensor, spec: CastSpec, out_dtype: torch.dtype, dim0: bool, dim1: bool, offs: Tensor | None
) -> list[Tensor]:
    """The reference of the fused quantize-dequantize (`mxmoe.quant.qdq`, which documents the layouts):
    x (B, R, C) contiguous -> the outputs listed in `qdq_op`, via this module's quantize + dequantize
    of the padded form."""
    B, R, C = x.shape
    bs = spec.block_size
    outs: list[Tensor] = []
    if dim0:
        q, s = quantize_dim0(x.reshape(B * R, C), spec)
        y0 = dequantize(q, s, bs, out_dtype).view(B, R, C)
        if offs is not None:  # rows in no group are zero
            zero = torch.zeros((), dtype=out_dtype, device=x.device)
            y0 = torch.where(in_groups(offs, R), y0[0], zero).unsqueeze(0)
        outs.append(y0)
    if dim1:  # pad (each group, or each matrix's end) to whole blocks, cast, take the real rows
        if offs is None:
            pos, xp = None, torch.nn.functional.pad(x, (0, 0, 0, -R % bs))
        else:
            pos, _, cap = group_padding(offs, R, bs)
            xp = pad_groups(x[0], offs, pos, cap).unsqueeze(0)
        Rp = xp.shape[1]
        q, s = quantize_dim0(xp.transpose(1, 2).reshape(B * C, Rp), spec)
        y1 = dequantize(q, s, bs, out_dtype).view(B, C, Rp).transpose(1, 2)
        outs.append(y1[:, :R] if pos is None else y1[0].index_select(0, pos).unsqueeze(0))
    return outs
