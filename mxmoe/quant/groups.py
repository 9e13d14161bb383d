"""Expert groups padded to whole blocks: where each token goes when every group of rows starts at a
multiple of the block size (no host sync; static padded size, so torch.compile sees fixed shapes).

Used by the MX path of `mxmoe.ops.mx_grouped_mm` (its wgrad casts along M run on such a padded
copy) and by the torch reference of the group-aware quantize-dequantize (`mxmoe.quant.qdq` with
`offs`), which is defined as: pad the groups, cast along M, dequantize, gather the real rows.
"""

from __future__ import annotations

import torch
from torch import Tensor


def group_padding(offs: Tensor, rows: int, block_size: int) -> tuple[Tensor, Tensor, int]:
    """Where each of `rows` tokens goes when every group starts at a multiple of `block_size`.

    offs: (E,) int cumulative group ends. Returns pos (rows,) int64 destination rows, offs_pad (E,)
    int32 padded cumulative ends, and the padded size roundup(rows + block_size E, block_size)
    (torchao's padded copy, the same size and group starts). Rows at or after offs[-1] (in no
    group) go to the tail, after the last padded group (in no group of offs_pad), and are zeroed
    by `pad_groups`.
    """
    E = offs.shape[0]
    cap = -(-(rows + block_size * E) // block_size) * block_size
    ends = offs.to(torch.int64)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    padded = (counts + block_size - 1) // block_size * block_size
    ends_pad = torch.cumsum(padded, 0)
    t = torch.arange(rows, device=offs.device)
    g = torch.searchsorted(ends, t, right=True)
    gc = g.clamp(max=E - 1)
    pos = (ends_pad - padded)[gc] + t - (ends - counts)[gc]
    pos = torch.where(g < E, pos, ends_pad[-1] + t - ends[-1])
    offs_pad = ends_pad.to(torch.int32)
    return pos, offs_pad, cap


def in_groups(offs: Tensor, rows: int) -> Tensor:
    """(rows, 1) bool: whether each row is in a group (row < offs[-1]), without a host sync."""
    return (torch.arange(rows, device=offs.device) < offs[-1].to(torch.int64)).unsqueeze(1)


def pad_groups(x: Tensor, offs: Tensor, pos: Tensor, cap: int) -> Tensor:
    """x (T, C) -> (cap, C): row t moved to pos[t], gaps zero, rows outside every group zeroed."""
    src = torch.where(in_groups(offs, x.shape[0]), x, torch.zeros((), dtype=x.dtype, device=x.device))
    return x.new_zeros(cap, x.shape[1]).index_copy(0, pos, src)


__all__ = ["group_padding", "in_groups", "pad_groups"]
