"""The symmetric-memory exchange emulated on CPU (`symm_mx_exchange(..., impl="python")`): one rank's
work items in the kernel's ticket order, with torch casts, flag stores and flag waits on plain tensors.
It is the protocol's reference: tests run W ranks as threads of one process over workspaces that
every thread can write, as NVLink peers can (tests/comm/test_symm.py).
"""

from __future__ import annotations

import time

import torch
from torch import Tensor

from mxmoe.comm.kernels import dequantize_into, qdq_into
from mxmoe.comm.symm_layout import (
    BLOCK_SIZE,
    ELEM_DTYPE,
    FORMAT,
    SPEC,
    TILE_BLOCKS,
    Items,
    Layout,
    timeout_error,
)
from mxmoe.quant.backends import cast_fn, resolve_kernel

FAST_BIT = 1 << 31
"""A flag's bit 31: every scale byte of the item is >= 10 (the dequantize's fast path holds)."""


def emulate_exchange(
    x: Tensor,
    outputs: tuple[Tensor, ...],
    items: Items,
    epoch: int,
    kernel: str,
    dequant: bool,
    lay: Layout,
    ws,
    base: int,
    me: int,
    *,
    fast_bit: bool,
    timeout_ms: int,
) -> None:
    """The exchange kernel's work items in ticket order, with torch casts (CPU): the protocol's
    reference (tests run W ranks as threads over plain tensors). Slots are views of ws.buffers.

    x: (rows, C) bf16/fp32 rows of this rank, contiguous; outputs: (y,) in x.dtype (dequant) or
    (q e4m3 (rows_out, C), s e8m0 (rows_out, C // 32)), written in place. fast_bit: flags carry
    FAST_BIT (`mxmoe.comm.symm._FAST_BIT_FLAGS`); a deferred receive waits at most timeout_ms per
    flag, then raises RuntimeError."""
    world = lay.world
    peers = [(me + 1 + i) % world for i in range(world - 1)]
    st_slots = [lay.slot(ws.buffers[p], base, me, p) for p in peers]
    rc_slots = [lay.slot(ws.buffers[me], base, (me - 1 - i) % world, me) for i in range(world - 1)]
    quant = cast_fn(resolve_kernel(kernel, x.device, "dim0"), "dim0")
    xb = x.view(-1, BLOCK_SIZE)  # blocks of 32, in order

    def eb(t: Tensor, b0: int, n: int) -> Tensor:  # blocks b0..b0+n of rows (R, C): (n, 32)
        return t.reshape(-1, BLOCK_SIZE)[b0 : b0 + n]

    def sb(t: Tensor, b0: int, n: int) -> Tensor:  # their scales in (R, C // 32): (n, 1)
        return t.reshape(-1, 1)[b0 : b0 + n]

    def where(start: list[int], k: int) -> tuple[int, int]:
        i = sum(k >= v for v in start[1:-1])
        return i, k - start[i]

    per = items.per_item
    span = per * TILE_BLOCKS  # blocks of an item

    def flags(nblk: int, kk: int) -> range:  # the flag tiles of item kk of a pair of nblk blocks
        return range(kk * per, min((kk + 1) * per, max(1, -(-nblk // TILE_BLOCKS))))

    def landed(flag: int) -> bool:  # a flag read (acquire) holds this exchange's epoch
        return (flag & (FAST_BIT - 1) if fast_bit else flag) == epoch

    def receive(i: int, kk: int) -> None:
        b0, nblk = kk * span, items.row("rc_nblk")[i]
        n = max(0, min(span, nblk - b0))
        q_src, s_src, _ = rc_slots[i]
        if n:
            y0 = items.row("rc_yblk")[i] + b0
            qv, sv = eb(q_src, b0, n), sb(s_src, b0, n)
            if dequant:
                dequantize_into(qv, sv, eb(outputs[0], y0, n), kernel)
            else:
                eb(outputs[0], y0, n).view(torch.uint8).copy_(qv)
                sb(outputs[1], y0, n).view(torch.uint8).copy_(sv)

    deferred = []
    for t in range(items.front):
        kind, k = items.kind(t)
        if kind == "store":
            i, kk = where(items.row("st_start"), k)
            b0, nblk = kk * span, items.row("st_nblk")[i]
            n = max(0, min(span, nblk - b0))
            q_dst, s_dst, f_dst = st_slots[i]
            if n:
                x0 = items.row("st_xblk")[i] + b0
                out = (eb(q_dst, b0, n).view(ELEM_DTYPE), sb(s_dst, b0, n).view(FORMAT.scale_dtype))
                quant(xb[x0 : x0 + n], SPEC, out=out)
            value = epoch
            if fast_bit and (n == 0 or int(out[1].view(torch.uint8).min()) >= 10):
                value = epoch - FAST_BIT  # epoch | FAST_BIT as an int32
            for f in flags(nblk, kk):  # after the item's stores (release)
                f_dst[f] = value
        elif kind == "own":
            b0 = k * span
            n = min(span, items.own_nblk - b0)
            x0, y0 = items.own_xblk + b0, items.own_yblk + b0
            if dequant:
                qdq_into(xb[x0 : x0 + n], eb(outputs[0], y0, n), kernel)
            else:
                quant(xb[x0 : x0 + n], SPEC, out=(eb(outputs[0], y0, n), sb(outputs[1], y0, n)))
        else:  # a receive in the front: only if landed (acquire), else deferred
            i, kk = where(items.row("rc_start"), k)
            if all(landed(int(rc_slots[i][2][f])) for f in flags(items.row("rc_nblk")[i], kk)):
                receive(i, kk)
            else:
                deferred.append((i, kk))
    for i, kk in deferred:  # the back: wait for each flag of each deferred item
        for f in flags(items.row("rc_nblk")[i], kk):
            deadline = time.monotonic() + timeout_ms / 1000
            while not landed(int(rc_slots[i][2][f])):  # acquire
                if time.monotonic() > deadline:
                    raise timeout_error(i << 32 | f, timeout_ms)
                time.sleep(1e-4)
        receive(i, kk)
