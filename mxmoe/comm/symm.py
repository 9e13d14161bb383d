"""The MXFP8 all-to-all through symmetric memory: quantize straight into the peers' buffers.

Why: over NCCL the exchange costs quantize + send + dequantize in series (or NCCL and the casts
fight for the same SMs and memory when overlapped); see docs/benchmarks.md. Here the quantize kernel
itself is the send: its stores go over NVLink into the receiving GPU's buffer, so the element and
scale bytes cross the link once, at the rate of the link, with no staging copy and no NCCL kernel.

Layout. Every rank has a workspace (torch symmetric memory, one per process group and device, size
MXMOE_SYMM_WORKSPACE_MB, default 1024) of two halves used by alternate exchanges. A half has one slot
per peer; a slot holds up to `slot_rows` rows (elements (slot_rows, C), then scales (slot_rows, C//32)).
Rows from source s sit in slot (s - r - 1) mod W of receiver r, from row 0. So a rank needs only its
own splits: where its rows go in a peer, and where a peer's rows are in its own slots, follow from
the ranks alone (no split matrix, no collective, no host sync).

One exchange on rank `me` of W ranks:
  * For each peer p (staggered: me+1, me+2, ...): the dim0 cast kernel stores the rows for p into
    p's slot for `me` (one program per tile: NVLink stores need many SMs in flight).
  * Then, on a side stream, the own rows are quantized and dequantized straight into their output
    rows (`qdq_into`; the dispatch quantizes them into its output).
  * A pair whose rows exceed slot_rows (both ends see it: it is input_splits[p] on one side and
    output_splits[me] on the other) goes through NCCL send/recv instead.
  * A device-side barrier of the group (the symmetric memory handle's): every rank's stores are done
    and visible.
  * Each received slot is dequantized into its output rows (or copied out, for the dispatch).
Alternate halves make a barrier before the stores unnecessary: a rank writing half h of exchange n
has passed the barrier of exchange n-1, which every peer reached only after reading half h for
exchange n-2.

Every rank must make the same exchanges in the same order (as with any collective), with consistent
splits. The barrier waits at most MXMOE_SYMM_TIMEOUT_MS milliseconds (default 300000), then traps:
the process fails with a CUDA error instead of hanging. NVLink multicast is never used
(TORCH_SYMM_MEM_DISABLE_MULTICAST=1).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from mxmoe.comm.kernels import dequantize_into, qdq_into
from mxmoe.comm.splits import BLOCK_SIZE, offsets
from mxmoe.formats import make_spec
from mxmoe.quant.backends import cast_fn, resolve_kernel

ELEM_DTYPE = torch.float8_e4m3fn
_SPEC = make_spec(BLOCK_SIZE, "rceil", ELEM_DTYPE)
_ALIGN = 256  # bytes: region starts
WORKSPACE_BYTES = int(os.environ.get("MXMOE_SYMM_WORKSPACE_MB", "1024")) << 20
TIMEOUT_MS = int(os.environ.get("MXMOE_SYMM_TIMEOUT_MS", "300000"))


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def halves_bytes(nbytes: int) -> int:
    """Bytes of one workspace half."""
    return nbytes // 2 // _ALIGN * _ALIGN


@dataclass(frozen=True)
class Layout:
    """The slots of one workspace half for rows of `dim` elements among `world` ranks."""

    world: int
    dim: int
    half_bytes: int

    @property
    def slot_rows(self) -> int:
        per_row = self.dim + self.dim // BLOCK_SIZE
        slots = max(1, self.world - 1)
        return max(0, (self.half_bytes // slots - 2 * _ALIGN) // per_row)

    @property
    def slot_bytes(self) -> int:
        return self.half_bytes // max(1, self.world - 1) // _ALIGN * _ALIGN

    def slot(self, buf: Tensor, base: int, src: int, dst: int) -> tuple[Tensor, Tensor]:
        """Slot of source rank `src` in receiver `dst`'s half at byte `base` of `buf` (1D uint8, dst's
        workspace): (elements (slot_rows, dim) uint8, scales (slot_rows, dim // 32) uint8)."""
        n, d, sd = self.slot_rows, self.dim, self.dim // BLOCK_SIZE
        start = base + ((src - dst - 1) % self.world) * self.slot_bytes
        q = buf[start : start + n * d].view(n, d)
        s0 = start + _align(n * d)
        return q, buf[s0 : s0 + n * sd].view(n, sd)


class SymmWorkspace:
    """A symmetric-memory buffer of one process group on one device, with every rank's buffer mapped
    here (`buffers[r]`, 1D uint8), the group's device barrier, and NCCL send/recv for the rows that
    do not fit."""

    _cache: dict[tuple[str, int], SymmWorkspace] = {}
    _lock = threading.Lock()

    def __init__(self, group, device: torch.device) -> None:
        self.group = group
        self.device = device
        self.nbytes = 0
        self.buffers: list[Tensor] = []
        self._handle = None
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

    def ensure(self) -> None:
        """Allocate and map the workspace (collective: the first exchange of every rank calls it)."""
        if self._handle is not None:
            return
        import torch.distributed._symmetric_memory as symm_mem

        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        if WORKSPACE_BYTES < 2 * _ALIGN:
            raise ValueError(
                f"MXMOE_SYMM_WORKSPACE_MB gives {WORKSPACE_BYTES} bytes; expected at least {2 * _ALIGN}"
            )
        t = symm_mem.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        handle = symm_mem.rendezvous(t, self.group)
        self.buffers = [
            t if r == handle.rank else handle.get_buffer(r, (WORKSPACE_BYTES,), torch.uint8)
            for r in range(handle.world_size)
        ]
        self._handle, self.nbytes = handle, WORKSPACE_BYTES

    def next_epoch(self) -> int:
        """Number of the next exchange (1, 2, ...): its half is (epoch - 1) % 2."""
        self._calls += 1
        return self._calls

    def barrier(self) -> None:
        """Every rank's work queued so far is done and visible (the symmetric-memory handle's device
        barrier; it traps after MXMOE_SYMM_TIMEOUT_MS: the process fails instead of hanging)."""
        self._handle.barrier(channel=0, timeout_ms=TIMEOUT_MS)

    def send_recv(self, sends: dict[int, tuple[Tensor, ...]], recvs: dict[int, tuple[Tensor, ...]]) -> None:
        """NCCL point-to-point: sends[p] to group rank p, recvs[s] from group rank s (the current
        stream waits for them)."""
        ops = []
        for p, ts in sends.items():
            ops += [dist.P2POp(dist.isend, t, dist.get_global_rank(self.group, p), self.group) for t in ts]
        for s, ts in recvs.items():
            ops += [dist.P2POp(dist.irecv, t, dist.get_global_rank(self.group, s), self.group) for t in ts]
        for w in dist.batch_isend_irecv(ops) if ops else []:
            w.wait()


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



def symm_mx_exchange(
    x: Tensor, input_splits, output_splits, me: int, ws, kernel: str, dequant: bool,
    self_qdq_impl: str = "auto",
):
    """One MXFP8 exchange of x's rows (x (sum(input_splits), C), contiguous) through workspace `ws`
    (a SymmWorkspace, or any object with its `buffers`, `nbytes`, `ensure`, `next_epoch`, `barrier`
    and `send_recv`).

    Returns y (sum(output_splits), C) in x.dtype (dequant) or (q e4m3, s e8m0) rows, in the output
    order (rows by source rank). Bit for bit the reference exchange."""
    world = len(input_splits)
    dim = x.shape[1]
    sdim = dim // BLOCK_SIZE
    ins, outs = list(input_splits), list(output_splits)
    in_off, out_off = offsets(ins), offsets(outs)
    rows_out = sum(outs)
    ws.ensure()
    half = halves_bytes(ws.nbytes)
    lay = Layout(world, dim, half)
    cap = lay.slot_rows
    epoch = ws.next_epoch()
    base = ((epoch - 1) % 2) * half
    quant = cast_fn(resolve_kernel(kernel, x.device, "dim0"), "dim0")
    dev = x.device
    cuda = x.is_cuda

    if dequant:
        y = torch.empty((rows_out, dim), dtype=x.dtype, device=dev)
    else:
        q_out = torch.empty((rows_out, dim), dtype=ELEM_DTYPE, device=dev)
        s_out = torch.empty((rows_out, sdim), dtype=torch.float8_e8m0fnu, device=dev)

    def own_rows() -> None:
        n_self = ins[me]
        if n_self:
            xs = x[in_off[me] : in_off[me] + n_self]
            o0 = out_off[me]
            if dequant:
                qdq_into(xs, y[o0 : o0 + n_self], kernel, impl=self_qdq_impl)
            else:
                quant(xs, _SPEC, out=(q_out[o0 : o0 + n_self], s_out[o0 : o0 + n_self]))

    def land(q_in: Tensor, s_in: Tensor, o0: int) -> None:
        """Received rows (uint8 views) into output rows o0..."""
        n = q_in.shape[0]
        if dequant:
            dequantize_into(q_in, s_in, y[o0 : o0 + n], kernel)
        else:
            q_out[o0 : o0 + n].view(torch.uint8).copy_(q_in)
            s_out[o0 : o0 + n].view(torch.uint8).copy_(s_in)

    peers = [(me + i) % world for i in range(1, world)]
    cur = torch.cuda.current_stream(dev) if cuda else None
    side = _side_stream(dev) if cuda else None

    # Pairs that do not fit a slot: NCCL send/recv (both ends know), on the current stream.
    sends = {
        p: tuple(t.view(torch.uint8) for t in quant(x[in_off[p] : in_off[p] + ins[p]], _SPEC))
        for p in peers
        if ins[p] > cap
    }
    recvs = {
        s: (torch.empty((outs[s], dim), dtype=torch.uint8, device=dev),
            torch.empty((outs[s], sdim), dtype=torch.uint8, device=dev))
        for s in peers
        if outs[s] > cap
    }
    # 1. Stores into the peers' slots for me.
    for p in peers:
        n = ins[p]
        if 0 < n <= cap:
            q_dst, s_dst = lay.slot(ws.buffers[p], base, me, p)
            quant(x[in_off[p] : in_off[p] + n], _SPEC, out=(q_dst[:n], s_dst[:n]))
    # 2. The own rows, on a side stream (everything it uses was allocated on `cur`, which waits).
    if cuda:
        side.wait_stream(cur)
        with torch.cuda.stream(side):
            own_rows()
    else:
        own_rows()
    if sends or recvs:
        ws.send_recv(sends, recvs)
    # 3. Everyone's stores are done and visible.
    ws.barrier()
    # 4. Received rows into the output.
    for s in peers:
        n = outs[s]
        if 0 < n <= cap:
            q_in, s_in = lay.slot(ws.buffers[me], base, s, me)
            land(q_in[:n], s_in[:n], out_off[s])
    for s in recvs:
        land(*recvs[s], out_off[s])
    if cuda:
        cur.wait_stream(side)
    return y if dequant else (q_out, s_out)


_SIDE: dict[int, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream of the own rows on `device` (one per device, made once)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SIDE:
        _SIDE[idx] = torch.cuda.Stream(device=idx)
    return _SIDE[idx]
