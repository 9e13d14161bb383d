"""Dequantize MXFP8 e4m3 rows straight into a slice of a larger output (no temporary, no copy).

The all-to-all writes each received piece into its final rows of the output, so it needs a dequantize
with a destination: `dequantize_into(q, s, out)`. It computes exactly what
`mxmoe.quant.torch_cast.dequantize` defines (docs/mx-format.md): value = q x 2^(s-127), exact in
fp32, rounded once (to nearest even) to the output dtype; NaN where the element is NaN (0x7F/0xFF)
or the scale byte is 0xFF. NaNs are written as the canonical quiet NaN (payloads are not part of
the format).

The Triton kernel never relies on how the GPU treats fp32 subnormals: a program whose smallest
scale byte is >= 10 reads each element byte as the bits of an fp16 (the element x 2^-8 exactly,
e4m3 subnormals as fp16 subnormals; fp16 -> fp32 is exact) and multiplies in fp32 (every product
is then 0, inf or a normal number with at most 4 significant bits: exact, and already a bf16, so
there is nothing to round); otherwise it builds the fp32 bit pattern of the product with integers
(subnormal products included) and rounds to bf16 on the bits.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mxmoe.formats import DEFAULT_FORMAT
from mxmoe.quant import call_path
from mxmoe.quant.backends import cast_fn, resolve_kernel, triton_interpret

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is optional
    triton = None

BLOCK_SIZE = DEFAULT_FORMAT.block_size  # the fused kernels serve the default format
_BLOCK = 4096

if triton is not None:

    @triton.jit
    def _int_dequant_bits(byte, s):
        # Exact fp32 bit pattern (magnitude) of e4m3 `byte` (sign ignored) x 2^(s - 127), integers only.
        a = byte & 0x7F
        e_el = a >> 3
        sig = tl.where(e_el == 0, a & 7, (a & 7) | 8)
        t = tl.where(e_el == 0, 1, e_el) - 10 + s - 127
        p = (sig >= 2).to(tl.int32) + (sig >= 4).to(tl.int32) + (sig >= 8).to(tl.int32)
        biased = t + p + 127
        normal_bits = (biased << 23) | ((sig << (23 - p)) & 0x7FFFFF)
        sub_bits = sig << tl.minimum(tl.maximum(t + 149, 0), 31)
        bits = tl.where(biased >= 1, normal_bits, sub_bits)
        bits = tl.where(biased >= 255, 0x7F800000, bits)
        return tl.where(sig == 0, 0, bits)

    @triton.jit
    def _dequant_tile(q_ptr, s_ptr, out_ptr, offs, mask, BS: tl.constexpr, OUT_BF16: tl.constexpr,
                      CACHE: tl.constexpr):
        """Dequantize the elements at flat offsets `offs` (int64, masked by `mask`) of q (uint8) with
        scales s (uint8, one per BS elements) into out (int16 bf16 bits or int32 fp32 bits). CACHE:
        the loads' cache modifier (".cg": bytes another GPU wrote, past this SM's L1)."""
        b = tl.load(q_ptr + offs, mask=mask, other=0, cache_modifier=CACHE).to(tl.int32)
        s = tl.load(s_ptr + offs // BS, mask=mask, other=127, cache_modifier=CACHE).to(tl.int32)
        _dequant_store(b, s, tl.min(s, axis=0), out_ptr, offs, mask, OUT_BF16)

    @triton.jit
    def _dequant_store(b, s, smin, out_ptr, offs, mask, OUT_BF16: tl.constexpr):
        """Store at `offs` (masked by `mask`) of out (int16 bf16 bits or int32 fp32 bits) the values
        of e4m3 bytes b (int32) with e8m0 scales s (int32, broadcastable to b; 127 where masked);
        smin: the smallest of s, or any lower bound of it (picks the fast path)."""
        if smin >= 10:
            # The e4m3 bits shifted into an fp16 (sign to bit 15, exponent and mantissa to bits
            # 7..14) are the element x 2^-8 exactly, subnormals included (both formats' subnormals
            # have the same exponent offset from their normals); fp16 -> fp32 is exact, so is x 2^8.
            # The product with 2^(s - 127) is 0, a normal fp32 (>= 2^-9 x 2^-117) of at most 4
            # significant bits, or inf: exact in bf16 (its top 16 bits) and in fp32 alike.
            hb = (b + (b & 0x80)) << 7  # the sign's carry moves it from bit 14 to 15
            v = (hb.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * 256.0) * (
                (s << 23).to(tl.float32, bitcast=True))
            bits = v.to(tl.int32, bitcast=True)
            # NaN: element 0x7F/0xFF (exponent and mantissa bits all set), or scale 255. Tested on
            # the fp16 bits here (not on b before the branch: eight predicates live across it do
            # not fit the predicate registers, and the build packs them into a register bit by bit).
            nan = ((hb & 0x3F80) == 0x3F80) | (s == 255)
            if OUT_BF16:
                r = tl.where(nan, 0x7FC0, (bits >> 16) & 0xFFFF)
                tl.store(out_ptr + offs, r.to(tl.int16), mask=mask)
            else:
                tl.store(out_ptr + offs, tl.where(nan, 0x7FC00000, bits), mask=mask)
        else:
            # value = sig x 2^t with sig < 16: build the exact fp32 bits with integers.
            nan = ((b & 0x7F) == 0x7F) | (s == 255)
            neg = (b >> 7).to(tl.int32)
            bits = _int_dequant_bits(b & 0x7F, s)
            if OUT_BF16:
                r = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
                r = tl.where(nan, 0x7FC0, r | (neg << 15))
                tl.store(out_ptr + offs, r.to(tl.int16), mask=mask)
            else:
                r = tl.where(nan, 0x7FC00000, bits | (neg << 31))
                tl.store(out_ptr + offs, r, mask=mask)

    @triton.jit
    def _dequant_e4m3_kernel(
        q_ptr, s_ptr, out_ptr, n, BLOCK: tl.constexpr, BS: tl.constexpr, OUT_BF16: tl.constexpr
    ):
        pid = tl.program_id(0)
        offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        _dequant_tile(q_ptr, s_ptr, out_ptr, offs, offs < n, BS, OUT_BF16, "")

    @triton.jit
    def _qdq_tile(x_ptr, out_ptr, blk, bmask, rceil_c, T127, T126, IN_BF16: tl.constexpr,
                  FORCE_SLOW: tl.constexpr, SATFINITE: tl.constexpr = False):
        """Quantize the blocks of 32 `blk` (int64 indices, masked by `bmask`) of x (int16 bf16 bits or
        int32 fp32 bits; RCEIL, e4m3) and dequantize them again, in registers, into out (same type).
        SATFINITE: the fp8 conversion saturates to +-448 itself (compiled for sm_89+: Triton's
        `cvt.rn.satfinite`, as mxmoe.quant.triton_cast._to_elem relies on), so the fast path does not
        clamp first; the interpreter's conversion needs the clamp."""
        offs = blk[:, None] * 32 + tl.arange(0, 32)[None, :]
        mask = bmask[:, None]
        if IN_BF16:  # bf16 bits -> fp32 bits by a shift: exact for subnormals on every backend
            xb = tl.load(x_ptr + offs, mask=mask, other=0).to(tl.int32) << 16
        else:
            xb = tl.load(x_ptr + offs, mask=mask, other=0)
        x = xb.to(tl.float32, bitcast=True)
        m = xb & 0x7FFFFFFF
        neg = (xb >> 31) & 1
        amax = tl.max(m, axis=1)
        nonfinite = amax >= 0x7F800000
        d = (amax.to(tl.float32, bitcast=True) * rceil_c).to(tl.int32, bitcast=True)
        e = (d >> 23) - 127 + ((d & 0x7FFFFF) != 0).to(tl.int32)
        e = tl.where(amax <= T126, -126, e)
        e = tl.where(amax <= T127, -127, e)
        e = tl.minimum(tl.maximum(e, -127), 127)
        emin = tl.min(tl.where(nonfinite | (~bmask), 127, e), axis=0)
        if FORCE_SLOW:
            emin = emin - 1000
        if emin >= -115:
            # Every fp32 value that matters is normal here, so flush-to-zero cannot change a result.
            recip = ((127 - e) << 23).to(tl.float32, bitcast=True)
            if SATFINITE:
                y = x * recip[:, None]
            else:
                y = tl.minimum(tl.maximum(x * recip[:, None], -448.0), 448.0)
            q = y.to(tl.float8e4nv, fp_downcast_rounding="rtne")
            scale = ((e + 127) << 23).to(tl.float32, bitcast=True)
            v = q.to(tl.float32) * scale[:, None]
            # v is 0, a normal fp32 (>= 2^-9 x 2^-115) of at most 4 significant bits, or inf, with
            # x's sign: exact in bf16 (its top 16 bits; no rounding to do) and in fp32 alike.
            if IN_BF16:
                r = v.to(tl.int32, bitcast=True) >> 16
            else:
                r = v.to(tl.int32, bitcast=True)
        else:
            # x = sig x 2^E exactly; y = x x 2^-e rounded to e4m3 (nearest even) with integers.
            exp_f = m >> 23
            sig = tl.where(exp_f == 0, m, (m & 0x7FFFFF) | 0x800000)
            F = tl.where(exp_f == 0, -149, exp_f - 150) - e[:, None]
            lg_sub = (m.to(tl.float32).to(tl.int32, bitcast=True) >> 23) - 127
            lg = tl.where(exp_f == 0, lg_sub, 23)
            ey = lg + F
            qe = tl.maximum(ey, -6) - 3
            k = qe - F
            kc = tl.minimum(tl.maximum(k, 1), 30)
            q0 = sig >> kc
            rem = sig & ((1 << kc) - 1)
            half = 1 << (kc - 1)
            up = (rem > half) | ((rem == half) & ((q0 & 1) == 1))
            n = tl.where(k >= 1, q0 + up.to(tl.int32), sig << tl.minimum(tl.maximum(-k, 0), 31))
            byte = tl.where(ey >= -6, ((qe + 10) << 3) + n - 8, n)
            byte = tl.where(n == 0, 0, tl.minimum(byte, 0x7E))
            bits = _int_dequant_bits(byte, (e + 127)[:, None])
            if IN_BF16:
                r = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) | (neg << 15)
            else:
                r = bits | (neg << 31)
        nan = nonfinite[:, None]
        if IN_BF16:
            tl.store(out_ptr + offs, tl.where(nan, 0x7FC0, r).to(tl.int16), mask=mask)
        else:
            tl.store(out_ptr + offs, tl.where(nan, 0x7FC00000, r), mask=mask)

    @triton.jit
    def _qdq_kernel(
        x_ptr,
        out_ptr,
        n_blocks,
        rceil_c,
        T127,
        T126,
        NB: tl.constexpr,
        IN_BF16: tl.constexpr,
        FORCE_SLOW: tl.constexpr,
        SATFINITE: tl.constexpr,
    ):
        """Quantize blocks of 32 (RCEIL, e4m3) and dequantize them again, in registers."""
        pid = tl.program_id(0)
        blk = pid.to(tl.int64) * NB + tl.arange(0, NB)
        _qdq_tile(x_ptr, out_ptr, blk, blk < n_blocks, rceil_c, T127, T126, IN_BF16, FORCE_SLOW, SATFINITE)


def triton_usable(device: torch.device) -> bool:
    """True when the Triton dequantize can run on tensors of `device` here."""
    if triton is None:
        return False
    return device.type == "cuda" or (device.type == "cpu" and triton_interpret())


def dequantize_into(q: Tensor, s: Tensor, out: Tensor, kernel: str = "auto", impl: str = "auto") -> Tensor:
    """Dequantize MXFP8 rows into `out` (written in place; returned).

    q: (R, C) float8_e4m3fn (or its uint8 view), contiguous. s: (R, C // 32) e8m0 (or
    uint8), contiguous. out: (R, C) bfloat16 or float32, contiguous (e.g. a row slice of a larger
    contiguous tensor). impl: "cuda" (the CUDA extension's dequantize, writing into `out`), "triton"
    (the kernel above), "copy" (the cast backend `kernel`, writing into `out`) or
    "auto" (cuda, else triton, on CUDA; copy elsewhere). All give the same bits.
    """
    if impl not in ("auto", "cuda", "triton", "copy"):
        raise ValueError(f"impl={impl!r} is not one of 'auto', 'cuda', 'triton', 'copy'")
    if q.dtype not in (torch.float8_e4m3fn, torch.uint8):
        raise TypeError(f"q has dtype {q.dtype}; expected torch.float8_e4m3fn (or its uint8 view)")
    if s.dtype not in (DEFAULT_FORMAT.scale_dtype, torch.uint8):
        raise TypeError(f"s has dtype {s.dtype}; expected {DEFAULT_FORMAT.scale_dtype} (or its uint8 view)")
    if q.ndim != 2 or q.shape != out.shape or s.shape != (q.shape[0], q.shape[1] // BLOCK_SIZE):
        raise ValueError(
            f"dequantize_into: q {tuple(q.shape)}, s {tuple(s.shape)} and out {tuple(out.shape)} do not "
            "match (expected q and out (R, C), s (R, C // 32))"
        )
    if out.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"out has dtype {out.dtype}; expected torch.bfloat16 or torch.float32")
    if not (q.is_contiguous() and s.is_contiguous() and out.is_contiguous()):
        raise ValueError("dequantize_into needs contiguous q, s and out")
    if not (q.device == s.device == out.device):
        raise ValueError(
            f"dequantize_into: q, s and out must be on one device, got {q.device}, {s.device}, {out.device}"
        )
    if q.numel() == 0:
        return out
    if impl == "auto":
        if out.is_cuda and resolve_kernel("auto", out.device, "dequant") == "cuda":
            impl = "cuda"
        else:
            impl = "triton" if out.is_cuda and triton_usable(out.device) else "copy"
    if impl == "cuda":
        from mxmoe.quant import cuda_cast

        resolve_kernel("cuda", out.device)  # a clear error where it cannot run
        cuda_cast.dequantize(q.view(torch.float8_e4m3fn), s.view(torch.uint8), BLOCK_SIZE, out.dtype, out=out)
        return out
    if impl == "copy":
        deq = cast_fn(resolve_kernel(kernel, out.device, "dequant"), "dequant")
        f = DEFAULT_FORMAT
        return deq(q.view(f.elem_dtype), s.view(f.scale_dtype), f.block_size, out.dtype, out=out)
    if not triton_usable(out.device):
        raise RuntimeError("impl='triton' needs triton and a CUDA tensor (or TRITON_INTERPRET=1 on CPU)")
    bf16 = out.dtype == torch.bfloat16
    out_bits = out.view(torch.int16 if bf16 else torch.int32)
    n = q.numel()
    grid = (triton.cdiv(n, _BLOCK),)
    _dequant_e4m3_kernel[grid](
        q.view(torch.uint8),
        s.view(torch.uint8),
        out_bits,
        n,
        BLOCK=_BLOCK,
        BS=BLOCK_SIZE,
        OUT_BF16=bf16,
        num_warps=8,
    )
    return out


# Blocks of 32 per program and warps of the fused quantize+dequantize kernel (the H200 sweep's best).
_QDQ_BLOCKS, _QDQ_WARPS = 64, 4


def qdq_into(
    x: Tensor, out: Tensor, kernel: str = "auto", impl: str = "auto", force_slow: bool = False
) -> Tensor:
    """out = dequantize(quantize(x)) (MXFP8 e4m3, RCEIL, blocks of 32 along the last dim), in one pass.

    x: (R, C) bfloat16/float32 contiguous, C % 32 == 0. out: (R, C) of x.dtype, contiguous (e.g. a row
    slice of a larger tensor); written in place and returned. Bit for bit what `quantize_dim0` followed
    by `dequantize` gives (NaN blocks as canonical NaN). impl: "triton" (one fused kernel: reads x once,
    writes out once), "copy" (the cast backend `kernel`, then `dequantize_into`) or "auto" (triton on
    CUDA when available). force_slow: use the kernel's all-integer path everywhere (for tests).
    """
    if impl not in ("auto", "triton", "copy"):
        raise ValueError(f"impl={impl!r} is not one of 'auto', 'triton', 'copy'")
    if x.shape != out.shape or x.ndim != 2 or x.shape[1] % BLOCK_SIZE:
        raise ValueError(
            f"qdq_into: x {tuple(x.shape)} and out {tuple(out.shape)} must be equal 2D shapes (R, C) with "
            f"C % {BLOCK_SIZE} == 0"
        )
    if x.dtype not in (torch.bfloat16, torch.float32) or out.dtype != x.dtype:
        raise TypeError(f"x has dtype {x.dtype} and out {out.dtype}; expected both bfloat16 or both float32")
    if not (x.is_contiguous() and out.is_contiguous()):
        raise ValueError("qdq_into needs contiguous x and out")
    if x.device != out.device:
        raise ValueError(f"qdq_into: x and out must be on one device, got {x.device} and {out.device}")
    if x.numel() == 0:
        return out
    if impl == "auto":
        impl = "triton" if out.is_cuda and triton_usable(out.device) else "copy"
    if impl == "copy":
        kernel = resolve_kernel(kernel, x.device)
        q, s = call_path.quantize_dim0(x, _rceil_spec(), kernel)
        return dequantize_into(q, s, out, kernel)
    if not triton_usable(out.device):
        raise RuntimeError("impl='triton' needs triton and a CUDA tensor (or TRITON_INTERPRET=1 on CPU)")
    spec = _rceil_spec()
    bf16 = out.dtype == torch.bfloat16
    n_blocks = x.numel() // BLOCK_SIZE
    bits = torch.int16 if bf16 else torch.int32
    _qdq_kernel[(triton.cdiv(n_blocks, _QDQ_BLOCKS),)](
        x.view(bits),
        out.view(bits),
        n_blocks,
        spec.rceil_c,
        spec.rceil_t127,
        spec.rceil_t126,
        NB=_QDQ_BLOCKS,
        IN_BF16=bf16,
        FORCE_SLOW=force_slow,
        SATFINITE=out.is_cuda,
        num_warps=_QDQ_WARPS,
    )
    return out


def _rceil_spec():
    return DEFAULT_FORMAT.spec
