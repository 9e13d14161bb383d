"""E8M0 scales in the layout Blackwell's block-scaled tensor cores read ("swizzled", torchao's
`is_swizzled_scales`; "blocked" in mxmoe means only storage with each block's elements contiguous).

A plain scale matrix (R, C) (one scale per 32 elements along a row: C = K // 32) is padded to
(roundup(R, 128), roundup(C, 4)) with zeros and cut into 128x4 tiles, stored tile after tile (tile
(i, j) at flat offset (i * C4 / 4 + j) * 512, row-major over tiles); inside a tile the 128 rows are
four groups of 32 and row r, column c sits at (r % 32) * 16 + (r // 32) * 4 + c, i.e. the tile is
rearranged as 32x16 (cuBLAS's "1D block scaling factors layout", what torch._scaled_mm and
torch._scaled_grouped_mm take with E8M0 scales, `SCALE_DTYPE`).

Grouped operands (torch._scaled_grouped_mm), groups of a token dim given by `offs`:
  * groups along the rows (`to_swizzled_m_groups`: a dim0 cast of tokens (T, K), forward/dgrad):
    every group's rows are swizzled on their own, each group starting at the next multiple of 128
    rows; result (R + 128 E, C4), the rows after the last group zero.
  * groups along the scale columns (`to_swizzled_k_groups`: a dim1 cast of tokens, stored (N, T),
    scales (N, T // 32), wgrad): every group's columns are swizzled on their own (its columns padded
    to 4), group g's tiles at flat offset start_g * roundup(R, 128), start_g the group's first
    padded column; result (roundup(R, 128), C + 4 E). Group sizes in scale columns.
  * 3D weights (E, R, C): each matrix swizzled on its own (`to_swizzled`).
Nothing syncs with the host: the grouped layouts scatter rows, columns and whole tiles with
indices computed on the device (one index per row, column or tile, not per scale).
"""

from __future__ import annotations

import torch
from torch import Tensor

SCALE_LAYOUTS = ("plain", "swizzled")
RENAMED_SCALE_LAYOUTS = {"blocked": "swizzled"}
"""Old scale_layout values, refused with the new one named."""
RENAMED = {
    "to_blocked": "to_swizzled", "from_blocked": "from_swizzled", "blocked_shape": "swizzled_shape",
    "to_blocked_m_groups": "to_swizzled_m_groups", "to_blocked_k_groups": "to_swizzled_k_groups",
    "from_blocked_m_groups": "from_swizzled_m_groups", "from_blocked_k_groups": "from_swizzled_k_groups",
}
"""Old function names of this module -> the new ones (an AttributeError names the new one)."""
TILE_ROWS, TILE_COLS = 128, 4


def _roundup(n: int, m: int) -> int:
    return -(-n // m) * m


def swizzled_shape(rows: int, cols: int) -> tuple[int, int]:
    """The (rows, cols) of a plain (rows, cols) scale matrix in the swizzled layout."""
    return _roundup(rows, TILE_ROWS), _roundup(cols, TILE_COLS)


def check_scale_layout(scale_layout: str) -> str:
    """`scale_layout` if it is one of SCALE_LAYOUTS, else a ValueError naming it (and, for an old
    spelling, the new one)."""
    if scale_layout not in SCALE_LAYOUTS:
        new = RENAMED_SCALE_LAYOUTS.get(scale_layout) if isinstance(scale_layout, str) else None
        now = f" (scale_layout={scale_layout!r} is now scale_layout={new!r})" if new else ""
        raise ValueError(
            f"scale_layout={scale_layout!r} is not a scale layout; expected one of {list(SCALE_LAYOUTS)}{now}"
        )
    return scale_layout


def to_swizzled(scale: Tensor) -> Tensor:
    """Plain scales (..., R, C) (any dtype of one byte, e.g. e8m0) -> (..., R128, C4),
    R128 = roundup(R, 128), C4 = roundup(C, 4), contiguous, each matrix in the swizzled layout (its
    flat bytes are the tiles in order; padding zero)."""
    *lead, R, C = scale.shape
    R128, C4 = swizzled_shape(R, C)
    x = scale.view(torch.uint8)  # (zero padding and copies in bytes: e8m0 has few kernels on CPU)
    if (R128, C4) != (R, C):
        x = x.new_zeros(*lead, R128, C4)
        x[..., :R, :C] = scale.view(torch.uint8)
    nb = len(lead)
    # (.., R128/128, 4, 32, C4/4, 4) -> (.., R128/128, C4/4, 32, 4, 4): tile-major, then row % 32,
    # row // 32, column
    t = x.reshape(*lead, R128 // 128, 4, 32, C4 // 4, 4)
    t = t.permute(*range(nb), nb, nb + 3, nb + 2, nb + 1, nb + 4)
    return t.reshape(*lead, R128, C4).view(scale.dtype)


def from_swizzled(swizzled: Tensor, rows: int, cols: int) -> Tensor:
    """The inverse of `to_swizzled`: (..., R128, C4) swizzled -> (..., rows, cols) plain, contiguous."""
    *lead, R128, C4 = swizzled.shape
    nb = len(lead)
    t = swizzled.view(torch.uint8).reshape(*lead, R128 // 128, C4 // 4, 32, 4, 4)
    t = t.permute(*range(nb), nb, nb + 3, nb + 2, nb + 1, nb + 4).reshape(*lead, R128, C4)
    return t[..., :rows, :cols].contiguous().view(swizzled.dtype)


def _tile_offset(r: Tensor, c: Tensor, tiles_per_row: Tensor | int) -> Tensor:
    """Flat offset of (row r, column c) in a swizzled matrix with `tiles_per_row` tiles per row of
    tiles (int64 tensors)."""
    within = (r % 32) * 16 + (r % 128 // 32) * 4 + c % 4
    return (r // 128 * tiles_per_row + c // 4) * 512 + within


def _group_of(offs: Tensor, n: int) -> tuple[Tensor, Tensor, Tensor]:
    """For each of n indices: its group (E for those at or after offs[-1]), its index within the
    group, and each group's start after padding every group to whole tiles (see callers)."""
    ends = offs.to(torch.int64)
    idx = torch.arange(n, device=offs.device)
    g = torch.searchsorted(ends, idx, right=True)
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    local = idx - starts[g.clamp(max=ends.shape[0] - 1)]
    return g, local, starts


def _padded_starts(offs: Tensor, multiple: int) -> Tensor:
    """(E + 1,) int64: the start of each group when each is padded to a multiple, then the end."""
    ends = offs.to(torch.int64)
    sizes = torch.diff(ends, prepend=ends.new_zeros(1))
    padded = (sizes + multiple - 1) // multiple * multiple
    return torch.cat([padded.new_zeros(1), torch.cumsum(padded, 0)])


def to_swizzled_m_groups(scale: Tensor, offs: Tensor) -> Tensor:
    """Plain scales (R, C) of tokens grouped along the rows (offs (E,) int cumulative row ends)
    -> (R + 128 E, C4) in the swizzled layout per group: group g's rows swizzled on their own from
    row start_g = sum over earlier groups of roundup(size, 128). Rows at or after offs[-1] are in
    no group and are left out; everything not written is zero."""
    dtype, scale = scale.dtype, scale.view(torch.uint8)  # (index_copy takes bytes, not e8m0)
    R, C = scale.shape
    E = offs.shape[0]
    F = R + 128 * E
    # every group starts on a tile boundary, so blocking the whole frame of row-scattered groups
    # blocks each group on its own; the groups end by row R + 127 E < F (row F - 1 stays zero:
    # where the rows of no group go), so the frame's first F rows of tiles are the result
    g, local, _ = _group_of(offs, R)
    fr = torch.where(g < E, _padded_starts(offs, TILE_ROWS)[g.clamp(max=E - 1)] + local, F - 1)
    src = torch.where((g < E)[:, None], scale, scale.new_zeros(()))
    frame = scale.new_zeros(_roundup(F, TILE_ROWS), C).index_copy_(0, fr, src)
    C4 = _roundup(C, TILE_COLS)
    return to_swizzled(frame).view(-1)[: F * C4].view(F, C4).view(dtype)


def to_swizzled_k_groups(scale: Tensor, offs: Tensor) -> Tensor:
    """Plain scales (R, C) whose columns are grouped (offs (E,) int cumulative column ends, in
    scale columns: token offsets // 32) -> (R128, C + 4 E) in the swizzled layout per group: group
    g's columns swizzled on their own (padded to 4), its tiles at flat offset start_g * R128,
    start_g = sum over earlier groups of roundup(size, 4). Columns at or after offs[-1] are left
    out; everything not written is zero."""
    dtype, scale = scale.dtype, scale.view(torch.uint8)
    R, C = scale.shape
    E = offs.shape[0]
    R128 = _roundup(R, TILE_ROWS)
    Cf = _roundup(C + 4 * E, TILE_COLS)
    # scatter the columns to a frame where every group starts on a tile boundary (the column
    # Cf - 1 stays zero: where the columns of no group go; the groups end by column C + 3 E),
    # cut it into tiles, then move whole tiles: group g's tiles are row-major over its own tiles
    g, local, _ = _group_of(offs, C)
    pstart = _padded_starts(offs, TILE_COLS)
    fc = torch.where(g < E, pstart[g.clamp(max=E - 1)] + local, Cf - 1)
    src = torch.where((g < E)[None, :], scale, scale.new_zeros(()))
    frame = scale.new_zeros(R128, Cf)
    frame[:R].index_copy_(1, fc, src)
    tiles = to_swizzled(frame).view(R128 // 128, Cf // 4, 512)
    cb = torch.arange(Cf // 4, device=scale.device)
    tg = torch.searchsorted(pstart[1:] // 4, cb, right=True)  # each frame tile column's group
    tgc = tg.clamp(max=E - 1)
    width = (pstart[tgc + 1] - pstart[tgc]) // 4
    rb = torch.arange(R128 // 128, device=scale.device)[:, None]
    n_out = R128 * (C + 4 * E)
    n_tiles = -(-n_out // 512) + 1  # + 1: where the tiles of no group go
    dest = (pstart[tgc] * R128 // 512)[None, :] + rb * width[None, :] + (cb - pstart[tgc] // 4)[None, :]
    dest = torch.where((tg < E)[None, :], dest, n_tiles - 1)
    out = scale.new_zeros(n_tiles, 512).index_copy_(0, dest.reshape(-1), tiles.reshape(-1, 512))
    return out.view(-1)[:n_out].view(R128, C + 4 * E).view(dtype)


def from_swizzled_m_groups(swizzled: Tensor, offs: Tensor, rows: int, cols: int) -> Tensor:
    """The inverse of `to_swizzled_m_groups` -> (rows, cols) plain; rows in no group get scale
    byte 0 (their elements are zero where the ops make such operands)."""
    E = offs.shape[0]
    C4 = swizzled.shape[1]
    g, local, _ = _group_of(offs, rows)
    fr = _padded_starts(offs, TILE_ROWS)[g.clamp(max=E - 1)] + local
    src = _tile_offset(fr[:, None], torch.arange(cols, device=offs.device)[None, :], C4 // 4)
    flat = torch.cat([swizzled.reshape(-1).view(torch.uint8), swizzled.new_zeros(1, dtype=torch.uint8)])
    src = torch.where((g < E)[:, None], src, flat.numel() - 1)
    return flat[src].view(swizzled.dtype)


def from_swizzled_k_groups(swizzled: Tensor, offs: Tensor, rows: int, cols: int) -> Tensor:
    """The inverse of `to_swizzled_k_groups` -> (rows, cols) plain; columns in no group get scale
    byte 0."""
    E = offs.shape[0]
    R128 = swizzled.shape[0]
    g, local, _ = _group_of(offs, cols)
    pstart = _padded_starts(offs, TILE_COLS)
    gc = g.clamp(max=E - 1)
    tiles_per_row = (pstart[gc + 1] - pstart[gc]) // 4
    r = torch.arange(rows, device=offs.device)
    src = pstart[gc][None, :] * R128 + _tile_offset(r[:, None], local[None, :], tiles_per_row[None, :])
    flat = torch.cat([swizzled.reshape(-1).view(torch.uint8), swizzled.new_zeros(1, dtype=torch.uint8)])
    src = torch.where((g < E)[None, :], src, flat.numel() - 1)
    return flat[src].view(swizzled.dtype)


def __getattr__(name: str):
    if name in RENAMED:
        raise AttributeError(f"mxmoe.quant.scale_layout.{name} is now {RENAMED[name]}")
    raise AttributeError(f"module 'mxmoe.quant.scale_layout' has no attribute {name!r}")


__all__ = [
    "SCALE_LAYOUTS",
    "check_scale_layout",
    "from_swizzled",
    "from_swizzled_k_groups",
    "from_swizzled_m_groups",
    "to_swizzled",
    "to_swizzled_k_groups",
    "to_swizzled_m_groups",
    "swizzled_shape",
]
