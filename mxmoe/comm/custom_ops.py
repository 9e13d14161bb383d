"""The expert-parallel exchange as torch.library custom ops, so that torch.compile traces a MoE
layer through it: each collective is one opaque op with a fake implementation, and its row splits
stay tensors (read on the host inside the op, where it runs eagerly), so the graph needs no
`.tolist()` and no break around the exchange.

    mxmoe::a2a_counts(counts, group)                       all-to-all of equal chunks (the counts)
    mxmoe::a2a_rows(x, send, recv, group, transport, out_rows)     rows in their own dtype
    mxmoe::a2a_mxfp8(x, send, recv, group, transport, fmt, kernel, chunks, out_rows) -> (q, s)
    mxmoe::a2a_mxfp8_dequant(...)                          the same, dequantized to x.dtype

x: (rows_in, dim) rows ordered by destination; send, recv: (world,) integer tensors (any device),
the rows sent to and received from each rank; group: the process group's name ("" without
torch.distributed); transport: "auto" or a registered name (`mxmoe.comm.transport`), chosen here,
outside any traced code. fmt: the rows' format by its registered name (`mxmoe.formats.FORMATS`);
kernel: the concrete cast kernel. out_rows: the received row count where the caller knows it (a combine or a
backward: the rows it sent before), else None, and the fake output's rows are a new symbolic size.
The ops carry no autograd: the dispatchers' autograd functions (`mxmoe.token_dispatch`) pair them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from mxmoe.comm.a2a import _exchange_unquantized, mx_exchange
from mxmoe.comm.transport import Plan, group_rank_world, resolve_group
from mxmoe.formats import get_format


def _host(splits: Tensor) -> list[int] | None:
    return getattr(splits, "_mxmoe_host_splits", None)


def _plan(x: Tensor, send: Tensor, recv: Tensor, group: str):
    """(Plan, process group) of one exchange. The split tensors are read on the host once: the
    values are kept on the tensors, which a dispatch hands unchanged to its combine and to both
    backward exchanges (each read would be a device-to-host sync)."""
    g = resolve_group(group)
    rank, world = group_rank_world(g)
    ins, outs = _host(send), _host(recv)
    if ins is None or outs is None:
        if send.device == recv.device:
            ins, outs = torch.stack((send, recv)).tolist()
        else:
            ins, outs = send.tolist(), recv.tolist()
        send._mxmoe_host_splits, recv._mxmoe_host_splits = ins, outs
    failed = [p for p, n in enumerate(outs) if n < 0]
    if failed:  # counts of -1: those ranks' dispatch refused its inputs (the error is theirs)
        raise ValueError(
            f"expert-parallel exchange: rank(s) {failed} could not dispatch (their inputs were refused; "
            "the error names them on those ranks); nothing was exchanged"
        )
    if len(ins) != world or len(outs) != world or sum(ins) != x.shape[0]:
        raise ValueError(
            f"exchange splits send={ins}, recv={outs} do not fit {world} ranks and x.shape[0]={x.shape[0]}"
        )
    return Plan(rank, world, tuple(ins), tuple(outs), tuple(x.shape[1:])), g


def _rows(out_rows: int | None):
    return torch.library.get_ctx().new_dynamic_size() if out_rows is None else out_rows


@torch.library.custom_op("mxmoe::a2a_counts", mutates_args=())
def a2a_counts(counts: Tensor, group: str) -> Tensor:
    """counts (world * n,) integers, chunk p for rank p -> (world * n,): chunk p from rank p."""
    g = resolve_group(group)
    if g is None and not (dist.is_available() and dist.is_initialized()):
        return counts.clone()
    out = torch.empty_like(counts)
    dist.all_to_all_single(out, counts.contiguous(), group=g)
    return out


@a2a_counts.register_fake
def _(counts, group):
    return torch.empty_like(counts)


@torch.library.custom_op("mxmoe::a2a_rows", mutates_args=())
def a2a_rows(
    x: Tensor, send: Tensor, recv: Tensor, group: str, transport: str, out_rows: int | None
) -> Tensor:
    """x's rows moved in their own dtype (module docstring)."""
    plan, g = _plan(x, send, recv, group)
    return _exchange_unquantized(x, plan, g, transport)


@a2a_rows.register_fake
def _(x, send, recv, group, transport, out_rows):
    return x.new_empty((_rows(out_rows), *x.shape[1:]))


@torch.library.custom_op("mxmoe::a2a_mxfp8", mutates_args=())
def a2a_mxfp8(
    x: Tensor,
    send: Tensor,
    recv: Tensor,
    group: str,
    transport: str,
    fmt: str,
    kernel: str,
    chunks: int,
    out_rows: int | None,
) -> tuple[Tensor, Tensor]:
    """x (rows_in, dim) bf16/fp32 quantized along dim in the registered format `fmt` (cast kernel
    `kernel`, concrete), moved as element and scale bytes: (q (rows_out, dim) fmt's elem_dtype,
    s (rows_out, dim // block_size) fmt's scale_dtype). chunks: -1 = None."""
    plan, g = _plan(x, send, recv, group)
    return mx_exchange(x, plan, g, get_format(fmt), kernel, False, None if chunks < 0 else chunks, transport)


@a2a_mxfp8.register_fake
def _(x, send, recv, group, transport, fmt, kernel, chunks, out_rows):
    f, rows = get_format(fmt), _rows(out_rows)
    q = x.new_empty((rows, x.shape[1]), dtype=f.elem_dtype)
    return q, x.new_empty((rows, x.shape[1] // f.block_size), dtype=f.scale_dtype)


@torch.library.custom_op("mxmoe::a2a_mxfp8_dequant", mutates_args=())
def a2a_mxfp8_dequant(
    x: Tensor,
    send: Tensor,
    recv: Tensor,
    group: str,
    transport: str,
    fmt: str,
    kernel: str,
    chunks: int,
    out_rows: int | None,
) -> Tensor:
    """`a2a_mxfp8`, dequantized on arrival: (rows_out, dim) x.dtype."""
    plan, g = _plan(x, send, recv, group)
    return mx_exchange(x, plan, g, get_format(fmt), kernel, True, None if chunks < 0 else chunks, transport)


@a2a_mxfp8_dequant.register_fake
def _(x, send, recv, group, transport, fmt, kernel, chunks, out_rows):
    return x.new_empty((_rows(out_rows), x.shape[1]))
