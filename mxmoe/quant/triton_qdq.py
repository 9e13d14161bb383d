"""The Triton kernel of the fused quantize-dequantize (`mxmoe.quant.qdq`, which documents the
layouts). Imported on first use of the "triton" qdq backend.

`qdq_rows_kernel`: every output in x's own row-major layout (dim0; dim1 with blocks of each
matrix's rows or of each group's rows; both from one read): the training ops' activations,
gradients and weights. `qdq_rows` launches it.

The quantize step is the cast backend's own (`triton_cast`'s block scale and `_to_elem`'s element
rounding: one definition for every Triton kernel). The kernel uses the hardware conversions and one
exact multiply on a GPU (`_qdq_elems`) and, under the interpreter, the construction of the
dequantized result from integer bits (`_deq_bits`), as the Triton dequantize kernel does for tiles
with tiny scales.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from mxmoe.formats import CastSpec
from mxmoe.quant.backends import cdiv, next_pow2
from mxmoe.quant.triton_cast import INTERPRETED, _abs_key, _block_scale, _load_bits, _spec_args, _to_elem


@triton.jit
def _deq_bits(qb, s, IS_E5M2: tl.constexpr, OUT_BF16: tl.constexpr):
    """Bits (int16 for bf16, int32 for fp32) of q * 2^(s - 127) rounded once to the output type:
    element bytes qb (uint8), scale bytes s (int32, broadcastable; 255 = NaN). Built from integer
    bits (exact also where the result is an fp32 subnormal, scale byte < 10 / 17), RNE to bf16."""
    if IS_E5M2:
        qf = qb.to(tl.float8e5, bitcast=True).to(tl.float32)
    else:
        qf = qb.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    Q = qf.to(tl.int32, bitcast=True)
    a = Q & 0x7FFFFFFF
    k = s - 127
    F = (a >> 23) + k  # biased exponent of the result
    norm = a + (k << 23)
    sub = ((a & 0x7FFFFF) | 0x800000) >> tl.minimum(tl.maximum(1 - F, 0), 31)
    ra = tl.where(F >= 1, norm, sub)
    ra = tl.where(F >= 255, 0x7F800000, ra)
    ra = tl.where(a == 0, 0, ra)
    if OUT_BF16:
        rh = ((ra + 0x7FFF + ((ra >> 16) & 1)) >> 16) | ((Q >> 16) & 0x8000)
        return tl.where(s == 255, 0x7FC0, rh).to(tl.int16)
    else:
        return tl.where(s == 255, 0x7FC00000, ra | (Q & -2147483648))


@triton.jit
def _qdq_elems(X, e, s, IS_E5M2: tl.constexpr, OUT_BF16: tl.constexpr, MBITS: tl.constexpr,
               MIN_EXP: tl.constexpr, MAXBITS: tl.constexpr, SOFT: tl.constexpr):
    """Output bits (int16 for bf16, int32 for fp32) of the MX-rounded X (int32 fp32 bits) in blocks
    of exponent e and scale byte s (int32; both broadcastable to X, from `_block_scale`).

    The element is the cast backend's: RNE(clamp(X * 2^-e)) on the element grid, by the hardware's
    cvt.rn.satfinite on a GPU (`_to_elem`). On a GPU it goes back to fp32 by the hardware
    conversion (exact) and is scaled by one fp32 multiply, exact because the product is
    representable (at most 4 significant bits on a grid of at least 2^-16, times 2^-127..2^127:
    a grid >= 2^-143, inside fp32's subnormal range, and no overflow for a finite block); then the
    hardware's round to nearest even into bf16 (cvt.rn without .ftz: subnormal results round like
    any other). A non-finite block (s = 255) multiplies by NaN: NaN whatever its elements (the
    hardware's NaN payload). Under the interpreter (SOFT): `_to_elem`'s software rounding and the
    integer construction of `_deq_bits` (NaN 0x7FC0 / 0x7FC00000)."""
    y = X.to(tl.float32, bitcast=True) * ((127 - e) << 23).to(tl.float32, bitcast=True)
    if SOFT:
        return _deq_bits(_to_elem(y, IS_E5M2, MBITS, MIN_EXP, MAXBITS, True), s, IS_E5M2, OUT_BF16)
    if IS_E5M2:
        v = y.to(tl.float8e5, fp_downcast_rounding="rtne").to(tl.float32)
    else:
        v = y.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.float32)
    # 2^(s - 127): the normal number s << 23, the subnormal 2^-127 for s = 0, NaN for s = 255
    scale = tl.where(s == 255, 0x7FC00000, tl.where(s == 0, 0x400000, s << 23)).to(tl.float32, bitcast=True)
    o = v * scale
    if OUT_BF16:
        return o.to(tl.bfloat16, fp_downcast_rounding="rtne").to(tl.int16, bitcast=True)
    else:
        return o.to(tl.int32, bitcast=True)


@triton.jit(do_not_specialize=["T", "R", "E"])  # masks and the row mapping: one variant for all
def qdq_rows_kernel(x_ptr, y0_ptr, y1_ptr, offs_ptr, T, R, C, E, BS: tl.constexpr, NSL: tl.constexpr,
                    W: tl.constexpr, RS: tl.constexpr, NB: tl.constexpr, N_ITER: tl.constexpr,
                    EP: tl.constexpr, I64: tl.constexpr, GROUPED: tl.constexpr, MATRICES: tl.constexpr,
                    IN_BF16: tl.constexpr,
                    OUT_BF16: tl.constexpr,
                    DIM0: tl.constexpr, DIM1: tl.constexpr, MODE: tl.constexpr, IS_E5M2: tl.constexpr,
                    EMAX: tl.constexpr, MBITS: tl.constexpr, MIN_EXP: tl.constexpr, MAXBITS: tl.constexpr,
                    RCEIL_C: tl.constexpr, T127: tl.constexpr, T126: tl.constexpr, SOFT: tl.constexpr):
    """x (T, C) -> y0 (T, C) qdq along C (DIM0) and y1 (T, C) qdq along the rows (DIM1), both in
    x's row-major layout, from one read of x.

    Program (p, q) owns one dim1 block of BS rows and the column tiles q*N_ITER .. (q+1)*N_ITER - 1
    (W*NB*BS columns each). Without GROUPED, block p is rows p*BS .. p*BS + BS - 1 (the last one
    short); with MATRICES, x is T / R matrices of R rows each, every one with ceil(R / BS) blocks
    starting at its first row (the last one short), and block p is block p % ceil(R / BS) of matrix
    p // ceil(R / BS) (the same blocks as without when R is a multiple of BS; a constexpr, so the
    2D variants keep their registers). With GROUPED, p counts blocks in
    the padded row space of `mxmoe.quant.groups`: group e (rows offs[e-1]:offs[e], offs (E,) int32
    read here, E <= EP) has ceil(n_e / BS) blocks starting at its first row, the last one short;
    blocks past the last group cover the rows after offs[-1], which belong to no group and get
    zeros in y0 and y1.

    A tile is held as (NB, RS, W, NSL, BS): element (b, i, w, m, k) is row m*RS + i of the block and
    column (w*NB + b)*BS + k of the tile. Triton's default layout for it puts the 16-byte vectors
    along k, then the lanes along k, b and i (NB*RS*BS/8 = 32 for bf16), the W warps along w, and
    the NSL slices in each thread's registers: the dim1 amax is a max over a thread's slices, then
    across the RS lanes; the dim0 amax one across the lanes of a 32-column block; no shared memory
    (the SASS for sm_90 has 16-byte LDG/STG only, and no local memory). I64: element offsets can
    reach 2^31 (then 64-bit row pointers, which cost registers)."""
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    if GROUPED:
        e = tl.arange(0, EP)
        emask = e < E
        ends = tl.load(offs_ptr + e, mask=emask, other=0)
        prev = tl.load(offs_ptr + e - 1, mask=emask & (e > 0), other=0)
        pend = tl.cumsum(tl.where(emask, (tl.maximum(ends - prev, 0) + BS - 1) // BS, 0), 0)
        before = emask & (pend <= pid_r)  # groups that end at or before this block
        in_group = tl.sum(before.to(tl.int32)) < E
        blk0 = tl.max(tl.where(before, pend, 0))  # first block of this block's group (or tail)
        t0 = tl.max(tl.where(before, ends, 0)) + (pid_r - blk0) * BS
        t_end = tl.minimum(tl.min(tl.where(emask & ~before, ends, T)), T)
    elif MATRICES:  # matrix m0: rows m0*R .. m0*R + R - 1
        in_group = True
        nbm = (R + BS - 1) // BS
        m0 = pid_r // nbm
        t0 = m0 * R + (pid_r - m0 * nbm) * BS
        t_end = m0 * R + R
    else:
        in_group = True
        t0 = pid_r * BS
        t_end = T
    BCT: tl.constexpr = W * NB * BS
    b = tl.arange(0, NB)[:, None, None, None, None]
    i = tl.arange(0, RS)[None, :, None, None, None]
    w = tl.arange(0, W)[None, None, :, None, None]
    m = tl.arange(0, NSL)[None, None, None, :, None]
    k = tl.arange(0, BS)[None, None, None, None, :]
    r = m * RS + i
    rmask = r < t_end - t0
    col = (w * NB + b) * BS + k
    if I64:  # offsets past 2^31 elements: a 64-bit row base (per thread: t0 comes from offs)
        base = t0.to(tl.int64) * C
        x_ptr += base
        y0_ptr += base
        y1_ptr += base
        row0 = 0
    else:  # 32-bit offsets from the tensors' starts: fewer registers than 64-bit row pointers
        row0 = t0
    for it in range(N_ITER):
        c0 = (pid_c * N_ITER + it) * BCT
        # the last column program may have fewer tiles, and with groups the grid's upper bound on
        # blocks leaves programs with no rows: skip them (a scalar branch, no fully masked work)
        if (c0 < C) & (t0 < t_end):
            cc = c0 + col
            mask = rmask & (cc < C)
            offs = (row0 + r) * C + cc
            # rows in no group read as zeros, whose qdq is +0 both ways
            X = _load_bits(x_ptr, offs, mask & in_group, IN_BF16)
            key = _abs_key(X)
            if DIM0:  # blocks along the columns: the BS elements of axis 4
                e0, _, s0 = _block_scale(tl.max(key, axis=4), MODE, EMAX, MBITS, RCEIL_C, T127, T126)
                y0 = _qdq_elems(X, tl.expand_dims(e0, 4), tl.expand_dims(s0.to(tl.int32), 4), IS_E5M2,
                                OUT_BF16, MBITS, MIN_EXP, MAXBITS, SOFT)
                tl.store(y0_ptr + offs, y0.to(y0_ptr.dtype.element_ty, bitcast=True), mask=mask)
            if DIM1:  # blocks along the rows: a thread's NSL slices (axis 3), then the RS lanes (axis 1)
                e1, _, s1 = _block_scale(tl.max(tl.max(key, axis=3), axis=1), MODE, EMAX, MBITS, RCEIL_C,
                                         T127, T126)
                e1 = tl.expand_dims(tl.expand_dims(e1, 1), 3)
                s1 = tl.expand_dims(tl.expand_dims(s1.to(tl.int32), 1), 3)
                y1 = _qdq_elems(X, e1, s1, IS_E5M2, OUT_BF16, MBITS, MIN_EXP, MAXBITS, SOFT)
                tl.store(y1_ptr + offs, y1.to(y1_ptr.dtype.element_ty, bitcast=True), mask=mask)


# ----------------------------------------------------------------------------------------------
# Launch
# ----------------------------------------------------------------------------------------------

# Rows-layout kernel: one dim1 block (bs rows) x _ROWS_WARPS * 64 columns per tile, 64 elements
# (bf16) per thread; each program does up to _ROWS_ITERS column tiles (amortizing the group
# lookup; one value: one compiled variant per format), e.g. 2056 x 7 programs for 65536 x 7168 in
# 8 groups, 512 x 4 for 16384 x 4096.
_ROWS_WARPS = 4
_ROWS_ITERS = 4


def _launcher(kernel, traced: bool):
    """`kernel`, or `wrap_triton(kernel)` while AOTAutograd decomposes the op for inductor, which
    then launches the kernel from its generated code."""
    if not traced:
        return kernel
    from torch.library import wrap_triton

    return wrap_triton(kernel)


def _rows_tile(bs: int, elem_size: int) -> dict:
    """(NSL, W, RS, NB) of the rows kernel: a warp's 32 lanes cover RS rows x NB blocks of bs
    columns with 16-byte vectors (8 bf16 / 4 fp32 elements per lane); NSL = bs / RS slices per
    thread."""
    vec = 16 // elem_size
    lanes_k = max(1, min(32, bs // vec))
    nb = max(1, min(32 // lanes_k, 64 // bs))  # a warp's lanes cover at least 64 columns
    rs = max(1, min(bs, 32 // (lanes_k * nb)))
    return dict(NSL=bs // rs, W=_ROWS_WARPS, RS=rs, NB=nb)


@functools.cache
def _rows_launch(spec: CastSpec, in_bf16: bool, out_bf16: bool, dim0: bool, dim1: bool, grouped: bool,
                 matrices: bool, soft: bool) -> tuple[dict, int]:
    """The rows kernel's compile-time arguments for one configuration (all but EP and I64, which
    depend on the shapes) and its columns per tile (built once: a launch then costs Triton's own
    argument handling only)."""
    bs = spec.block_size
    tile = _rows_tile(bs, 2 if in_bf16 else 4)
    consts = dict(BS=bs, N_ITER=_ROWS_ITERS, GROUPED=grouped, MATRICES=matrices, IN_BF16=in_bf16,
                  OUT_BF16=out_bf16, DIM0=dim0, DIM1=dim1, num_warps=_ROWS_WARPS, **tile,
                  **_spec_args(spec, soft))
    return consts, tile["W"] * tile["NB"] * bs


def qdq_rows(x: Tensor, spec: CastSpec, out_dtype: torch.dtype, dim0: bool, dim1: bool,
             offs: Tensor | None, outs, traced: bool = False) -> None:
    """The rows kernel on x (B, R, C) or (R, C) (= (1, R, C)) contiguous (B == 1 with offs): y0
    and/or y1 of x's shape in `outs`; dim1 blocks start at each matrix's first row (each group's
    with offs). traced: launched through `torch.library.wrap_triton` (the op's decomposition for
    inductor, `mxmoe.quant.qdq._register_functional_decomp`)."""
    B, R, C = x.shape if x.ndim == 3 else (1, *x.shape)
    T = B * R
    bs = spec.block_size
    if x.numel() == 0:
        return
    # else the 2D (T, C) view has the same blocks (a bool also for symbolic shapes: a cache key)
    matrices = bool(dim1 and B > 1 and R % bs != 0)
    in_bf16, out_bf16 = x.dtype == torch.bfloat16, out_dtype == torch.bfloat16
    consts, bct = _rows_launch(spec, in_bf16, out_bf16, dim0, dim1, offs is not None, matrices,
                               not x.is_cuda or INTERPRETED)
    E = 0 if offs is None else offs.shape[0]
    # blocks: without groups ceil(R / bs) per matrix; with groups sum of ceil(n_e / bs) <=
    # floor((offs[-1] + (bs-1) E) / bs), plus ceil(tail / bs) for the rows after the last group:
    # <= cdiv(T + (bs-1) E, bs) (the padded size of mxmoe.quant.groups). Plain int math: triton's
    # cdiv is a constexpr function, µs per host call.
    row_blocks = B * cdiv(R, bs) if offs is None else cdiv(T + (bs - 1) * E, bs)
    progs_c = cdiv(cdiv(C, bct), _ROWS_ITERS)
    if row_blocks > 2**31 - 1 or progs_c > 65535:
        raise ValueError(f"x of shape {tuple(x.shape)} is too large for the qdq kernel's grid")
    # the tensors themselves (no int views: an aten op each), the kernel bitcasts
    y0 = outs[0] if dim0 else x
    y1 = outs[-1] if dim1 else x
    _launcher(qdq_rows_kernel, traced)[(row_blocks, progs_c)](
        x, y0, y1,
        x if offs is None else offs, T, R, C, E,
        EP=max(128, next_pow2(int(E))) if E else 128,
        # above the largest offset a program forms (masked too): its block's first row is below
        # T, its last tile ends below bs rows and bct columns further; a bool also for symbolic
        # shapes (a SymBool is not a constexpr)
        I64=bool((T + bs) * C + bct >= 2**31),
        **consts,
    )
