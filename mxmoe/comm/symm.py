"""The MXFP8 all-to-all through symmetric memory: quantize straight into the peers' buffers.

Why: over NCCL the exchange costs quantize + send + dequantize in series (or NCCL and the casts
fight for the same SMs and memory when overlapped); see docs/benchmarks.md. Here the quantize kernel
itself is the send: its stores go over NVLink into the receiving GPU's buffer, so the element and
scale bytes cross the link once, at the rate of the link, with no staging copy and no NCCL kernel.

One exchange on rank `me` of W ranks, with the split matrix M[src][dst] (rows src sends to dst)
known to every rank (from the checked plan, or one small all_gather):
  * Every rank has a workspace (torch symmetric memory, one per process group and device) of two
    halves used by alternate exchanges. A half holds the rows the rank receives, in the order of its
    output: elements (cap, C) then scales (cap, C // 32), where cap is the largest number of rows any
    rank receives (the same on every rank, so every rank computes the same layout).
  * The own rows never leave the GPU: on a side stream they are quantized and dequantized straight
    into their output rows (`qdq_into`; the dispatch quantizes them into its output).
  * For each peer p: the rows for p are quantized by the dim0 cast kernel with p's workspace as its
    output, at the rows where p's output keeps rank `me`'s rows.
  * A device-side barrier of the group (release/acquire at system scope): every rank's stores are
    done and visible.
  * The received rows are dequantized from the own workspace into the output (at most two launches:
    the rows before and after the own ones), or copied out for the dispatch.
Alternate halves make a barrier before the stores unnecessary: a rank writing half h of exchange n
has passed the barrier of exchange n-1, which every peer reached only after reading half h for
exchange n-2.

Every rank must make the same exchanges in the same order (as with any collective). The barrier
waits at most MXMOE_SYMM_TIMEOUT_MS milliseconds (default 300000), then traps: the process fails with
a CUDA error instead of hanging. NVLink multicast is never used (TORCH_SYMM_MEM_DISABLE_MULTICAST=1).
"""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from mxmoe.comm.kernels import dequantize_into, qdq_into
from mxmoe.comm.splits import BLOCK_SIZE, offsets
from mxmoe.formats import make_spec
from mxmoe.quant.kernels import backend, resolve_kernel

ELEM_DTYPE = torch.float8_e4m3fn
_SPEC = make_spec(BLOCK_SIZE, "rceil", ELEM_DTYPE)
_ALIGN = 256  # bytes: region starts
MIN_WORKSPACE_BYTES = 64 << 20
TIMEOUT_MS = int(os.environ.get("MXMOE_SYMM_TIMEOUT_MS", "300000"))


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


@dataclass(frozen=True)
class Layout:
    """Where one exchange's received rows live in a workspace half (bytes from the half's start)."""

    cap: int  # rows
    dim: int

    @property
    def q_bytes(self) -> int:
        return _align(self.cap * self.dim)

    @property
    def nbytes(self) -> int:
        return self.q_bytes + _align(self.cap * (self.dim // BLOCK_SIZE))

    def regions(self, buf: Tensor, base: int) -> tuple[Tensor, Tensor]:
        """(elements (cap, dim) uint8, scales (cap, dim // 32) uint8) in `buf` (1D uint8) at `base`."""
        q = buf[base : base + self.cap * self.dim].view(self.cap, self.dim)
        s0 = base + self.q_bytes
        s = buf[s0 : s0 + self.cap * (self.dim // BLOCK_SIZE)].view(self.cap, self.dim // BLOCK_SIZE)
        return q, s


class SymmWorkspace:
    """A symmetric-memory buffer of one process group on one device, with every rank's buffer mapped
    here (`buffers[r]`, 1D uint8) and the group's device barrier."""

    _cache: dict[tuple[str, int], SymmWorkspace] = {}
    _lock = threading.Lock()

    def __init__(self, group, device: torch.device) -> None:
        self.group = group
        self.device = device
        self.nbytes = 0
        self.buffers: list[Tensor] = []
        self._handle = None
        self._keep: list = []  # earlier buffers: peers may still hold mappings of them
        self._calls = 0

    @classmethod
    def get(cls, group, device: torch.device) -> SymmWorkspace:
        g = group if group is not None else dist.group.WORLD
        idx = device.index if device.index is not None else torch.cuda.current_device()
        key = (g.group_name, idx)
        with cls._lock:
            if key not in cls._cache:
                cls._cache[key] = cls(g, torch.device("cuda", idx))
            return cls._cache[key]

    def ensure(self, half_bytes: int) -> None:
        """Grow (collectively: every rank calls this with the same size) so that a half holds
        half_bytes."""
        need = 2 * _align(half_bytes)
        if need <= self.nbytes:
            return
        import torch.distributed._symmetric_memory as symm_mem

        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        size = max(MIN_WORKSPACE_BYTES, 1 << (need - 1).bit_length())
        # Nothing queued on this device may still use the old buffers' layout.
        torch.cuda.synchronize(self.device)
        if self._handle is not None:
            self._keep.append((self.buffers, self._handle))
        t = symm_mem.empty(size, dtype=torch.uint8, device=self.device)
        handle = symm_mem.rendezvous(t, self.group)
        self.buffers = [
            t if r == handle.rank else handle.get_buffer(r, (size,), torch.uint8)
            for r in range(handle.world_size)
        ]
        self._handle, self.nbytes, self._calls = handle, size, 0

    def next_base(self) -> int:
        """Byte offset of the half the next exchange uses (halves alternate)."""
        base = (self._calls % 2) * (self.nbytes // 2)
        self._calls += 1
        return base

    def barrier(self) -> None:
        self._handle.barrier(channel=0, timeout_ms=TIMEOUT_MS)


_usable: dict[str, bool] = {}


def symm_usable(group, device: torch.device) -> bool:
    """True when the symmetric-memory exchange can run for `group` on CUDA `device` here: torch has
    symmetric memory, the group's backend is NCCL, every rank is on this host, and Triton is
    installed (the dim0 cast kernel writes to peer memory; the CUDA extension would too). Decided
    from facts every rank shares (for the auto choice to agree)."""
    if device.type != "cuda" or not (dist.is_available() and dist.is_initialized()):
        return False
    g = group if group is not None else dist.group.WORLD
    key = g.group_name
    if key not in _usable:
        ok = True
        try:
            import torch.distributed._symmetric_memory  # noqa: F401
        except ImportError:
            ok = False
        ok = ok and "nccl" in str(dist.get_backend(g))
        try:
            import triton  # noqa: F401
        except ImportError:
            ok = False
        # one host: the group's size is at most the GPUs this process sees
        ok = ok and dist.get_world_size(g) <= torch.cuda.device_count()
        _usable[key] = ok
    return _usable[key]


def gather_matrix(input_splits, group, device: torch.device) -> tuple[tuple[int, ...], ...]:
    """M[r][p] = rows rank r sends to rank p, from every rank's input_splits (one all_gather)."""
    mine = torch.tensor(list(input_splits), dtype=torch.int64, device=device)
    world = mine.numel()
    out = torch.empty(world * world, dtype=torch.int64, device=device)
    dist.all_gather_into_tensor(out, mine, group=group)
    m = out.view(world, world).tolist()
    return tuple(tuple(r) for r in m)


def _ranges_without(n_rows: int, start: int, length: int) -> list[tuple[int, int]]:
    """[0, n_rows) minus [start, start + length), as (start, stop) pairs of nonempty ranges."""
    return [(a, b) for a, b in ((0, start), (start + length, n_rows)) if b > a]


def symm_mx_exchange(x: Tensor, matrix, me: int, ws, kernel: str, dequant: bool, self_qdq_impl: str = "auto"):
    """One MXFP8 exchange of x's rows (x (sum(matrix[me]), C), contiguous) through workspace `ws`
    (a SymmWorkspace, or any object with its `buffers`, `ensure`, `next_base` and `barrier`).

    Returns y (rows_out, C) in x.dtype (dequant) or (q (rows_out, C) e4m3, s (rows_out, C // 32)
    e8m0) in the output order: rows by source rank. Bit for bit the reference exchange."""
    world = len(matrix)
    dim = x.shape[1]
    sdim = dim // BLOCK_SIZE
    ins = matrix[me]
    outs = [matrix[s][me] for s in range(world)]
    in_off = offsets(ins)
    rows_out = sum(outs)
    recv_counts = [sum(matrix[s][r] for s in range(world)) for r in range(world)]
    layout = Layout(cap=max(recv_counts + [1]), dim=dim)
    ws.ensure(layout.nbytes)
    base = ws.next_base()
    quant_kernel = resolve_kernel(kernel, x.device, "dim0")
    cast = backend(quant_kernel)
    dev = x.device

    if dequant:
        y = torch.empty((rows_out, dim), dtype=x.dtype, device=dev)
    else:
        q_out = torch.empty((rows_out, dim), dtype=ELEM_DTYPE, device=dev)
        s_out = torch.empty((rows_out, sdim), dtype=torch.float8_e8m0fnu, device=dev)
    my_out = offsets(outs)[me]

    cuda = x.is_cuda
    side = None
    if cuda:
        cur = torch.cuda.current_stream(dev)
        side = _side_stream(dev)
        side.wait_stream(cur)
    n_self = ins[me]
    if n_self:
        xs = x[in_off[me] : in_off[me] + n_self]
        with torch.cuda.stream(side) if cuda else contextlib.nullcontext():
            if dequant:
                qdq_into(xs, y[my_out : my_out + n_self], kernel, impl=self_qdq_impl)
            else:
                cast.quantize_dim0(
                    xs, _SPEC, out=(q_out[my_out : my_out + n_self], s_out[my_out : my_out + n_self])
                )

    # The peers' rows, peer after peer in a staggered order (me+1, me+2, ...).
    peers = [(me + i) % world for i in range(1, world) if ins[(me + i) % world]]
    # The cast kernel stores straight into each peer's half, at the rows p's output keeps for me.
    for p in peers:
        n, at = ins[p], sum(matrix[s][p] for s in range(me))
        q_dst, s_dst = layout.regions(ws.buffers[p], base)
        cast.quantize_dim0(x[in_off[p] : in_off[p] + n], _SPEC, out=(q_dst[at : at + n], s_dst[at : at + n]))
    ws.barrier()

    q_loc, s_loc = layout.regions(ws.buffers[me], base)
    for a, b in _ranges_without(rows_out, my_out, n_self):
        if dequant:
            dequantize_into(q_loc[a:b], s_loc[a:b], y[a:b], kernel)
        else:
            q_out[a:b].view(torch.uint8).copy_(q_loc[a:b])
            s_out[a:b].view(torch.uint8).copy_(s_loc[a:b])
    if cuda:  # everything used on the side stream was allocated on (or before) `cur`, which waits
        cur.wait_stream(side)
    return y if dequant else (q_out, s_out)


_side_streams: dict[tuple[int, int], torch.cuda.Stream] = {}


def _side_stream(device: torch.device, which: int = 0) -> torch.cuda.Stream:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if (idx, which) not in _side_streams:
        _side_streams[idx, which] = torch.cuda.Stream(device=idx)
    return _side_streams[idx, which]
