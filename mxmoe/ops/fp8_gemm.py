"""The "fp8" GEMM backend: MXFP8 operands on Hopper's fp8 tensor cores.

Two kernels, one contract (below): on an sm_90 GPU every mode runs the Gluon kernel of
`mxmoe.ops.fp8_wgmma` (warp-specialized: a TMA loader warp, two consumer warpgroups; async wgmma,
one warpgroup's promotion overlapping the other's MMA);
under TRITON_INTERPRET=1 on CPU (Gluon has no interpreter) the Triton kernel of this module runs
them (one `tl.dot` per 32-block, promoted after it; the description below is of this one).

Every MX GEMM in mxmoe is "NT": both operands are stored with the reduction dim K innermost, as the
casts produce them (`MXTensor.qdata_blocked` / `.scale_blocked`):

    a_q (M, K) float8_e4m3fn, a_s (M, K/32) float8_e8m0fnu      rows of A, K innermost
    b_q (N, K) or (E, N, K) float8_e4m3fn, b_s (..., N, K/32)    columns of B, K innermost

The scales are first decoded to fp32 with the rows innermost ((K/32, M), (..., K/32, N); one small
torch pass). The kernel walks K in steps of BK and, for each 32-element block along K, issues one
fp8 MMA (`tl.dot` on float8e4nv operands: `wgmma` on sm_90) into a fresh fp32 temporary `part`,
then promotes it into the fp32 accumulator with that block's scales:

    acc += (part * sa[:, None]) * sb[None, :]      sa = 2^(a_s - 127) per row, sb per column

Numerics (what the tests check):
  - e8m0 byte 255 is NaN (every output its row or column touches is NaN); byte 0 is 2^-127, a
    subnormal fp32 factor (exact: sm_90 does not flush it, the GPU tests check).
  - `part` is a multiple of 2^-18 (every e4m3 product is), so `part * sa` is exact whenever it does
    not overflow; the single rounding is in `* sb` and the add (fused into one FMA). So each block's
    contribution is rounded once, as in an fp32 GEMM of the dequantized operands, provided
    |part| * sa < 2^128 — always so when the dequantized A elements stay below 2^128 / (32*448) (in
    practice: any scale from real data; the adversarial 2^127 scales of the tests are paired with
    small partners).
  - On sm_90 the fp8 MMA sums the 32 products of one block with a narrower adder than fp32 (about 13
    mantissa bits after alignment to the largest product; see docs): the GPU tests' bound per block
    is 2^-7 · Σ|a_k b_k| (a worst case of that model), against (k + 2)·2^-23 · Σ|a_k b_k| for fp32
    (the interpreter).
Output: bf16 or fp32 (rounded once from the fp32 accumulator).

Three orientations, one kernel (`MODE`):
  0 dense:        (M, K) x (N, K) -> (M, N)
  1 grouped rows: (T, K) x (E, N, K), offs (E,) int32 cumulative row ends -> (T, N); rows at or
                  after offs[-1] are zero (MoE forward / dgrad)
  2 grouped K:    (M, T) x (N, T), offs over T (multiples of 32) -> (E, M, N); empty groups give
                  zeros (MoE wgrad)
Nothing syncs with the host: the grouped modes read offs on the device. The Gluon kernel meets the
same bounds (each block's contribution rounded once, in the same block order: its result does not
depend on its tile config) and handles grouped rows without recomputation (its own docstring).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from mxmoe.ops import fp8_wgmma
from mxmoe.ops.fp8_wgmma import WgmmaConfig
from mxmoe.quant.backends import triton_interpret

BLOCK = 32
"""Elements per e8m0 scale along K (the MX block; one fp8 MMA k-step on sm_90)."""


@dataclass(frozen=True)
class Fp8GemmConfig:
    """Tile of one program of the interpreter's Triton kernel: BM rows x BN columns, K in steps of
    BK (a multiple of 32). The interpreter runs numpy on CPU: small tiles keep it fast; bk=64 still
    runs two 32-blocks per step."""

    bm: int = 32
    bn: int = 32
    bk: int = 64
    group_m: int = 2
    num_warps: int = 4

    def __post_init__(self) -> None:
        for name in ("bm", "bn", "bk"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"{name}={v} must be a power of two >= 16")
        if self.bk % BLOCK:
            raise ValueError(f"bk={self.bk} must be a multiple of {BLOCK}")


INTERPRET_CONFIG = Fp8GemmConfig()


def _scales(s: Tensor) -> tuple[Tensor, int, int, int]:
    """e8m0 scales s (..., rows, K/32) -> (fp32 (..., K/32, rows) contiguous, row stride, k-block
    stride, expert stride): rows innermost, so that the kernel reads each 32-block's scales as one
    contiguous vector, already decoded (exact: e8m0 -> fp32 gives 2^(b-127), the subnormal 2^-127
    for byte 0, NaN for 255). One small torch pass (K/32 values per row); decoding the bytes in the
    kernel instead ran at half the speed on the H200 (byte loads, more registers)."""
    f = s.float().transpose(-1, -2).contiguous()
    return f, 1, f.stride(-2), f.stride(0) if f.ndim == 3 else 0


def why_unavailable(device: torch.device) -> str | None:
    """None if the fp8 backend can run on tensors on `device`, else the reason."""
    if device.type == "cpu":
        if triton_interpret():
            return None
        return (
            "gemm_backend='fp8' needs an sm_90 (Hopper) CUDA GPU, or TRITON_INTERPRET=1 to run its "
            "Triton kernel on CPU tensors through the interpreter; got a cpu tensor (use 'emulated')"
        )
    if device.type != "cuda":
        return f"gemm_backend='fp8' needs a CUDA tensor on an sm_90 GPU, got a {device.type} tensor"
    cap = torch.cuda.get_device_capability(device)
    if cap != (9, 0):
        return (
            f"gemm_backend='fp8' runs on sm_90 (Hopper) only; device {device} is sm_{cap[0]}{cap[1]} "
            "(use gemm_backend='emulated')"
        )
    return None


# ----------------------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------------------


@triton.jit
def _store_out(c, acc, mask, OUT_BF16: tl.constexpr):
    """Store fp32 acc as the output dtype; bf16 rounded to nearest-even by hand (the interpreter's
    cast truncates)."""
    if OUT_BF16:
        bits = acc.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)  # NaN stays NaN, large finite rounds to inf
        tl.store(c, (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=mask)
    else:
        tl.store(c, acc, mask=mask)


@triton.jit
def _k_step(acc, a_ptr, sa_ptr, b_ptr, sb_ptr, rows_a, ok_a, cols_b, ok_b, k, k_hi,
            stride_am, stride_sam, stride_sak, stride_bn, stride_sbn, stride_sbk,
            BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr,
            NO_MASK: tl.constexpr):
    """acc += the MX product of K elements [k, k + BK) (masked to < k_hi), one MMA per 32-block.
    ok_a / ok_b: rows of A / columns of B inside the tensors; NO_MASK: all are, and K % BK == 0."""
    kr = tl.arange(0, 32)
    for kk in tl.static_range(BK // 32):
        kb = k + kk * 32
        ka = kb + kr
        a_p = a_ptr + rows_a[:, None] * stride_am + ka[None, :]
        b_p = b_ptr + cols_b[:, None] * stride_bn + ka[None, :]
        sa_p = sa_ptr + rows_a * stride_sam + (kb // 32) * stride_sak
        sb_p = sb_ptr + cols_b * stride_sbn + (kb // 32) * stride_sbk
        if NO_MASK:
            a = tl.load(a_p)
            b = tl.load(b_p)
            sa = tl.load(sa_p)
            sb = tl.load(sb_p)
        else:
            if EVEN_K:
                msa = ok_a
                msb = ok_b
            else:
                # k_lo, k_hi and K are multiples of 32: a whole 32-block is in or out
                msa = ok_a & (kb < k_hi)
                msb = ok_b & (kb < k_hi)
            ma = msa[:, None] & (kr < 32)[None, :]
            mb = msb[:, None] & (kr < 32)[None, :]
            a = tl.load(a_p, mask=ma, other=0.0)
            b = tl.load(b_p, mask=mb, other=0.0)
            # masked blocks read a finite scale (127.0): their part is 0, so
            # they add exactly nothing
            sa = tl.load(sa_p, mask=msa, other=127.0)
            sb = tl.load(sb_p, mask=msb, other=127.0)
        part = tl.dot(a, tl.trans(b))
        acc += (part * sa[:, None]) * sb[None, :]
    return acc


@triton.jit
def _mainloop(a_ptr, sa_ptr, b_ptr, sb_ptr, rows_a, ok_a, cols_b, ok_b, k_lo, k_hi,
              stride_am, stride_sam, stride_sak, stride_bn, stride_sbn, stride_sbk,
              BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr,
              NO_MASK: tl.constexpr, K_ITERS: tl.constexpr):
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    # triton 3.6's interpreter cannot loop to a runtime bound: a fixed count (cdiv(K, BK)), masked
    # past k_hi (EVEN_K and NO_MASK are False in the grouped-K mode, the one with k_lo > 0)
    for i in range(K_ITERS):
        acc = _k_step(acc, a_ptr, sa_ptr, b_ptr, sb_ptr, rows_a, ok_a, cols_b, ok_b,
                      k_lo + i * BK, k_hi, stride_am, stride_sam, stride_sak,
                      stride_bn, stride_sbn, stride_sbk, BM, BN, BK, EVEN_K, NO_MASK)
    return acc


@triton.jit
def _fp8_mx_gemm_kernel(
    a_ptr, sa_ptr, b_ptr, sb_ptr, c_ptr, offs_ptr,
    M, N, K, E,
    stride_am, stride_sam, stride_sak, stride_be, stride_bn, stride_sbe, stride_sbn, stride_sbk,
    stride_ce, stride_cm,
    MODE: tl.constexpr, E_POW2: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, NO_MASK: tl.constexpr, OUT_BF16: tl.constexpr, K_ITERS: tl.constexpr,
):
    # program -> tile, GROUP_M row tiles sweep the columns together (L2 reuse of B)
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    width = GROUP_M * num_n
    first_m = (pid // width) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    m0 = pid_m * BM
    rows = m0 + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    in_m = rows < M
    in_n = cols < N
    c = c_ptr + rows[:, None] * stride_cm + cols[None, :]
    if MODE == 0:
        acc = _mainloop(a_ptr, sa_ptr, b_ptr, sb_ptr, rows, in_m, cols, in_n, 0, K,
                        stride_am, stride_sam, stride_sak, stride_bn, stride_sbn, stride_sbk,
                        BM, BN, BK, EVEN_K, NO_MASK, K_ITERS)
        _store_out(c, acc, in_m[:, None] & in_n[None, :], OUT_BF16)
    elif MODE == 1:
        ge = tl.arange(0, E_POW2)
        ends = tl.load(offs_ptr + ge, mask=ge < E, other=2147483647)
        total = tl.load(offs_ptr + E - 1)
        last = tl.minimum(m0 + BM, M) - 1
        g = tl.sum((ends <= m0).to(tl.int32), axis=0)  # group of row m0 (E: past every group)
        g_end = tl.minimum(tl.sum((ends <= last).to(tl.int32), axis=0), E - 1) + 1
        # a tile may straddle group boundaries: one pass per group it touches, storing that group's
        # rows (the loads take any row < M: the other groups' rows are computed and not stored)
        while g < g_end:
            lo = tl.load(offs_ptr + g - 1, mask=g > 0, other=0)
            hi = tl.load(offs_ptr + g)
            ok_m = (rows >= lo) & (rows < hi) & in_m
            if hi > lo:
                acc = _mainloop(a_ptr, sa_ptr, b_ptr + g * stride_be, sb_ptr + g * stride_sbe,
                                rows, in_m, cols, in_n, 0, K,
                                stride_am, stride_sam, stride_sak, stride_bn, stride_sbn, stride_sbk,
                                BM, BN, BK, EVEN_K, NO_MASK, K_ITERS)
                _store_out(c, acc, ok_m[:, None] & in_n[None, :], OUT_BF16)
            g += 1
        if last >= total:  # rows in no group
            tail = (rows >= total) & in_m
            tl.store(c, tl.zeros((BM, BN), dtype=c_ptr.dtype.element_ty), mask=tail[:, None] & in_n[None, :])
    else:
        e = tl.program_id(1)
        # group ends are multiples of 32 (the op's contract): telling the compiler keeps the loads
        # 16-byte vectors (an unknown alignment makes them byte loads)
        k_lo = tl.multiple_of(tl.load(offs_ptr + e - 1, mask=e > 0, other=0), 32)
        k_hi = tl.multiple_of(tl.load(offs_ptr + e), 32)
        acc = _mainloop(a_ptr, sa_ptr, b_ptr, sb_ptr, rows, in_m, cols, in_n, k_lo, k_hi,
                        stride_am, stride_sam, stride_sak, stride_bn, stride_sbn, stride_sbk,
                        BM, BN, BK, EVEN_K, NO_MASK, K_ITERS)
        _store_out(c + e * stride_ce, acc, in_m[:, None] & in_n[None, :], OUT_BF16)


# ----------------------------------------------------------------------------------------------
# Launcher and op
# ----------------------------------------------------------------------------------------------

_OUT_DTYPES = (torch.bfloat16, torch.float32)


def _out_shape(a_q: Tensor, b_q: Tensor, offs: Tensor | None) -> tuple[int, ...]:
    if offs is not None and b_q.ndim == 2:
        return (offs.shape[0], a_q.shape[0], b_q.shape[0])
    return (a_q.shape[0], b_q.shape[-2])


def _check(a_q: Tensor, a_s: Tensor, b_q: Tensor, b_s: Tensor, offs: Tensor | None,
           out_dtype: torch.dtype) -> None:
    for name, q in (("a_q", a_q), ("b_q", b_q)):
        if q.dtype != torch.float8_e4m3fn:
            raise TypeError(f"{name} has dtype {q.dtype}; the fp8 GEMM takes torch.float8_e4m3fn")
        if q.stride(-1) != 1 or (q.ndim == 3 and q.stride(0) != q.shape[1] * q.stride(1)):
            raise ValueError(f"{name} must have K innermost and contiguous, got strides {q.stride()}")
    for name, s in (("a_s", a_s), ("b_s", b_s)):
        if s.dtype != torch.float8_e8m0fnu:
            raise TypeError(f"{name} has dtype {s.dtype}; expected torch.float8_e8m0fnu scales")
        if s.stride(-1) != 1:
            raise ValueError(f"{name} must have K/32 innermost, got strides {s.stride()}")
    if a_q.ndim != 2:
        raise ValueError(f"a_q must be 2D (M, K), got shape {tuple(a_q.shape)}")
    if b_q.ndim not in (2, 3):
        raise ValueError(f"b_q must be (N, K) or (E, N, K), got shape {tuple(b_q.shape)}")
    K = a_q.shape[1]
    if K % BLOCK or b_q.shape[-1] != K:
        raise ValueError(
            f"a_q {tuple(a_q.shape)} and b_q {tuple(b_q.shape)} need the same K, a multiple of {BLOCK}"
        )
    for name, q, s in (("a_s", a_q, a_s), ("b_s", b_q, b_s)):
        want = (*q.shape[:-1], K // BLOCK)
        if tuple(s.shape) != want:
            raise ValueError(f"{name} has shape {tuple(s.shape)}; expected {want} (one scale per 32 of K)")
    if b_q.ndim == 3 and offs is None:
        raise ValueError("b_q is 3D (E, N, K): the grouped GEMM needs offs")
    if offs is not None:
        if offs.dtype != torch.int32 or offs.ndim != 1 or offs.shape[0] < 1:
            raise ValueError(
                f"offs must be a non-empty 1D int32 tensor, got {offs.dtype} {tuple(offs.shape)}"
            )
        if b_q.ndim == 3 and offs.shape[0] != b_q.shape[0]:
            raise ValueError(f"offs has {offs.shape[0]} groups, b_q {tuple(b_q.shape)} has E={b_q.shape[0]}")
    devs = {t.device for t in (a_q, a_s, b_q, b_s) + ((offs,) if offs is not None else ())}
    if len(devs) != 1:
        raise ValueError(f"operands are on different devices: {sorted(map(str, devs))}")
    if out_dtype not in _OUT_DTYPES:
        raise TypeError(f"out_dtype={out_dtype}; expected torch.bfloat16 or torch.float32")


def launch(a_q: Tensor, a_s: Tensor, b_q: Tensor, b_s: Tensor, offs: Tensor | None,
           out_dtype: torch.dtype, config: Fp8GemmConfig | WgmmaConfig | None = None) -> Tensor:
    """Run the kernel (no custom-op wrapper: the benchmarks pass `config` to compare tiles).

    On a GPU the Gluon kernel (`mxmoe.ops.fp8_wgmma`, config a `WgmmaConfig`) runs every mode; in
    the interpreter the Triton kernel here (config an `Fp8GemmConfig`). Shapes and layouts as in the
    module docstring; returns a new contiguous tensor of `out_dtype`.
    """
    _check(a_q, a_s, b_q, b_s, offs, out_dtype)
    reason = why_unavailable(a_q.device)
    if reason is not None:
        raise RuntimeError(reason)
    interp = a_q.device.type == "cpu"
    if not interp:
        if config is not None and not isinstance(config, WgmmaConfig):
            raise TypeError(f"config={config!r}: on a GPU the fp8 GEMM takes a WgmmaConfig")
        out = torch.empty(_out_shape(a_q, b_q, offs), dtype=out_dtype, device=a_q.device)
        if out.numel() == 0:
            return out
        if a_q.shape[1] == 0:
            return out.zero_()
        return fp8_wgmma.launch(a_q, a_s, b_q, b_s, offs, out, config or fp8_wgmma.DEFAULT_CONFIG)
    if config is not None and not isinstance(config, Fp8GemmConfig):
        raise TypeError(f"config={config!r}: the interpreter's Triton kernel takes an Fp8GemmConfig")
    cfg = config or INTERPRET_CONFIG
    out = torch.empty(_out_shape(a_q, b_q, offs), dtype=out_dtype, device=a_q.device)
    M, K = a_q.shape
    N = b_q.shape[-2]
    if out.numel() == 0:
        return out
    if b_q.ndim == 3:
        mode, E = 1, b_q.shape[0]
    elif offs is not None:
        mode, E = 2, offs.shape[0]
    else:
        mode, E = 0, 1
    if K == 0:  # an empty reduction
        return out.zero_()
    offs_arg = offs if offs is not None else torch.zeros(1, dtype=torch.int32, device=a_q.device)
    grid = (triton.cdiv(M, cfg.bm) * triton.cdiv(N, cfg.bn), E if mode == 2 else 1)
    # whole tiles and whole K steps: loads without masks (grouped K: a fixed step count runs past
    # each group's end, masked)
    even_k = False if mode == 2 else K % cfg.bk == 0
    no_mask = even_k and M % cfg.bm == 0 and N % cfg.bn == 0
    sa, sa_m, sa_k, _ = _scales(a_s)
    sb, sb_n, sb_k, sb_e = _scales(b_s)
    _fp8_mx_gemm_kernel[grid](
        a_q, sa, b_q, sb, out, offs_arg,
        M, N, K, E,
        a_q.stride(0), sa_m, sa_k,
        b_q.stride(0) if b_q.ndim == 3 else 0, b_q.stride(-2),
        sb_e, sb_n, sb_k,
        out.stride(0) if mode == 2 else 0, out.stride(-2),
        MODE=mode, E_POW2=triton.next_power_of_2(E),
        BM=cfg.bm, BN=cfg.bn, BK=cfg.bk, GROUP_M=cfg.group_m,
        EVEN_K=even_k, NO_MASK=no_mask, OUT_BF16=out_dtype == torch.bfloat16,
        K_ITERS=triton.cdiv(K, cfg.bk), num_warps=cfg.num_warps,
    )
    return out


@torch.library.custom_op("mxmoe::fp8_mx_gemm", mutates_args=())
def fp8_mx_gemm(a_q: Tensor, a_s: Tensor, b_q: Tensor, b_s: Tensor, offs: Tensor | None,
                out_dtype: torch.dtype) -> Tensor:
    """MXFP8 GEMM on fp8 tensor cores (layouts and numerics: module docstring).

    a_q (M, K) float8_e4m3fn, a_s (M, K/32) float8_e8m0fnu, K innermost.
    b_q (N, K) or (E, N, K) float8_e4m3fn, b_s (..., N, K/32) float8_e8m0fnu, K innermost.
    offs None (dense -> (M, N)); (E,) int32 cumulative ends over the rows of a with 3D b_q
    (-> (M, N), rows after offs[-1] zero); over K with 2D b_q (-> (E, M, N), ends multiples of 32).
    Returns a contiguous `out_dtype` (bf16 or fp32) tensor.
    """
    return launch(a_q, a_s, b_q, b_s, offs, out_dtype)


@fp8_mx_gemm.register_fake
def _(a_q, a_s, b_q, b_s, offs, out_dtype):
    return a_q.new_empty(_out_shape(a_q, b_q, offs), dtype=out_dtype)
