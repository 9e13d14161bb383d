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


def check_offsets(offs: Tensor, rows: int, name: str = "a") -> None:
    """ValueError naming `offs` unless its (E,) cumulative group ends are non-negative, never
    decrease and stay within the `rows` rows of `name` (the grouped tensor): a negative or
    decreasing end, or one past the rows, would give rows to no group or to two and come out as
    zeros or garbage. Ends below `rows` are accepted (torch._grouped_mm's contract: the rows after
    offs[-1] belong to no group and give zeros; torchtitan pads its token buffer so).

    mx_grouped_mm and qdq check offsets that are on the host on every call; offsets on a GPU are not
    checked there (reading them is a host sync per call, in every MoE layer's forward): call this
    on them where a sync does not matter (a test, a debugging run)."""
    ends = offs.tolist()
    bad = next((e for e, v in enumerate(ends) if v < 0), None)
    if bad is not None:
        raise ValueError(f"offs[{bad}]={ends[bad]}: expected group ends >= 0 (offs={ends})")
    bad = next((e for e in range(1, len(ends)) if ends[e] < ends[e - 1]), None)
    if bad is not None:
        raise ValueError(
            f"offs[{bad}]={ends[bad]} < offs[{bad - 1}]={ends[bad - 1]}: expected non-decreasing cumulative "
            f"group ends (offs={ends})"
        )
    if ends and ends[-1] > rows:
        raise ValueError(
            f"offs[-1]={ends[-1]} is past the {rows} rows of {name}: expected group ends <= {rows} "
            f"(offs={ends})"
        )


__all__ = ["check_offsets", "group_padding", "in_groups", "pad_groups"]
