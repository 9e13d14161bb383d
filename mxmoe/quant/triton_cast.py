"""The `triton` cast backend: memory-bound Triton kernels, bit-identical to `torch_cast`.

Same interface as `mxmoe.quant.torch_cast` (docs/mx-format.md is the spec); see docs/casts.md for
the kernel designs and the benchmark. Inputs are contiguous bf16/fp32; outputs are fresh
contiguous tensors; scales are `torch.float8_e8m0fnu` (kernels see them as uint8).

With the FTZ guard (TileConfig.guard), exactness does not depend on how the GPU treats fp32
subnormals (FTZ):
- inputs are loaded as integers (bf16 bits << 16 or fp32 bits), the block amax is an integer max
  of |bits| and scale exponents are integer arithmetic (RCEIL multiplies in fp32 only above the
  T126 threshold, where the product is a normal number);
- the element product x * 2^-e is formed from normal fp32 operands only: a subnormal input
  x = m * 2^-149 is rewritten exactly as (1 + m * 2^-23) - 1 = m * 2^-23 (two normal numbers)
  times 2^(-126 - e). A product that still lands below 2^-126 is far below half the smallest
  element subnormal, so flushing it changes nothing (the sign is applied separately);
- the rounding to the element grid is either done in software (integer round-to-nearest-even in
  the normal range, an fp32 "magic number" add in the element-subnormal range) or by the
  hardware's `cvt.rn.satfinite` of the clamped fp32 value; see `_to_elem`.
- dequantize takes a fast path (one fp32 multiply of normals) for tiles whose scales keep every
  result a normal fp32 number, and otherwise builds the result from bits, including the final
  round to nearest even into bf16.

Config knobs (read at every call, so a benchmark can switch them between runs):
- MXMOE_TRITON_CAST_ROUND = auto | soft | hw: element rounding (auto: hw on a GPU, soft under the
  Triton interpreter, whose fp32->fp8 conversion does not round correctly).
- MXMOE_TRITON_CAST_CONFIG = one of CONFIGS (tiles, warps, transpose variant, FTZ guard, eviction
  hints) for every cast, or "default" (the default): each cast uses the config DEFAULTS names;
  `use_config(name)` overrides both for a `with` block.
Configs with guard=False skip the subnormal rewrite below and rely on fp32 multiplies that keep
subnormals (true of Triton 3.6 on sm_90 and of the interpreter); the GPU tests check them.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from mxmoe.formats import MODE_IDS, CastSpec, ElemFormat, f32_bits
from mxmoe.quant.kernels import dim0_outputs, triton_interpret

# ----------------------------------------------------------------------------------------------
# Configurations
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TileConfig:
    """Tile sizes, warps and variants of each kernel (elements are counted along the block axis)."""

    dim0_elems: int  # elements per program of the dim0 kernel (a multiple of bs)
    dim0_warps: int
    dim1_impl: str  # "permute": transpose the fp8 bytes; "pack4": transpose int32 words of 4 rows
    dim1_rows: int  # rows (along R, the block axis) per dim1 program; output runs are this long
    dim1_cols: int  # columns (along C) per dim1 program
    dim1_warps: int
    fused_impl: str  # as dim1_impl, for the dim1 half of the fused kernel
    fused_rows: int  # tile of the fused dim0+dim1 kernel
    fused_cols: int
    fused_warps: int
    dequant_elems: int
    dequant_warps: int
    guard: bool = True  # FTZ guard: subnormal-safe products on tiles with tiny scales (see module doc)
    evict: bool = False  # eviction_policy="evict_first" on the streaming loads and stores


# Elements per thread in brackets; all read 16-byte vectors. Registers (sm_90, Triton 3.6): about
# 64 at 16 elements per thread, 110-120 at 32, 210 at 64.
CONFIGS: dict[str, TileConfig] = {
    # the first backend's tiles: dim0 [32], dim1 128x64 byte permute [32], fused 64x64 [16]
    "v0": TileConfig(8192, 8, "permute", 128, 64, 8, "permute", 64, 64, 8, 8192, 8),
    # packed transposes (4 fp8 bytes of consecutive rows per int32 word), no FTZ guard
    "p4": TileConfig(8192, 8, "pack4", 128, 64, 8, "pack4", 64, 64, 4, 8192, 8, guard=False),
    # as p4 with the FTZ guard: measures what the guard costs
    "p4g": TileConfig(8192, 8, "pack4", 128, 64, 8, "pack4", 64, 64, 4, 8192, 8, guard=True),
    # as p4 with evict_first hints on every stream
    "p4e": TileConfig(8192, 8, "pack4", 128, 64, 8, "pack4", 64, 64, 4, 8192, 8, guard=False, evict=True),
    # fewer registers, more resident programs: [16] everywhere, 4 warps
    "p4s": TileConfig(4096, 8, "pack4", 64, 64, 4, "pack4", 64, 64, 8, 4096, 8, guard=False),
    # more bytes per program: dim0 / dequant 16 K elements [64], dim1 128x128 [64], fused 128x64 [32]
    "p4w": TileConfig(16384, 8, "pack4", 128, 128, 8, "pack4", 128, 64, 8, 16384, 8, guard=False),
    # long output rows: dim1 256x64 (256 B per output row) [64], dim0 / dequant 4 warps [64]
    "p4t": TileConfig(8192, 4, "pack4", 256, 64, 8, "pack4", 128, 64, 8, 8192, 4, guard=False),
}
# The config each cast uses when none is chosen (MXMOE_TRITON_CAST_CONFIG unset or "default").
# Set from the H200 sweep (scripts/gpu/sweep_triton_cast.sh); edit here.
# From the 2026-11-29 H200 sweep (docs/benchmarks.md; every config bit-exact there, hardware and
# software rounding): the fastest config of each cast.
DEFAULTS: dict[str, str] = {"dim0": "p4", "dim1": "p4", "dim0_dim1": "p4e", "dequant": "p4s"}
_ROUND_MODES = ("auto", "soft", "hw")
_MAX_TILE = 16384  # elements per dim1 program at most (large block sizes shrink the columns)
_FUSED_MAX_BS = 128  # larger blocks: the fused cast runs the dim0 and dim1 kernels (x read twice)
_override: dict[str, str] = {}


def _config_name(cast: str) -> str:
    """The config name cast `cast` (a key of DEFAULTS) runs with."""
    name = _override.get("config") or os.environ.get("MXMOE_TRITON_CAST_CONFIG", "default")
    if name == "default":
        return DEFAULTS[cast]
    if name not in CONFIGS:
        raise ValueError(
            f"MXMOE_TRITON_CAST_CONFIG={name!r} is not a config; expected 'default' or one of {list(CONFIGS)}"
        )
    return name


def _config(cast: str) -> TileConfig:
    return CONFIGS[_config_name(cast)]


def _soft_round(device: torch.device) -> bool:
    mode = _override.get("round") or os.environ.get("MXMOE_TRITON_CAST_ROUND", "auto")
    if mode not in _ROUND_MODES:
        raise ValueError(
            f"MXMOE_TRITON_CAST_ROUND={mode!r} is not a rounding mode; expected one of {_ROUND_MODES}"
        )
    if mode == "auto":
        return device.type != "cuda" or triton_interpret()
    if mode == "hw" and device.type != "cuda":
        raise ValueError(
            "MXMOE_TRITON_CAST_ROUND='hw' needs CUDA tensors: the interpreter does not round fp8 correctly"
        )
    return mode == "soft"


@contextlib.contextmanager
def use_config(config: str | None = None, round: str | None = None) -> Iterator[None]:
    """Within the block, use tile config `config` (a key of CONFIGS, or "default" for the per-cast
    DEFAULTS) and rounding `round` (auto | soft | hw) instead of the environment variables."""
    if config is not None and config != "default" and config not in CONFIGS:
        raise ValueError(
            f"config={config!r} is not a config; expected 'default' or one of {list(CONFIGS)}"
        )
    if round is not None and round not in _ROUND_MODES:
        raise ValueError(f"round={round!r} is not a rounding mode; expected one of {_ROUND_MODES}")
    saved = dict(_override)
    if config is not None:
        _override["config"] = config
    if round is not None:
        _override["round"] = round
    try:
        yield
    finally:
        _override.clear()
        _override.update(saved)


# ----------------------------------------------------------------------------------------------
# Device helpers (all operate on int32 fp32 bit patterns)
# ----------------------------------------------------------------------------------------------


@triton.jit
def _load_bits(ptr, offs, mask, IN_BF16: tl.constexpr, EVICT: tl.constexpr = False):
    """fp32 bit patterns (int32) of bf16 (int16 view) or fp32 (int32 view) inputs; 0 where masked."""
    if EVICT:
        v = tl.load(ptr + offs, mask=mask, other=0, eviction_policy="evict_first")
    else:
        v = tl.load(ptr + offs, mask=mask, other=0)
    if IN_BF16:
        return v.to(tl.int32) << 16
    else:
        return v


@triton.jit
def _store(ptr, offs, val, mask, EVICT: tl.constexpr = False):
    if EVICT:
        tl.store(ptr + offs, val, mask=mask, eviction_policy="evict_first")
    else:
        tl.store(ptr + offs, val, mask=mask)


@triton.jit
def _scale_exp(A, MODE: tl.constexpr, EMAX: tl.constexpr, MBITS: tl.constexpr, RCEIL_C: tl.constexpr,
               T127: tl.constexpr, T126: tl.constexpr):
    """Unbiased block exponent (int32, in [-127, 127]) from amax bits A (finite, >= 0);
    torch_cast.scale_exponent."""
    if MODE == 0:  # FLOOR
        e = (A >> 23) - (127 + EMAX)
    elif MODE == 1:  # RCEIL: the fp32 product is normal above T126; integer compares below
        d = (A.to(tl.float32, bitcast=True) * RCEIL_C).to(tl.int32, bitcast=True)
        e = (d >> 23) - 127 + ((d & 0x7FFFFF) != 0).to(tl.int32)
        e = tl.where(A <= T126, -126, e)
        e = tl.where(A <= T127, -127, e)
    elif MODE == 2:  # CEIL
        e = (A >> 23) - (127 + EMAX) + ((A & 0x7FFFFF) != 0).to(tl.int32)
    else:  # EVEN
        e = ((A + (1 << (22 - MBITS))) >> 23) - (127 + EMAX)
    return tl.minimum(tl.maximum(e, -127), 127)


@triton.jit
def _to_elem(y, IS_E5M2: tl.constexpr, MBITS: tl.constexpr, MIN_EXP: tl.constexpr,
             MAXBITS: tl.constexpr, SOFT: tl.constexpr):
    """Element bytes (uint8) of RNE(clamp(y, -max, max)) for finite fp32 y (values in blocks that
    are overwritten later may be anything). This is the only place elements are rounded.

    SOFT: round in software to the element grid and convert the exact value (the Triton
    interpreter's fp32->fp8 conversion rounds some values wrongly but converts exact ones
    exactly). Otherwise the hardware `cvt.rn.satfinite` rounds the clamped value."""
    if SOFT:
        SH: tl.constexpr = 23 - MBITS
        Y = y.to(tl.int32, bitcast=True)
        yb = Y & 0x7FFFFFFF
        # normal element range: integer RNE on the bit pattern (a carry into the exponent is right)
        rn = (yb + ((1 << (SH - 1)) - 1) + ((yb >> SH) & 1)) & (-(1 << SH))
        rn = tl.minimum(rn, MAXBITS)
        # element subnormals: grid 2^(MIN_EXP - MBITS); adding 2^(MIN_EXP - MBITS + 23) rounds to it
        MAGIC: tl.constexpr = 2.0 ** (MIN_EXP - MBITS + 23)
        ya = tl.minimum(yb, MAXBITS).to(tl.float32, bitcast=True)
        sub = ((ya + MAGIC) - MAGIC).to(tl.int32, bitcast=True)
        vb = tl.where(yb < ((MIN_EXP + 127) << 23), sub, rn)
        v = (vb | (Y & -2147483648)).to(tl.float32, bitcast=True)
    else:
        # Triton 3.x lowers this conversion on sm_89+ to `cvt.rn.satfinite.{e4m3,e5m2}x2.f32`
        # (SASS F2FP.SATFINITE): round to nearest even with saturation to +-max, i.e. exactly
        # RNE(clamp(y)); the GPU tests (448 * 2^k blocks, FLOOR overflow) check it.
        v = y
    if IS_E5M2:
        return v.to(tl.float8e5, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)
    else:
        return v.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)


@triton.jit
def _abs_key(X):
    """|bits| ordered as unsigned (X << 1): one shift, no mask, before an integer max."""
    return (X << 1).to(tl.uint32, bitcast=True)


@triton.jit
def _block_scale(K, MODE: tl.constexpr, EMAX: tl.constexpr, MBITS: tl.constexpr, RCEIL_C: tl.constexpr,
                 T127: tl.constexpr, T126: tl.constexpr):
    """From the max of _abs_key over a block (uint32) -> (e, int32 exponent; nonfinite, bool;
    scale byte, uint8; emin, the smallest e of the tile's finite nonzero blocks)."""
    A = (K >> 1).to(tl.int32, bitcast=True)
    nonfinite = A >= 0x7F800000
    e = _scale_exp(tl.where(nonfinite, 0, A), MODE, EMAX, MBITS, RCEIL_C, T127, T126)
    s = tl.where(nonfinite, 255, e + 127).to(tl.uint8)
    # (all-zero blocks, e.g. padding, and non-finite blocks do not count)
    emin = tl.min(tl.where(nonfinite | (A == 0), 127, e))
    return e, nonfinite, s, emin


@triton.jit
def _apply(X, e, nonfinite, emin, IS_E5M2: tl.constexpr, MBITS: tl.constexpr, MIN_EXP: tl.constexpr,
           MAXBITS: tl.constexpr, SOFT: tl.constexpr, GUARD: tl.constexpr):
    """Element bytes (uint8, X's shape) of X (int32 fp32 bits) in blocks of exponent e and
    non-finite flag `nonfinite` (both broadcastable to X). Non-finite blocks get byte 0x7F,
    selected explicitly (the hardware's NaN encoding is not relied on)."""
    # 2^-e, a normal number for every finite block (e <= 120); non-finite blocks have e = -127
    r = ((127 - e) << 23).to(tl.float32, bitcast=True)
    E_FAST: tl.constexpr = MBITS - MIN_EXP - 125
    if GUARD:
        # With every block exponent >= E_FAST, a subnormal x has |x * 2^-e| < 2^(-126-e), below half
        # the smallest element subnormal: flushing it (FTZ) gives the same +-0 as exact rounding.
        if emin >= E_FAST:
            y = X.to(tl.float32, bitcast=True) * r
        else:
            # subnormal x = m * 2^-149 becomes (1 + m * 2^-23) - 1 = m * 2^-23 (exact, normal) times
            # 2^(-126 - e) (built from bits; 0 when it underflows, as y is then negligible)
            r_sub = (tl.maximum(1 - e, 0) << 23).to(tl.float32, bitcast=True)
            ax = X & 0x7FFFFFFF
            is_sub = ax < 0x800000
            xs = tl.where(is_sub, ((ax & 0x7FFFFF) | 0x3F800000).to(tl.float32, bitcast=True) - 1.0,
                          ax.to(tl.float32, bitcast=True))
            ya = xs * tl.where(is_sub, r_sub, r)
            y = (ya.to(tl.int32, bitcast=True) | (X & -2147483648)).to(tl.float32, bitcast=True)
    else:
        # No guard: relies on fp32 multiplies that keep subnormals (measured on sm_90 with Triton
        # 3.6; numpy in the interpreter). Then x * 2^-e is exact whenever it is a normal number and
        # rounds to +-0 as an element otherwise.
        y = X.to(tl.float32, bitcast=True) * r
    q = _to_elem(y, IS_E5M2, MBITS, MIN_EXP, MAXBITS, SOFT)
    return tl.where(nonfinite, 0x7F, q).to(tl.uint8)


@triton.jit
def _quantize(X, AXIS: tl.constexpr, MODE: tl.constexpr, IS_E5M2: tl.constexpr, EMAX: tl.constexpr,
              MBITS: tl.constexpr, MIN_EXP: tl.constexpr, MAXBITS: tl.constexpr, RCEIL_C: tl.constexpr,
              T127: tl.constexpr, T126: tl.constexpr, SOFT: tl.constexpr, GUARD: tl.constexpr):
    """Quantize blocks that span axis AXIS of X (int32 fp32 bits, any rank).
    Returns (element bytes, uint8, X's shape; scale bytes, uint8, X's shape without AXIS)."""
    e, nonfinite, s, emin = _block_scale(tl.max(_abs_key(X), axis=AXIS), MODE, EMAX, MBITS, RCEIL_C,
                                         T127, T126)
    q = _apply(X, tl.expand_dims(e, AXIS), tl.expand_dims(nonfinite, AXIS), emin, IS_E5M2, MBITS,
               MIN_EXP, MAXBITS, SOFT, GUARD)
    return q, s


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _dim0_kernel(x_ptr, q_ptr, s_ptr, n_blocks, BS: tl.constexpr, NB: tl.constexpr,
                 IN_BF16: tl.constexpr, MODE: tl.constexpr, IS_E5M2: tl.constexpr, EMAX: tl.constexpr,
                 MBITS: tl.constexpr, MIN_EXP: tl.constexpr, MAXBITS: tl.constexpr,
                 RCEIL_C: tl.constexpr, T127: tl.constexpr, T126: tl.constexpr, SOFT: tl.constexpr,
                 GUARD: tl.constexpr, EVICT: tl.constexpr):
    """(R, C) with blocks along C is a flat sequence of blocks: program p quantizes blocks
    [p*NB, (p+1)*NB) as an (NB, BS) tile; scales are the flat (R * C / BS) sequence."""
    pid = tl.program_id(0)
    blk0 = pid.to(tl.int64) * NB
    x_ptr += blk0 * BS
    q_ptr += blk0 * BS
    s_ptr += blk0
    b = tl.arange(0, NB)
    bmask = b < n_blocks - blk0
    offs = b[:, None] * BS + tl.arange(0, BS)[None, :]
    X = _load_bits(x_ptr, offs, bmask[:, None], IN_BF16, EVICT)
    q, s = _quantize(X, 1, MODE, IS_E5M2, EMAX, MBITS, MIN_EXP, MAXBITS, RCEIL_C, T127, T126, SOFT,
                     GUARD)
    _store(q_ptr, offs, q, bmask[:, None], EVICT)
    tl.store(s_ptr + b, s, mask=bmask)


@triton.jit
def _dim0_persistent_kernel(x_ptr, q_ptr, s_ptr, n_blocks, tiles_per_program, n_programs, BS: tl.constexpr,
                            NB: tl.constexpr,
                            IN_BF16: tl.constexpr, MODE: tl.constexpr, IS_E5M2: tl.constexpr,
                            EMAX: tl.constexpr, MBITS: tl.constexpr, MIN_EXP: tl.constexpr,
                            MAXBITS: tl.constexpr, RCEIL_C: tl.constexpr, T127: tl.constexpr,
                            T126: tl.constexpr, SOFT: tl.constexpr, GUARD: tl.constexpr, EVICT: tl.constexpr):
    """_dim0_kernel's tiles, program p taking tiles p, p + P, p + 2P, ... (P programs): a few programs
    keep the rest of the GPU free, e.g. while their stores travel to a peer GPU at NVLink speed."""
    pid = tl.program_id(0)
    b = tl.arange(0, NB)
    offs = b[:, None] * BS + tl.arange(0, BS)[None, :]
    for i in range(0, tiles_per_program):
        blk0 = (pid + i * n_programs).to(tl.int64) * NB
        bmask = b < n_blocks - blk0  # all false past the last tile
        X = _load_bits(x_ptr + blk0 * BS, offs, bmask[:, None], IN_BF16, EVICT)
        q, s = _quantize(X, 1, MODE, IS_E5M2, EMAX, MBITS, MIN_EXP, MAXBITS, RCEIL_C, T127, T126, SOFT,
                         GUARD)
        _store(q_ptr + blk0 * BS, offs, q, bmask[:, None], EVICT)
        tl.store(s_ptr + blk0 + b, s, mask=bmask)


@triton.jit
def _dim1_kernel(x_ptr, q_ptr, s_ptr, R, C, BS: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
                 IN_BF16: tl.constexpr, MODE: tl.constexpr, IS_E5M2: tl.constexpr, EMAX: tl.constexpr,
                 MBITS: tl.constexpr, MIN_EXP: tl.constexpr, MAXBITS: tl.constexpr,
                 RCEIL_C: tl.constexpr, T127: tl.constexpr, T126: tl.constexpr, SOFT: tl.constexpr,
                 GUARD: tl.constexpr, EVICT: tl.constexpr):
    """x (B, R, C), blocks along R -> q (B, C, R), s (B, C, R/BS). Program (i, j, b) loads the
    (BR, BC) tile at rows i*BR, cols j*BC as (BR/BS, BS, BC) row-major, reduces over axis 1 and
    stores the tile transposed so that runs of BR output bytes are contiguous."""
    NBR: tl.constexpr = BR // BS
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    pid_b = tl.program_id(2).to(tl.int64)
    nrb = R // BS
    r0 = pid_r * BR
    c0 = pid_c * BC
    x_ptr += pid_b * R * C + r0.to(tl.int64) * C + c0
    q_ptr += pid_b * R * C + c0.to(tl.int64) * R + r0
    s_ptr += pid_b * nrb * C + c0.to(tl.int64) * nrb + pid_r * NBR
    rb = tl.arange(0, NBR)
    j = tl.arange(0, BS)
    c = tl.arange(0, BC)
    rmask = rb < nrb - pid_r * NBR
    cmask = c < C - c0
    offs = (rb[:, None, None] * BS + j[None, :, None]) * C + c[None, None, :]
    mask = rmask[:, None, None] & cmask[None, None, :]
    X = _load_bits(x_ptr, offs, mask, IN_BF16, EVICT)
    q, s = _quantize(X, 1, MODE, IS_E5M2, EMAX, MBITS, MIN_EXP, MAXBITS, RCEIL_C, T127, T126, SOFT,
                     GUARD)
    offs_t = c[:, None, None] * R + rb[None, :, None] * BS + j[None, None, :]
    mask_t = cmask[:, None, None] & rmask[None, :, None]
    _store(q_ptr, offs_t, tl.permute(q, (2, 0, 1)), mask_t, EVICT)
    tl.store(s_ptr + c[:, None] * nrb + rb[None, :], tl.trans(s), mask=cmask[:, None] & rmask[None, :])


@triton.jit
def _dim0_dim1_kernel(x_ptr, q0_ptr, s0_ptr, q1_ptr, s1_ptr, R, C, BS: tl.constexpr, BR: tl.constexpr,
                      BC: tl.constexpr, IN_BF16: tl.constexpr, MODE: tl.constexpr, IS_E5M2: tl.constexpr,
                      EMAX: tl.constexpr, MBITS: tl.constexpr, MIN_EXP: tl.constexpr,
                      MAXBITS: tl.constexpr, RCEIL_C: tl.constexpr, T127: tl.constexpr,
                      T126: tl.constexpr, SOFT: tl.constexpr, GUARD: tl.constexpr,
                      EVICT: tl.constexpr):
    """x (R, C) read once as (BR/BS, BS, BC/BS, BS) tiles: blocks along C (axis 3) give q0 (R, C),
    s0 (R, C/BS); blocks along R (axis 1) give q1 (C, R), s1 (C, R/BS), stored transposed."""
    NBR: tl.constexpr = BR // BS
    NBC: tl.constexpr = BC // BS
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    nrb = R // BS
    ncb = C // BS
    r0 = pid_r * BR
    c0 = pid_c * BC
    x_ptr += r0.to(tl.int64) * C + c0
    q0_ptr += r0.to(tl.int64) * C + c0
    s0_ptr += r0.to(tl.int64) * ncb + pid_c * NBC
    q1_ptr += c0.to(tl.int64) * R + r0
    s1_ptr += c0.to(tl.int64) * nrb + pid_r * NBR
    i = tl.arange(0, NBR)[:, None, None, None]
    j = tl.arange(0, BS)[None, :, None, None]
    k = tl.arange(0, NBC)[None, None, :, None]
    m = tl.arange(0, BS)[None, None, None, :]
    imask = i < nrb - pid_r * NBR
    kmask = k < ncb - pid_c * NBC
    mask = imask & kmask
    offs = (i * BS + j) * C + k * BS + m
    X = _load_bits(x_ptr, offs, mask, IN_BF16, EVICT)
    q0, s0 = _quantize(X, 3, MODE, IS_E5M2, EMAX, MBITS, MIN_EXP, MAXBITS, RCEIL_C, T127, T126, SOFT,
                     GUARD)
    _store(q0_ptr, offs, q0, mask, EVICT)
    # s0: (NBR, BS, NBC) -> s0[row, col block]
    s0_offs = (tl.arange(0, NBR)[:, None, None] * BS + tl.arange(0, BS)[None, :, None]) * ncb + \
        tl.arange(0, NBC)[None, None, :]
    s0_mask = (tl.arange(0, NBR)[:, None, None] < nrb - pid_r * NBR) & \
        (tl.arange(0, NBC)[None, None, :] < ncb - pid_c * NBC)
    tl.store(s0_ptr + s0_offs, s0, mask=s0_mask)
    q1, s1 = _quantize(X, 1, MODE, IS_E5M2, EMAX, MBITS, MIN_EXP, MAXBITS, RCEIL_C, T127, T126, SOFT,
                     GUARD)
    # q1 (i, j, k, m) -> (k, m, i, j): element (row i*BS+j, col k*BS+m) at q1[col, row]
    it = tl.arange(0, NBR)[None, None, :, None]
    jt = tl.arange(0, BS)[None, None, None, :]
    kt = tl.arange(0, NBC)[:, None, None, None]
    mt = tl.arange(0, BS)[None, :, None, None]
    offs_t = (kt * BS + mt) * R + it * BS + jt
    mask_t = (kt < ncb - pid_c * NBC) & (it < nrb - pid_r * NBR)
    _store(q1_ptr, offs_t, tl.permute(q1, (2, 3, 0, 1)), mask_t, EVICT)
    # s1: (NBR, NBC, BS) -> (NBC, BS, NBR): s1[col, row block]
    ks = tl.arange(0, NBC)[:, None, None]
    ms = tl.arange(0, BS)[None, :, None]
    i_s = tl.arange(0, NBR)[None, None, :]
    s1_mask = (ks < ncb - pid_c * NBC) & (i_s < nrb - pid_r * NBR)
    tl.store(s1_ptr + (ks * BS + ms) * nrb + i_s, tl.permute(s1, (1, 2, 0)), mask=s1_mask)


@triton.jit
def _dim1_pack4(X0, X1, X2, X3, q_ptr, s_ptr, R, c, i, rb, cmask, rmask, rbmask, nrb, BS: tl.constexpr,
                BC: tl.constexpr, MODE: tl.constexpr, IS_E5M2: tl.constexpr, EMAX: tl.constexpr,
                MBITS: tl.constexpr, MIN_EXP: tl.constexpr, MAXBITS: tl.constexpr, RCEIL_C: tl.constexpr,
                T127: tl.constexpr, T126: tl.constexpr, SOFT: tl.constexpr, GUARD: tl.constexpr,
                EVICT: tl.constexpr):
    """Blocks along the rows of a tile held as four (BR/4, BC) row quads Xm (rows 4*i + m, same
    register layout): quantize, pack the four bytes of rows 4i..4i+3 into one int32 (in-thread),
    and store the int32 tile transposed: q_ptr (int32) gets word [c, i] at c * R/4 + i, s_ptr
    byte [c, rb] at c * nrb + rb."""
    Q4: tl.constexpr = X0.shape[0]
    NBR: tl.constexpr = Q4 * 4 // BS
    K = tl.maximum(tl.maximum(_abs_key(X0), _abs_key(X1)), tl.maximum(_abs_key(X2), _abs_key(X3)))
    K = tl.max(tl.reshape(K, (NBR, BS // 4, BC)), axis=1)
    e, nonfinite, s, emin = _block_scale(K, MODE, EMAX, MBITS, RCEIL_C, T127, T126)
    eb = tl.reshape(tl.broadcast_to(tl.expand_dims(e, 1), (NBR, BS // 4, BC)), (Q4, BC))
    nb = tl.reshape(tl.broadcast_to(tl.expand_dims(nonfinite, 1), (NBR, BS // 4, BC)), (Q4, BC))
    W = _apply(X0, eb, nb, emin, IS_E5M2, MBITS, MIN_EXP, MAXBITS, SOFT, GUARD).to(tl.int32)
    W |= _apply(X1, eb, nb, emin, IS_E5M2, MBITS, MIN_EXP, MAXBITS, SOFT, GUARD).to(tl.int32) << 8
    W |= _apply(X2, eb, nb, emin, IS_E5M2, MBITS, MIN_EXP, MAXBITS, SOFT, GUARD).to(tl.int32) << 16
    W |= _apply(X3, eb, nb, emin, IS_E5M2, MBITS, MIN_EXP, MAXBITS, SOFT, GUARD).to(tl.int32) << 24
    _store(q_ptr, c[:, None] * (R // 4) + i[None, :], tl.trans(W), cmask[:, None] & rmask[None, :], EVICT)
    tl.store(s_ptr + c[:, None] * nrb + rb[None, :], tl.trans(s), mask=cmask[:, None] & rbmask[None, :])


@triton.jit
def _dim1_pack4_kernel(x_ptr, q_ptr, s_ptr, R, C, BS: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
                       IN_BF16: tl.constexpr, MODE: tl.constexpr, IS_E5M2: tl.constexpr,
                       EMAX: tl.constexpr, MBITS: tl.constexpr, MIN_EXP: tl.constexpr,
                       MAXBITS: tl.constexpr, RCEIL_C: tl.constexpr, T127: tl.constexpr,
                       T126: tl.constexpr, SOFT: tl.constexpr, GUARD: tl.constexpr, EVICT: tl.constexpr):
    """x (B, R, C), blocks along R -> q (B, C, R) as int32 words (B, C, R/4), s (B, C, R/BS).
    Needs BS >= 4. The (BR, BC) tile is loaded as four quads of rows 4i + m (each load coalesced
    along C, all in the same layout), so the four bytes of an output word are in one thread and
    the transpose moves int32 words, not bytes."""
    NBR: tl.constexpr = BR // BS
    Q4: tl.constexpr = BR // 4
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    pid_b = tl.program_id(2).to(tl.int64)
    nrb = R // BS
    r0 = pid_r * BR
    c0 = pid_c * BC
    x_ptr += pid_b * R * C + r0.to(tl.int64) * C + c0
    q_ptr += pid_b * (R // 4) * C + c0.to(tl.int64) * (R // 4) + r0 // 4
    s_ptr += pid_b * nrb * C + c0.to(tl.int64) * nrb + pid_r * NBR
    i = tl.arange(0, Q4)
    c = tl.arange(0, BC)
    rb = tl.arange(0, NBR)
    rmask = i < (R - r0) // 4
    cmask = c < C - c0
    mask = rmask[:, None] & cmask[None, :]
    offs = (4 * i)[:, None] * C + c[None, :]
    X0 = _load_bits(x_ptr, offs, mask, IN_BF16, EVICT)
    X1 = _load_bits(x_ptr, offs + C, mask, IN_BF16, EVICT)
    X2 = _load_bits(x_ptr, offs + 2 * C, mask, IN_BF16, EVICT)
    X3 = _load_bits(x_ptr, offs + 3 * C, mask, IN_BF16, EVICT)
    _dim1_pack4(X0, X1, X2, X3, q_ptr, s_ptr, R, c, i, rb, cmask, rmask, rb < nrb - pid_r * NBR, nrb,
                BS, BC, MODE, IS_E5M2, EMAX, MBITS, MIN_EXP, MAXBITS, RCEIL_C, T127, T126, SOFT, GUARD,
                EVICT)


@triton.jit
def _dim0_rows(X, q_ptr, s_ptr, rows, C, c, cb, mask, smask, BS: tl.constexpr, MODE: tl.constexpr,
               IS_E5M2: tl.constexpr, EMAX: tl.constexpr, MBITS: tl.constexpr, MIN_EXP: tl.constexpr,
               MAXBITS: tl.constexpr, RCEIL_C: tl.constexpr, T127: tl.constexpr, T126: tl.constexpr,
               SOFT: tl.constexpr, GUARD: tl.constexpr, EVICT: tl.constexpr):
    """Blocks along the columns of X (NROWS, BC): q row `rows[k]` at q_ptr + rows[k] * C + c,
    scales at s_ptr + rows[k] * C/BS + cb."""
    NROWS: tl.constexpr = X.shape[0]
    BC: tl.constexpr = X.shape[1]
    q, s = _quantize(tl.reshape(X, (NROWS, BC // BS, BS)), 2, MODE, IS_E5M2, EMAX, MBITS, MIN_EXP, MAXBITS,
                     RCEIL_C, T127, T126, SOFT, GUARD)
    _store(q_ptr, rows[:, None] * C + c[None, :], tl.reshape(q, (NROWS, BC)), mask, EVICT)
    tl.store(s_ptr + rows[:, None] * (C // BS) + cb[None, :], s, mask=smask)


@triton.jit
def _dim0_dim1_pack4_kernel(x_ptr, q0_ptr, s0_ptr, q1_ptr, s1_ptr, R, C, BS: tl.constexpr,
                            BR: tl.constexpr, BC: tl.constexpr, IN_BF16: tl.constexpr, MODE: tl.constexpr,
                            IS_E5M2: tl.constexpr, EMAX: tl.constexpr, MBITS: tl.constexpr,
                            MIN_EXP: tl.constexpr, MAXBITS: tl.constexpr, RCEIL_C: tl.constexpr,
                            T127: tl.constexpr, T126: tl.constexpr, SOFT: tl.constexpr,
                            GUARD: tl.constexpr, EVICT: tl.constexpr):
    """x (R, C) read once as four (BR/4, BC) row quads: each quad gives its dim0 rows (q0 (R, C),
    s0 (R, C/BS)) directly; the quads together give the dim1 blocks, stored as packed int32 words
    (q1 (C, R/4) int32 view of (C, R) bytes, s1 (C, R/BS)) as in _dim1_pack4_kernel."""
    NBR: tl.constexpr = BR // BS
    NBC: tl.constexpr = BC // BS
    Q4: tl.constexpr = BR // 4
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    nrb = R // BS
    r0 = pid_r * BR
    c0 = pid_c * BC
    x_ptr += r0.to(tl.int64) * C + c0
    q0_ptr += r0.to(tl.int64) * C + c0
    s0_ptr += r0.to(tl.int64) * (C // BS) + pid_c * NBC
    q1_ptr += c0.to(tl.int64) * (R // 4) + r0 // 4
    s1_ptr += c0.to(tl.int64) * nrb + pid_r * NBR
    i = tl.arange(0, Q4)
    c = tl.arange(0, BC)
    cb = tl.arange(0, NBC)
    rb = tl.arange(0, NBR)
    rmask = i < (R - r0) // 4
    cmask = c < C - c0
    mask = rmask[:, None] & cmask[None, :]
    smask = rmask[:, None] & (cb < C // BS - pid_c * NBC)[None, :]
    offs = (4 * i)[:, None] * C + c[None, :]
    X0 = _load_bits(x_ptr, offs, mask, IN_BF16, EVICT)
    X1 = _load_bits(x_ptr, offs + C, mask, IN_BF16, EVICT)
    X2 = _load_bits(x_ptr, offs + 2 * C, mask, IN_BF16, EVICT)
    X3 = _load_bits(x_ptr, offs + 3 * C, mask, IN_BF16, EVICT)
    _dim0_rows(X0, q0_ptr, s0_ptr, 4 * i, C, c, cb, mask, smask, BS, MODE, IS_E5M2, EMAX, MBITS, MIN_EXP,
               MAXBITS, RCEIL_C, T127, T126, SOFT, GUARD, EVICT)
    _dim0_rows(X1, q0_ptr, s0_ptr, 4 * i + 1, C, c, cb, mask, smask, BS, MODE, IS_E5M2, EMAX, MBITS,
               MIN_EXP, MAXBITS, RCEIL_C, T127, T126, SOFT, GUARD, EVICT)
    _dim0_rows(X2, q0_ptr, s0_ptr, 4 * i + 2, C, c, cb, mask, smask, BS, MODE, IS_E5M2, EMAX, MBITS,
               MIN_EXP, MAXBITS, RCEIL_C, T127, T126, SOFT, GUARD, EVICT)
    _dim0_rows(X3, q0_ptr, s0_ptr, 4 * i + 3, C, c, cb, mask, smask, BS, MODE, IS_E5M2, EMAX, MBITS,
               MIN_EXP, MAXBITS, RCEIL_C, T127, T126, SOFT, GUARD, EVICT)
    _dim1_pack4(X0, X1, X2, X3, q1_ptr, s1_ptr, R, c, i, rb, cmask, rmask, rb < nrb - pid_r * NBR, nrb,
                BS, BC, MODE, IS_E5M2, EMAX, MBITS, MIN_EXP, MAXBITS, RCEIL_C, T127, T126, SOFT, GUARD,
                EVICT)


@triton.jit
def _dequant_specials(o, qb, s, IS_E5M2: tl.constexpr, OUT_BF16: tl.constexpr):
    """Replace NaN results (NaN element or scale byte 0xFF) by the NaN 0x7FC00000 / 0x7FC0 and
    e5m2 Inf elements by +-Inf, decided from the bytes (the interpreter's fp8e5 -> fp32
    conversion misreads Inf)."""
    if IS_E5M2:
        q_nan = (qb & 0x7F) > 0x7C
        is_special = q_nan | ((qb & 0x7F) == 0x7C)
    else:
        q_nan = (qb & 0x7F) == 0x7F
        is_special = q_nan
    nan = q_nan | (s == 255)[:, None]
    is_special = is_special | nan
    special = tl.where(nan, 0x7FC00000, ((qb.to(tl.int32) & 0x80) << 24) | 0x7F800000)
    if OUT_BF16:
        return tl.where(is_special, (special >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True), o)
    else:
        return tl.where(is_special, special.to(tl.float32, bitcast=True), o)


@triton.jit
def _dequant_kernel(q_ptr, s_ptr, out_ptr, n_blocks, BS: tl.constexpr, NB: tl.constexpr,
                    IS_E5M2: tl.constexpr, OUT_BF16: tl.constexpr, SAFE_S: tl.constexpr,
                    SOFT: tl.constexpr, EVICT: tl.constexpr):
    """q (R, C) element bytes, s (R, C/BS) scale bytes, both as flat block sequences -> out.

    A tile whose scale bytes are all >= SAFE_S has only normal fp32 results (or 0, Inf, NaN): one
    fp32 multiply of normal numbers, then the hardware RNE to the output type; on the GPU the
    hardware propagates NaN/Inf (scale byte 0xFF becomes a NaN multiplier). Other tiles build
    q * 2^(s-127) from bits (exact, possibly an fp32 subnormal) and round to bf16 with integer
    round-to-nearest-even, so nothing depends on subnormal arithmetic."""
    pid = tl.program_id(0)
    blk0 = pid.to(tl.int64) * NB
    q_ptr += blk0 * BS
    out_ptr += blk0 * BS
    s_ptr += blk0
    b = tl.arange(0, NB)
    bmask = b < n_blocks - blk0
    offs = b[:, None] * BS + tl.arange(0, BS)[None, :]
    if EVICT:
        qb = tl.load(q_ptr + offs, mask=bmask[:, None], other=0, eviction_policy="evict_first")
    else:
        qb = tl.load(q_ptr + offs, mask=bmask[:, None], other=0)
    s = tl.load(s_ptr + b, mask=bmask, other=127).to(tl.int32)
    if IS_E5M2:
        qf = qb.to(tl.float8e5, bitcast=True).to(tl.float32)
    else:
        qf = qb.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    if tl.min(s) >= SAFE_S:  # 0xFF counts as safe: its NaN is handled below
        scale = tl.where(s == 255, 0x7FC00000, s << 23).to(tl.float32, bitcast=True)
        y = qf * scale[:, None]
        if OUT_BF16:
            o = y.to(tl.bfloat16, fp_downcast_rounding="rtne")
        else:
            o = y
        if SOFT:
            o = _dequant_specials(o, qb, s, IS_E5M2, OUT_BF16)
    else:
        Q = qf.to(tl.int32, bitcast=True)
        a = Q & 0x7FFFFFFF
        k = (s - 127)[:, None]
        F = (a >> 23) + k  # biased exponent of the result
        norm = a + (k << 23)
        sub = ((a & 0x7FFFFF) | 0x800000) >> tl.minimum(tl.maximum(1 - F, 0), 31)
        ra = tl.where(F >= 1, norm, sub)
        ra = tl.where(F >= 255, 0x7F800000, ra)
        ra = tl.where(a == 0, 0, ra)
        if OUT_BF16:
            rh = (ra + 0x7FFF + ((ra >> 16) & 1)) >> 16
            rh = rh | ((Q >> 16) & 0x8000)
            o = rh.to(tl.int16).to(tl.bfloat16, bitcast=True)
        else:
            o = (ra | (Q & -2147483648)).to(tl.float32, bitcast=True)
        o = _dequant_specials(o, qb, s, IS_E5M2, OUT_BF16)
    _store(out_ptr, offs, o, bmask[:, None], EVICT)


# ----------------------------------------------------------------------------------------------
# Python entry points
# ----------------------------------------------------------------------------------------------


def _check(x: torch.Tensor, ndim: int, name: str = "x") -> None:
    if x.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"{name} has dtype {x.dtype}; expected torch.bfloat16 or torch.float32")
    if x.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}D, got shape {tuple(x.shape)}")
    if not x.is_contiguous():
        raise ValueError(f"{name} must be contiguous (shape {tuple(x.shape)}, stride {x.stride()})")


def _check_div(n: int, bs: int, what: str) -> None:
    if n % bs:
        raise ValueError(f"{what}={n} is not divisible by block_size={bs}")


def _bits_view(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int16) if x.dtype == torch.bfloat16 else x.view(torch.int32)


def _spec_args(spec: CastSpec, device: torch.device, cfg: TileConfig) -> dict:
    f: ElemFormat = spec.elem
    return dict(
        MODE=MODE_IDS[spec.mode],
        IS_E5M2=f.dtype == torch.float8_e5m2,
        EMAX=f.emax,
        MBITS=f.mbits,
        MIN_EXP=f.min_normal_exp,
        MAXBITS=f32_bits(f.max_normal),
        RCEIL_C=spec.rceil_c,
        T127=spec.rceil_t127,
        T126=spec.rceil_t126,
        SOFT=_soft_round(device),
        GUARD=cfg.guard,
        EVICT=cfg.evict,
    )


def _blocks_per_program(elems: int, bs: int, n_blocks: int) -> int:
    nb = max(1, elems // bs)
    # small inputs: keep at least a few programs per SM's worth of work; never exceed the input
    return max(1, min(nb, triton.next_power_of_2(max(1, n_blocks))))


def quantize_dim0(
    x: torch.Tensor, spec: CastSpec, out=None, programs: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x: (R, C) bf16/fp32 contiguous -> qdata (R, C) elem dtype, scale (R, C // bs) e8m0;
    blocks of bs consecutive elements along C. out: optional preallocated (q, s) to write into (any
    memory the GPU can store to, e.g. a peer's buffer: see kernels.dim0_outputs). programs: run at
    most this many programs, each looping over tiles (None: one program per tile; the same bytes)."""
    _check(x, 2)
    R, C = x.shape
    bs = spec.block_size
    _check_div(C, bs, "x.shape[-1]")
    q, s = dim0_outputs(x, spec, out)
    n_blocks = R * C // bs
    if n_blocks == 0:
        return q, s
    cfg = _config("dim0")
    nb = _blocks_per_program(cfg.dim0_elems, bs, n_blocks)
    if programs is not None:
        if isinstance(programs, bool) or not isinstance(programs, int) or programs < 1:
            raise ValueError(f"programs={programs!r}; expected None or an int >= 1")
    # (The interpreter of triton 3.6 cannot run loops with a runtime bound: it runs one program per tile.)
    if programs is not None and not triton_interpret():
        n_tiles = triton.cdiv(n_blocks, nb)
        grid = min(programs, n_tiles)
        _dim0_persistent_kernel[(grid,)](
            _bits_view(x), q.view(torch.uint8), s.view(torch.uint8), n_blocks, triton.cdiv(n_tiles, grid),
            grid, BS=bs, NB=nb,
            IN_BF16=x.dtype == torch.bfloat16, num_warps=cfg.dim0_warps, **_spec_args(spec, x.device, cfg),
        )
        return q, s
    _dim0_kernel[(triton.cdiv(n_blocks, nb),)](
        _bits_view(x), q.view(torch.uint8), s.view(torch.uint8), n_blocks, BS=bs, NB=nb,
        IN_BF16=x.dtype == torch.bfloat16, num_warps=cfg.dim0_warps, **_spec_args(spec, x.device, cfg),
    )
    return q, s


def _dim1_tile(R: int, C: int, bs: int, rows: int, cols: int) -> tuple[int, int]:
    br = max(bs, min(rows, triton.next_power_of_2(R)))
    bc = max(1, min(cols, triton.next_power_of_2(C), _MAX_TILE // br))
    return br, bc


def quantize_dim1(x: torch.Tensor, spec: CastSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """x: (B, R, C) bf16/fp32 contiguous, blocks along R -> qdata (B, C, R) elem dtype,
    scale (B, C, R // bs) e8m0 (each block of bs elements contiguous in qdata)."""
    _check(x, 3)
    B, R, C = x.shape
    bs = spec.block_size
    _check_div(R, bs, "x.shape[-2]")
    q = torch.empty((B, C, R), dtype=spec.elem.dtype, device=x.device)
    s = torch.empty((B, C, R // bs), dtype=torch.float8_e8m0fnu, device=x.device)
    if x.numel() == 0:
        return q, s
    if B > 65535:
        raise ValueError(f"x.shape[0]={B} exceeds the 65535 batches the dim1 kernel's grid allows")
    cfg = _config("dim1")
    br, bc = _dim1_tile(R, C, bs, cfg.dim1_rows, cfg.dim1_cols)
    grid = (triton.cdiv(R, br), triton.cdiv(C, bc), B)
    if grid[1] > 65535:
        raise ValueError(f"x.shape[-1]={C} is too wide for the dim1 kernel's grid (at most {65535 * bc})")
    packed = cfg.dim1_impl == "pack4" and bs >= 4  # R % 4 == 0: every output row is whole int32 words
    kernel = _dim1_pack4_kernel if packed else _dim1_kernel
    kernel[grid](
        _bits_view(x), q.view(torch.int32 if packed else torch.uint8), s.view(torch.uint8), R, C, BS=bs,
        BR=br, BC=bc, IN_BF16=x.dtype == torch.bfloat16, num_warps=cfg.dim1_warps,
        **_spec_args(spec, x.device, cfg),
    )
    return q, s


def quantize_dim0_dim1(
    x: torch.Tensor, spec: CastSpec
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x: (R, C) bf16/fp32 contiguous, read once -> q0 (R, C), s0 (R, C // bs) (blocks along C)
    and q1 (C, R), s1 (C, R // bs) (blocks along R, stored transposed)."""
    _check(x, 2)
    R, C = x.shape
    bs = spec.block_size
    _check_div(C, bs, "x.shape[-1]")
    _check_div(R, bs, "x.shape[0]")
    dev = x.device
    q0 = torch.empty((R, C), dtype=spec.elem.dtype, device=dev)
    s0 = torch.empty((R, C // bs), dtype=torch.float8_e8m0fnu, device=dev)
    q1 = torch.empty((C, R), dtype=spec.elem.dtype, device=dev)
    s1 = torch.empty((C, R // bs), dtype=torch.float8_e8m0fnu, device=dev)
    if x.numel() == 0:
        return q0, s0, q1, s1
    if bs > _FUSED_MAX_BS:  # a (bs, bs) tile would not fit in registers
        q0, s0 = quantize_dim0(x, spec)
        q1, s1 = quantize_dim1(x.unsqueeze(0), spec)
        return q0, s0, q1[0], s1[0]
    cfg = _config("dim0_dim1")
    br = max(bs, min(cfg.fused_rows, triton.next_power_of_2(R)))
    bc = max(bs, min(cfg.fused_cols, triton.next_power_of_2(C)))
    grid = (triton.cdiv(R, br), triton.cdiv(C, bc))
    if grid[1] > 65535:
        raise ValueError(f"x.shape[-1]={C} is too wide for the fused kernel's grid (at most {65535 * bc})")
    packed = cfg.fused_impl == "pack4" and bs >= 4
    kernel = _dim0_dim1_pack4_kernel if packed else _dim0_dim1_kernel
    kernel[grid](
        _bits_view(x), q0.view(torch.uint8), s0.view(torch.uint8),
        q1.view(torch.int32 if packed else torch.uint8), s1.view(torch.uint8), R, C, BS=bs, BR=br, BC=bc,
        IN_BF16=x.dtype == torch.bfloat16, num_warps=cfg.fused_warps, **_spec_args(spec, dev, cfg),
    )
    return q0, s0, q1, s1


def dequantize(q: torch.Tensor, s: torch.Tensor, block_size: int, out_dtype: torch.dtype) -> torch.Tensor:
    """q: (R, C) float8_e4m3fn/e5m2 contiguous, s: (R, C // block_size) e8m0 (or uint8) contiguous
    -> (R, C) out_dtype (bf16 or fp32): q * 2^(s - 127) exact in fp32, rounded once (RNE).
    NaN results (NaN element or scale byte 0xFF) are NaN; their bit pattern is not specified
    (torch's own differs between CPU and GPU)."""
    if q.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise TypeError(f"q has dtype {q.dtype}; expected torch.float8_e4m3fn or torch.float8_e5m2")
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"out_dtype={out_dtype}; expected torch.bfloat16 or torch.float32")
    if q.ndim != 2 or not q.is_contiguous():
        raise ValueError(f"q must be a contiguous 2D tensor, got shape {tuple(q.shape)}")
    R, C = q.shape
    _check_div(C, block_size, "q.shape[-1]")
    if tuple(s.shape) != (R, C // block_size) or not s.is_contiguous():
        raise ValueError(f"s has shape {tuple(s.shape)}; expected contiguous {(R, C // block_size)}")
    out = torch.empty((R, C), dtype=out_dtype, device=q.device)
    n_blocks = R * C // block_size
    if n_blocks == 0:
        return out
    is_e5m2 = q.dtype == torch.float8_e5m2
    # smallest nonzero |q|: 2^-9 (e4m3) / 2^-16 (e5m2); q * 2^(s-127) >= 2^-126 iff s >= 10 / 17
    safe_s = 17 if is_e5m2 else 10
    cfg = _config("dequant")
    nb = _blocks_per_program(cfg.dequant_elems, block_size, n_blocks)
    _dequant_kernel[(triton.cdiv(n_blocks, nb),)](
        q.view(torch.uint8), s.view(torch.uint8), out, n_blocks, BS=block_size, NB=nb,
        IS_E5M2=is_e5m2, OUT_BF16=out_dtype == torch.bfloat16, SAFE_S=safe_s, SOFT=_soft_round(q.device),
        EVICT=cfg.evict, num_warps=cfg.dequant_warps,
    )
    return out
