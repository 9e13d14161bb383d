"""The fp8 backend's sm_90 kernel (Gluon): `_fp8_ws_kernel`, warp-specialized (a one-warp TMA
loader, two consumer warpgroups).

Same operands, layouts and numerics contract as `mxmoe.ops.fp8_gemm` (its docstring), but each
32-K block is multiplied by an async wgmma into a fresh fp32 temporary and promoted by the CUDA
cores (the DeepGEMM technique):

    for each 32-block k:  t_k = A_k B_k^T                        (wgmma, use_acc=False)
                          acc += (t_k * sa_k[:, None]) * sb_k[None, :]   (2 FP32 ops: FMUL, FFMA)

Triton's `tl.dot` cannot express this (it accumulates in the MMA itself). While one consumer
warpgroup promotes block k, the other's wgmma runs, and ptxas issues a warpgroup's block k+1
wgmma before block k's promotion; no wgmma stays in flight across a loop's back edge (ptxas
would then serialize every wgmma of the kernel, warning C7514).

Operands arrive by TMA into a multi-stage shared-memory ring (`ready` mbarriers, one per stage):
    A (BM, BK) and B (BN, BK) fp8, K innermost, as boxes of min(BK, 128) K-bytes (128-byte swizzle),
    fp32 scale tiles (BK/32, BM) of the decoded A scales and (BK/32, BN) of B's (rows innermost).

Tensors (device, 16-byte aligned; built by `launch`):
    a_q (M, K) float8_e4m3fn, K innermost (row stride a multiple of 16);
    b_q (E*N, K) float8_e4m3fn (E = 1 dense), K innermost
    sa (KBp, Mp) float32, sb (E*KBp, Np) float32: decoded scales (2^(b-127); byte 0 the subnormal
        2^-127, 255 NaN), rows innermost; KBp = K/32 rounded up to BK/32, Mp/Np = M/N rounded up to a
        multiple of 4 (TMA's 16-byte row strides); the padding is zero
    out (M, N) bf16 or fp32, row-major, rounded once from the fp32 accumulator
    offs (E,) int32 cumulative row ends (grouped rows), rows at or after offs[-1] are zero.
Grouped rows: tiles never straddle groups in what they store. Row tile t maps on the device (a loop
over offs) to group g and rows [lo4_g + i*BM, +BM) with lo4_g = lo_g rounded down to a multiple of 4,
storing only rows in [lo_g, offs[g]): each group's rows are cut into its own tiles, then the rows
after offs[-1] into zero tiles. The rounding is TMA's: the A-scale tile's coordinate along its
innermost dimension (rows, fp32) must be a multiple of 16 bytes, else the copy traps (an illegal
instruction); the up to 3 rows of the previous group a tile starts with, and the rows past the
group's end, are computed and not stored. The grid has cdiv(M + 3E, BM) + E + 1 row tiles, an upper
bound; spare ones exit.

Partitions: the loader (one warp, 24 registers) issues the TMA copies of each stage into a free ring
slot (`empty` mbarrier, one arrival per consumer warpgroup) and signals `ready`; two consumer
partitions of one warpgroup each (240 registers: accumulator and temporary, BN/2 fp32 each per
thread, and a block's BN/4 B scales) own 64 rows of the 128-row tile: per 32-block a wgmma into a
fresh temporary, a wait, the promotion; no CTA-wide barrier. Every partition walks the same tiles
(pid, pid + grid, ...), so the ring's slot and phase (step it: slot it % STAGES, parity
(it // STAGES) & 1) agree without communication.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass

import torch
import triton
from torch import Tensor
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

BLOCK = 32
WS_MAXNREG = 168
"""Registers per thread the kernel launches with: its 12 warps (two consumer
warpgroups, the loader's warp padded to a warpgroup) x 168 fill the 64K register file; the
partitions then move them (setmaxnreg): 240 per consumer thread, 24 per loader thread (with 232
and 40, ptxas spilled 44 bytes in the consumers' main loop)."""


@dataclass(frozen=True)
class WgmmaConfig:
    """One CTA: BM x BN outputs, BK of K per pipeline stage (BK/32 MMAs per warpgroup), `stages`
    stages in shared memory. BM is 128: two consumer warpgroups of 64 rows (one m64 wgmma each);
    BN <= 128 keeps a consumer's accumulator and temporary in its 240 registers. The warps are fixed
    by the kernel (two consumer warpgroups and the loader's warp)."""

    bm: int = 128
    bn: int = 128
    bk: int = 128
    stages: int = 4
    group_m: int = 8
    """Row tiles that sweep the columns together (L2 reuse of B)."""
    persistent: bool = True
    """One CTA per resident slot (SMs x CTAs per SM), each walking tiles pid, pid + grid, ...;
    False: one CTA per tile. Grouped K always runs one CTA per tile and group."""

    def __post_init__(self) -> None:
        for name in ("bm", "bn", "bk"):
            v = getattr(self, name)
            if v < 32 or v & (v - 1):
                raise ValueError(f"{name}={v} must be a power of two >= 32")
        if self.bk > 256:
            raise ValueError(f"bk={self.bk} must be 32, 64, 128 or 256")
        if self.bm != 128 or self.bn > 128:
            raise ValueError(f"bm={self.bm}, bn={self.bn}: the kernel needs bm=128 (two consumer "
                             f"warpgroups of 64 rows) and bn <= 128 (their registers)")
        if self.stages < 2:
            raise ValueError(f"stages={self.stages} must be >= 2")


DEFAULT_CONFIG = WgmmaConfig()
"""128x128x128, 4 stages, persistent: the fastest of scripts/fp8_wgmma_sweep.py's configs on an
H200 (docs/training-ops.md)."""


@gluon.jit
def _promote(acc, part, sa, sb):
    """acc += (part * sa) * sb: part * sa is exact (a multiple of 2^-18 times a power of two), the
    multiply by sb and the add round once (contracted to one FMA)."""
    return acc + (part * sa[:, None]) * sb[None, :]


@gluon.jit
def _scale_row(smem, slot, j, NB: gl.constexpr, W: gl.constexpr):
    """Row j (one 32-block's W scales) of the (NB, W) fp32 scale tile in ring slot `slot` (stored
    unswizzled, so a plain row-major view of it is exact)."""
    plain: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    return smem.index(slot)._reinterpret(gl.float32, [NB * W], plain).slice(j * W, W)


@gluon.constexpr_function
def _sb_bases(W: int) -> list[list[int]]:
    """`_sb_perm_layout`'s bases: the column of each offset bit (offset = XOR of the set bits')."""
    # column c = c0 + 2 c1 + 8 c2; offset bits: c0, c2 bit 0, c2 bit 1, c1 (2 bits), c2's others
    return [[1], [8], [16], [2], [4]] + [[32 << i] for i in range((W // 8).bit_length() - 3)]


@gluon.constexpr_function
def _sb_perm_layout(W):
    """Shared layout of one 32-block's W (>= 32) B scales as `_decoded_scales` stores them: column
    c = c0 + 2 c1 + 8 c2 (c0 < 2, c1 < 4; a thread of the wgmma accumulator layout holds the W/4
    columns of c1 = lane % 4) at offset c0 + 2 (c2 % 4) + 8 c1 + 32 (c2 // 4): a thread's columns
    in 16-byte chunks (c0, c2 % 2) at its base 8 c1 plus constants (one address register), and one
    16-byte load of the 4 groups c1 in 4 different bank quadruples (no bank conflict; the plain
    order, each group's W/4 columns contiguous, put the 4 groups of a load into the same 4 banks
    for W = 128: 4-way conflicts). Bases: the column of each offset bit."""
    return gl.SharedLinearLayout(_sb_bases(W))


def _sb_columns(W: int) -> list[int]:
    """The column at each offset of `_sb_perm_layout(W)`."""
    bases = [b for (b,) in _sb_bases(W)]
    return [functools.reduce(operator.xor, (b for i, b in enumerate(bases) if o >> i & 1), 0)
            for o in range(W)]


@gluon.jit
def _sb_row(smem, slot, j, NB: gl.constexpr, W: gl.constexpr):
    """Row j (one 32-block's W column scales, permuted: `_sb_perm_layout`) of the B-scale tile in
    ring slot `slot`."""
    return _scale_row(smem, slot, j, NB, W)._reinterpret(gl.float32, [W], _sb_perm_layout(W))


@gluon.jit
def _issue_loads(a_desc, b_desc, sa_desc, sb_desc, a_smem, b_smem, sa_smem, sb_smem, ready,
                 slot, kstep, m0, n0, b_row, sb_row, k0, pred, BK: gl.constexpr):
    """Stage `kstep` (K elements k0 + [kstep*BK, +BK)) into ring slot `slot`: A and B as BK/BOX boxes
    of BOX = min(BK, 128) K-bytes (the 128-byte swizzle's width), the two scale tiles as one box
    each; all on the slot's mbarrier."""
    NB: gl.constexpr = BK // 32
    BOX: gl.constexpr = a_desc.block_type.shape[1]
    SUBS: gl.constexpr = BK // BOX
    bar = ready.index(slot)
    nbytes: gl.constexpr = (SUBS * (a_desc.block_type.nbytes + b_desc.block_type.nbytes)
                            + sa_desc.block_type.nbytes + sb_desc.block_type.nbytes)
    mbarrier.expect(bar, nbytes, pred=pred)
    for h in gl.static_range(SUBS):
        k = k0 + kstep * BK + h * BOX
        tma.async_copy_global_to_shared(a_desc, [m0, k], bar, a_smem.index(slot * SUBS + h), pred=pred)
        tma.async_copy_global_to_shared(b_desc, [b_row, k], bar, b_smem.index(slot * SUBS + h), pred=pred)
    kb = k0 // 32 + kstep * NB
    tma.async_copy_global_to_shared(sa_desc, [kb, m0], bar, sa_smem.index(slot), pred=pred)
    tma.async_copy_global_to_shared(sb_desc, [sb_row + kb, n0], bar,
                                    sb_smem.index(slot), pred=pred)


@gluon.jit
def _mma_rows(a_smem, b_smem, slot, j, r0: gl.constexpr, zero, BK: gl.constexpr):
    """Issue (async) the MMA of 32-block j of the stage in ring slot `slot`, rows [r0, r0 +
    zero.shape[0]) of the A tile only (one warpgroup's), into a fresh temporary."""
    BOX: gl.constexpr = a_smem.shape[2]
    SUBS: gl.constexpr = BK // BOX
    h: gl.constexpr = j // (BOX // 32)
    kk: gl.constexpr = (j % (BOX // 32)) * 32
    a = a_smem.index(slot * SUBS + h).slice(r0, zero.shape[0], dim=0).slice(kk, 32, dim=1)
    b = b_smem.index(slot * SUBS + h).slice(kk, 32, dim=1).permute((1, 0))
    return warpgroup_mma(a, b, zero, use_acc=False, is_async=True)


@gluon.jit
def _store_tile(c_ptr, acc, m0, n0, row_lo, row_hi, N, stride_cm, BM: gl.constexpr, BN: gl.constexpr,
                MMA: gl.constexpr):
    """Store the tile's rows in [row_lo, row_hi) and columns below N (rounded once to c's dtype)."""
    rows = m0 + gl.arange(0, BM, layout=gl.SliceLayout(1, MMA))
    cols = n0 + gl.arange(0, BN, layout=gl.SliceLayout(0, MMA))
    mask = ((rows >= row_lo) & (rows < row_hi))[:, None] & (cols < N)[None, :]
    ptrs = c_ptr + rows.to(gl.int64)[:, None] * stride_cm + cols[None, :]
    gl.store(ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)


@gluon.jit
def _tile(tile, offs_ptr, M, N, E, KB_PAD, num_m, num_n, GROUPED: gl.constexpr, BM: gl.constexpr,
          BN: gl.constexpr, GROUP_M: gl.constexpr):
    """Tile index -> (kind, first row, first column, first row of B, first row of B's scales, first
    and end row to store): kind 1 computes rows [first row, +BM) and stores those in [row_lo,
    row_hi), 2 zeroes rows [first row, M) (grouped rows after offs[-1]), 0 nothing (a spare tile of
    the grouped grid). GROUP_M row tiles sweep the columns together (L2 reuse of B)."""
    width = GROUP_M * num_n
    first_m = (tile // width) * GROUP_M
    size_m = gl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (tile % width) % size_m
    n0 = ((tile % width) // size_m) * BN
    if GROUPED:
        # row tile pid_m -> group g: each non-empty group's rows [lo, hi) are cut into its own
        # cdiv(hi - lo4, BM) tiles from lo4 = lo rounded down to 4 rows (TMA: the A-scale tile's
        # innermost coordinate, rows of fp32, must be 16-byte aligned), then the rows after offs[-1]
        # into zero tiles; the grid's cdiv(M + 3E, BM) + E + 1 row tiles bound both together (the
        # rest do nothing)
        first = 0
        g = -1
        lo = 0
        m0 = 0
        row_lo = 0
        row_hi = 0
        for e in range(E):
            hi = gl.load(offs_ptr + e)
            lo4 = lo - lo % 4
            nt = gl.where(hi > lo, gl.cdiv(hi - lo4, BM), 0)
            mine = (pid_m >= first) & (pid_m < first + nt)
            g = gl.where(mine, e, g)
            m0 = gl.where(mine, lo4 + (pid_m - first) * BM, m0)
            row_lo = gl.where(mine, lo, row_lo)
            row_hi = gl.where(mine, hi, row_hi)
            first += nt
            lo = hi
        z0 = lo + (pid_m - first) * BM  # lo is offs[-1] here (zero tiles load nothing)
        kind = gl.where(g >= 0, 1, gl.where((pid_m >= first) & (z0 < M), 2, 0))
        m0 = gl.where(g >= 0, m0, z0)
        row_lo = gl.where(g >= 0, row_lo, z0)
        gg = gl.maximum(g, 0)
        return kind, m0, n0, gg * N + n0, gg * KB_PAD, row_lo, row_hi
    else:
        return 1, pid_m * BM, n0, n0, 0, 0, M


@gluon.jit
def _computes(kind, GROUPED: gl.constexpr):
    """Whether a tile of `_tile`'s kind runs the main loop (every dense tile does)."""
    if GROUPED:
        return kind == 1
    else:
        return gl.to_tensor(True)


# ----------------------------------------------------------------------------------------------
# The kernel: loader and consumer partitions
# ----------------------------------------------------------------------------------------------


@gluon.jit
def _ws_schedule(offs_ptr, M, N, K, E, MODE: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr):
    """(row tiles, column tiles, first K element, 32-blocks of K) of every partition's tile walk:
    `_tile`'s row-tile bound; grouped K: the group program_id(1)'s K range."""
    if MODE == 1:
        num_m = gl.cdiv(M + 3 * E, BM) + E + 1
    else:
        num_m = gl.cdiv(M, BM)
    if MODE == 2:
        e = gl.program_id(1)
        k_lo = gl.load(offs_ptr + e - 1, mask=e > 0, other=0)
        n_blocks = (gl.load(offs_ptr + e) - k_lo) // 32
    else:
        k_lo = 0
        n_blocks = K // 32
    return num_m, gl.cdiv(N, BN), k_lo, n_blocks


@gluon.jit
def _ws_loader(a_desc, b_desc, sa_desc, sb_desc, a_smem, b_smem, sa_smem, sb_smem, ready, empty,
               offs_ptr, M, N, K, E, KB_PAD, MODE: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
               BK: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr):
    """The loader partition (one warp): for each tile of this CTA that computes, its stages into the
    ring, each into a slot both consumer warpgroups have released (`empty`, count 2); ring step
    `it` runs on across tiles (slot it % STAGES, parity (it // STAGES) & 1, as the consumers')."""
    NB: gl.constexpr = BK // 32
    num_m, num_n, k_lo, n_blocks = _ws_schedule(offs_ptr, M, N, K, E, MODE, BM, BN)
    k_iters = (n_blocks + NB - 1) // NB
    it = 0
    for tile in range(gl.program_id(0), num_m * num_n, gl.num_programs(0)):
        kind, m0, n0, b_row, sb_row, _, _ = _tile(tile, offs_ptr, M, N, E, KB_PAD, num_m, num_n,
                                                  MODE == 1, BM, BN, GROUP_M)
        if _computes(kind, MODE == 1):
            for i in range(k_iters):
                s = it % STAGES
                # a fresh mbarrier counts as having completed the phase before its first: the
                # ring's first lap passes
                mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
                # the consumers' scale reads of the slot (generic proxy) before this refill (async
                # proxy): fenced here, off the consumers' path
                fence_async_shared()
                _issue_loads(a_desc, b_desc, sa_desc, sb_desc, a_smem, b_smem, sa_smem, sb_smem, ready,
                             s, i, m0, n0, b_row, sb_row, k_lo, True, BK)
                it += 1


@gluon.jit
def _ws_stage(acc, a_smem, b_smem, sa_smem, sb_smem, ready, empty, zero, it, n_valid, BM: gl.constexpr,
              BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr, WG: gl.constexpr,
              MMA: gl.constexpr, CHECKED: gl.constexpr):
    """One stage (ring step `it`) of a consumer warpgroup: wait for the slot's fill, per 32-block j
    a wgmma into a fresh temporary, a wait, the promotion into acc (fp32 (BM/2, BN), layout MMA);
    then release the slot. CHECKED: only blocks j < n_valid are promoted (a grouped-K group's
    partial last stage: the blocks after it are the next group's, or TMA's zero fill, and add
    nothing); the others are multiplied and dropped (a branch: no NaN of theirs gets in).
    Unchecked, ptxas issues block j+1's wgmma during block j's promotion; the check's branch stops
    that, so only a grouped-K group's last stage runs checked."""
    NB: gl.constexpr = BK // 32
    HALF: gl.constexpr = BM // 2
    s = it % STAGES
    mbarrier.wait(ready.index(s), (it // STAGES) & 1)
    for j in gl.static_range(NB):
        part = _mma_rows(a_smem, b_smem, s, j, WG * HALF, zero, BK)
        sa = _scale_row(sa_smem, s, j, NB, BM).slice(WG * HALF, HALF).load(gl.SliceLayout(1, MMA))
        sb = _sb_row(sb_smem, s, j, NB, BN).load(gl.SliceLayout(0, MMA))
        part = warpgroup_mma_wait(0, deps=(part,))
        if CHECKED:
            if j < n_valid:
                acc = _promote(acc, part, sa, sb)
        else:
            acc = _promote(acc, part, sa, sb)
    mbarrier.arrive(empty.index(s), count=1)  # (the loader fences before the refill)
    return acc


@gluon.jit
def _ws_consumer(a_smem, b_smem, sa_smem, sb_smem, ready, empty, c_ptr, offs_ptr, M, N, K, E, KB_PAD,
                 stride_cm, stride_ce, MODE: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
                 BK: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr, WG: gl.constexpr):
    """One consumer partition (a warpgroup, 4 warps): rows [WG*BM/2, +BM/2) of every tile of this
    CTA, stage by stage (`_ws_stage`): per 32-block wgmma m64nBNk32 into a fresh temporary, wait
    for it, promote it into the fp32 accumulator (`_promote`); while this warpgroup promotes, the
    other one's MMA runs (no wgmma in flight across a loop edge, no CTA-wide barrier). After a
    stage it releases the slot (one arrival on `empty`). Grouped K: every stage but the group's
    last runs unchecked (the same loop as the other modes); the last, possibly partial, promotes
    only the blocks before the group's end (`n_blocks`)."""
    NB: gl.constexpr = BK // 32
    HALF: gl.constexpr = BM // 2
    GROUPED: gl.constexpr = MODE == 1
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, BN, 32])
    num_m, num_n, k_lo, n_blocks = _ws_schedule(offs_ptr, M, N, K, E, MODE, BM, BN)
    k_iters = (n_blocks + NB - 1) // NB
    if MODE == 2:
        c_ptr = c_ptr + gl.program_id(1).to(gl.int64) * stride_ce
        n_whole = gl.maximum(k_iters - 1, 0)  # the stages before the group's last
    else:
        n_whole = k_iters
    zero = gl.zeros((HALF, BN), gl.float32, MMA)
    it = 0
    for tile in range(gl.program_id(0), num_m * num_n, gl.num_programs(0)):
        kind, m0, n0, b_row, sb_row, row_lo, row_hi = _tile(tile, offs_ptr, M, N, E, KB_PAD, num_m,
                                                            num_n, GROUPED, BM, BN, GROUP_M)
        if _computes(kind, GROUPED):
            acc = gl.zeros((HALF, BN), gl.float32, MMA)
            for _ in range(n_whole):
                acc = _ws_stage(acc, a_smem, b_smem, sa_smem, sb_smem, ready, empty, zero, it, NB, BM, BN,
                                BK, STAGES, WG, MMA, False)
                it += 1
            if MODE == 2:
                if k_iters > 0:  # (an empty group: no stage, zeros stored)
                    acc = _ws_stage(acc, a_smem, b_smem, sa_smem, sb_smem, ready, empty, zero, it,
                                    n_blocks - n_whole * NB, BM, BN, BK, STAGES, WG, MMA, True)
                    it += 1
            _store_tile(c_ptr, acc, m0 + WG * HALF, n0, row_lo, row_hi, N, stride_cm, HALF, BN, MMA)
        if GROUPED:  # (a dead zero-store branch on a constant kind crashes the lowering)
            if kind == 2:
                _store_tile(c_ptr, zero, m0 + WG * HALF, n0, m0, M, N, stride_cm, HALF, BN, MMA)


@gluon.jit
def _fp8_ws_kernel(a_desc, b_desc, sa_desc, sb_desc, c_ptr, offs_ptr, M, N, K, E, KB_PAD, stride_cm,
                   stride_ce, MODE: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
                   STAGES: gl.constexpr, GROUP_M: gl.constexpr, num_warps: gl.constexpr):
    """The kernel: MODE 0 dense, 1 grouped rows, 2 grouped K (program_id(1) is the group e, whose K
    range [offs[e-1], offs[e]) (multiples of 32) gives out[e], stride_ce apart); each CTA walks tiles
    program_id(0), + num_programs(0), ... Partitions: two consumer warpgroups (the default one,
    num_warps = 4, and a worker of 4 warps; 240 registers per thread each: accumulator and
    temporary BN/2 fp32 each, a block's BN/4 column scales) and a one-warp TMA loader (24
    registers), launched with maxnreg = WS_MAXNREG. Shared memory: the ring (STAGES slots of A, B
    and their scale tiles), one `ready` and one `empty` mbarrier per slot."""
    NB: gl.constexpr = BK // 32
    BOX: gl.constexpr = a_desc.block_type.shape[1]
    a_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES * (BK // BOX), BM, BOX], a_desc.layout)
    b_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES * (BK // BOX), BN, BOX], b_desc.layout)
    sa_smem = gl.allocate_shared_memory(gl.float32, [STAGES, NB, BM], sa_desc.layout)
    sb_smem = gl.allocate_shared_memory(gl.float32, [STAGES, NB, BN], sb_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=2)  # one arrival per consumer warpgroup
    fence_async_shared()
    gl.warp_specialize([
        (_ws_consumer, (a_smem, b_smem, sa_smem, sb_smem, ready, empty, c_ptr, offs_ptr, M, N, K, E, KB_PAD,
                        stride_cm, stride_ce, MODE, BM, BN, BK, STAGES, GROUP_M, 0)),
        (_ws_consumer, (a_smem, b_smem, sa_smem, sb_smem, ready, empty, c_ptr, offs_ptr, M, N, K, E, KB_PAD,
                        stride_cm, stride_ce, MODE, BM, BN, BK, STAGES, GROUP_M, 1)),
        (_ws_loader, (a_desc, b_desc, sa_desc, sb_desc, a_smem, b_smem, sa_smem, sb_smem, ready, empty,
                      offs_ptr, M, N, K, E, KB_PAD, MODE, BM, BN, BK, STAGES, GROUP_M)),
    ], [4, 1], [240, 24])
    # (no mbarrier.invalidate: nothing reuses this shared memory, and it could race with the other
    # consumer's last `empty` arrival unless the partitions were joined first)


# ----------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------


def _layouts(cfg: WgmmaConfig) -> tuple:
    nb = cfg.bk // BLOCK
    box = min(cfg.bk, 128)
    return (
        gl.NVMMASharedLayout.get_default_for([cfg.bm, box], gl.float8e4nv),
        gl.NVMMASharedLayout.get_default_for([cfg.bn, box], gl.float8e4nv),
        # scale tiles unswizzled: the promotion reads their rows through a plain view
        gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2),
        gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2),
        nb,
    )


def _decoded_scales(s: Tensor, groups: int, kb_pad: int, cols_pad: int, tile: int = 0) -> Tensor:
    """e8m0 s (groups*cols, K/32) -> fp32 (groups*kb_pad, cols_pad), one pass: decoded (2^(b-127),
    the subnormal 2^-127 for byte 0, NaN for 255), rows innermost, zero padding. The padding
    k-blocks meet zero-filled operands (TMA reads past K as zeros): 0 * 0 adds exactly nothing, and
    no tile reads the next group's scales. tile > 0 (cols_pad a multiple of it): the columns of each
    `tile`-wide tile in the order of `_sb_perm_layout`."""
    kb = s.shape[-1]
    cols = s.shape[0] // groups
    f = s.reshape(groups, cols, kb).float()
    if cols_pad > cols or kb_pad > kb:
        f = torch.nn.functional.pad(f, (0, kb_pad - kb, 0, cols_pad - cols))
    f = f.transpose(1, 2)  # (groups, kb_pad, cols_pad), a view
    if tile:  # offset o of each tile holds column _sb_columns(tile)[o]
        f = _sb_permuted(f.reshape(groups, kb_pad, cols_pad // tile, tile))
    # (with one group a reshape of the transposed view can stay a strided view: TMA needs rows)
    return f.reshape(groups * kb_pad, cols_pad).contiguous()


def _sb_permuted(f: Tensor) -> Tensor:
    """f (..., W) with W >= 32 a power of two -> its columns in `_sb_columns(W)` order, as a
    permutation of the column index's bits (no index tensor: nothing to copy from the host, so it
    can run inside CUDA graph capture). Offset bits o0..o4 hold column bits c0, c3, c4, c1, c2
    (`_sb_bases`); the bits above stay in place."""
    *lead, W = f.shape
    f = f.reshape(*lead, W // 32, 2, 2, 2, 2, 2)  # column bits: hi, c4, c3, c2, c1, c0
    n = len(lead)
    f = f.permute(*range(n), n, n + 3, n + 4, n + 1, n + 2, n + 5)  # offset bits: hi, o4..o0
    return f.reshape(*lead, W)


def _resident_ctas(cfg: WgmmaConfig, device: torch.device) -> int:
    """CTAs of this config that fit on the device at once: SMs x per-SM limit by registers (12 warps
    at WS_MAXNREG per thread) and shared memory (the ring)."""
    props = torch.cuda.get_device_properties(device)
    ring = cfg.stages * ((cfg.bm + cfg.bn) * cfg.bk + cfg.bk // BLOCK * (cfg.bm + cfg.bn) * 4)
    smem = getattr(props, "shared_memory_per_multiprocessor", 233472)  # (228 KiB on sm_90)
    threads = 32 * 12  # two consumer warpgroups, the loader's warp padded to a warpgroup
    per_sm = max(1, min(65536 // (WS_MAXNREG * threads), smem // (ring + 2048)))
    return props.multi_processor_count * per_sm


def _aligned(t: Tensor) -> Tensor:
    """t itself if TMA can read it (16-byte aligned base and row stride), else a contiguous copy."""
    if t.data_ptr() % 16 == 0 and t.stride(0) % 16 == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def launch(a_q: Tensor, a_s: Tensor, b_q: Tensor, b_s: Tensor, offs: Tensor | None, out: Tensor,
           cfg: WgmmaConfig = DEFAULT_CONFIG) -> Tensor:
    """Into `out` (bf16 or fp32, contiguous), operands checked by the caller (`fp8_gemm._check`):
    dense (M, K) x (N, K) -> (M, N), offs None; grouped rows (T, K) x (E, N, K) -> (T, N), offs (E,)
    int32 row ends; grouped K (M, T) x (N, T) -> (E, M, N), offs (E,) int32 ends over T (multiples
    of 32; the persistent option does not apply)."""
    M, K = a_q.shape
    N = b_q.shape[-2]
    mode = 0 if offs is None else (1 if b_q.ndim == 3 else 2)
    E = b_q.shape[0] if mode == 1 else 1
    la, lb, lsa, lsb, nb = _layouts(cfg)
    kb_pad = triton.cdiv(K // BLOCK, nb) * nb
    mp, np_ = triton.cdiv(M, 4) * 4, triton.cdiv(N, cfg.bn) * cfg.bn
    sa = _decoded_scales(a_s, 1, kb_pad, mp)
    sb = _decoded_scales(b_s.reshape(E * N, K // BLOCK), E, kb_pad, np_, cfg.bn)  # (E*kb_pad, Np)
    a2 = _aligned(a_q)
    b2 = _aligned(b_q.reshape(E * N, K))
    descs = (
        TensorDescriptor.from_tensor(a2, [cfg.bm, min(cfg.bk, 128)], la),
        TensorDescriptor.from_tensor(b2, [cfg.bn, min(cfg.bk, 128)], lb),
        TensorDescriptor.from_tensor(sa, [nb, cfg.bm], lsa),
        TensorDescriptor.from_tensor(sb, [nb, cfg.bn], lsb),
    )
    offs_arg = offs if offs is not None else torch.zeros(1, dtype=torch.int32, device=a_q.device)
    num_m = triton.cdiv(M + 3 * E, cfg.bm) + E + 1 if mode == 1 else triton.cdiv(M, cfg.bm)  # `_tile`
    tiles = num_m * triton.cdiv(N, cfg.bn)
    persistent = cfg.persistent and mode != 2
    if mode == 2:
        grid = (tiles, offs.shape[0])
    else:
        grid = (min(tiles, _resident_ctas(cfg, a_q.device)) if persistent else tiles,)
    _fp8_ws_kernel[grid](
        *descs, out, offs_arg, M, N, K, E, kb_pad, out.stride(-2), out.stride(0) if mode == 2 else 0,
        MODE=mode, BM=cfg.bm, BN=cfg.bn, BK=cfg.bk, STAGES=cfg.stages, GROUP_M=cfg.group_m,
        num_warps=4, maxnreg=WS_MAXNREG,
    )
    return out
