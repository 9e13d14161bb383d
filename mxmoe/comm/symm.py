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
    p's slot for `me` (MXMOE_SYMM_STORE_PROGRAMS=P limits it to P looping programs; fewer than one per
    tile measured slower: NVLink stores need many SMs in flight).
  * Then, on a side stream, the own rows are quantized and dequantized straight into their output
    rows (`qdq_into`; the dispatch quantizes them into its output).
  * A pair whose rows exceed slot_rows (both ends see it: it is input_splits[p] on one side and
    output_splits[me] on the other) goes through NCCL send/recv instead.
  * A device-side barrier of the group (the symmetric memory handle's; MXMOE_SYMM_BARRIER=flags: each
    rank raises a flag word in every peer with a fenced cuStreamWriteValue32, then waits for its peers'
    words): every rank's stores are
    done and visible.
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
from mxmoe.quant.backends import backend, resolve_kernel

ELEM_DTYPE = torch.float8_e4m3fn
_SPEC = make_spec(BLOCK_SIZE, "rceil", ELEM_DTYPE)
_ALIGN = 256  # bytes: region starts
WORKSPACE_BYTES = int(os.environ.get("MXMOE_SYMM_WORKSPACE_MB", "1024")) << 20
# Programs of the cast kernel that stores into a peer (0: one per tile, the default: fewer measured slower,
# NVLink stores need many SMs in flight; docs/benchmarks.md).
STORE_PROGRAMS = int(os.environ.get("MXMOE_SYMM_STORE_PROGRAMS", "0"))
TIMEOUT_MS = int(os.environ.get("MXMOE_SYMM_TIMEOUT_MS", "300000"))
# How the rows travel: "copy" (quantize locally in pieces, the copy engine moves each piece into the
# peer's slot and then raises the piece's flag there; the receiver dequantizes each piece once its flag
# is up: no barrier, and the SMs stay free for the own rows and the dequantize) or "store" (the cast
# kernel stores straight into the peer's slot over NVLink, then one device barrier).
MODE = os.environ.get("MXMOE_SYMM_MODE", "store")
MODES = ("copy", "store")
PIECE_ROWS = int(os.environ.get("MXMOE_SYMM_PIECE_ROWS", "8192"))  # rows per piece in "copy" mode
MAX_PIECES = 32  # pieces per (source, receiver) pair
FLAG_BYTES = 4096  # the flag words at the end of the workspace (uint32): pieces, then barrier words
BARRIER_BASE = FLAG_BYTES // 4 - 64  # first barrier word: one per peer slot (at most 64 peers)
# The store mode's barrier: "torch" (the symmetric memory handle's barrier, the default) or "flags"
# (each rank raises a word in every peer after its stores, with a fenced cuStreamWriteValue32, then one
# kernel waits for its peers' words). Both exact; A/B on 2 H200s: equal from 8x8192 tokens per rank,
# mixed and noisy below (host-bound), so no reason yet to change the default (docs/benchmarks.md).
BARRIER = os.environ.get("MXMOE_SYMM_BARRIER", "torch")


@contextlib.contextmanager
def using_mode(mode: str | None):
    """Run the symmetric-memory exchanges inside with MODE = mode ("copy" / "store"; None: unchanged)."""
    global MODE
    if mode is not None and mode not in MODES:
        raise ValueError(f"symm mode {mode!r}; expected one of {MODES}")
    old = MODE
    MODE = mode or old
    try:
        yield
    finally:
        MODE = old


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def pieces(n: int) -> list[tuple[int, int]]:
    """The row ranges [a, b) in which a pair's n rows travel in "copy" mode: ceil(n / PIECE_ROWS) near
    equal pieces (at least one, even for n = 0: its flag still tells the receiver the pair is done),
    at most MAX_PIECES. Sender and receiver both know n, so both compute the same pieces."""
    k = max(1, min(MAX_PIECES, -(-n // max(1, PIECE_ROWS))))
    bounds = [n * i // k for i in range(k + 1)]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def flag_index(src: int, dst: int, world: int, piece: int) -> int:
    """Word of receiver dst's flags that piece `piece` of the rows from src raises."""
    return ((src - dst - 1) % world) * MAX_PIECES + piece


def barrier_index(src: int, dst: int, world: int) -> int:
    """Word of receiver dst's flags that src raises at the store mode's barrier."""
    return BARRIER_BASE + (src - dst - 1) % world


def flag_barrier(ws, me: int, world: int, epoch: int) -> None:
    """The store mode's barrier from flags (current stream): raise this rank's barrier word in every
    peer (after everything queued before, fenced), then wait until every peer has raised its word here.
    The peers' words are consecutive (slots 0 .. world - 2), so one wait covers them."""
    for i in range(1, world):
        p = (me + i) % world
        ws.signal(p, barrier_index(me, p, world), epoch)
    ws.wait(BARRIER_BASE, epoch, count=world - 1)


def halves_bytes(nbytes: int) -> int:
    """Bytes of one workspace half (the flags take the last FLAG_BYTES)."""
    return (nbytes - FLAG_BYTES) // 2 // _ALIGN * _ALIGN


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
        """Allocate and map the workspace, zero this rank's flags (collective: the first exchange of every
        rank calls it; a barrier makes sure no peer raises a flag here before they are zeroed)."""
        if self._handle is not None:
            return
        import torch.distributed._symmetric_memory as symm_mem

        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        world = dist.get_world_size(self.group)
        if (world - 1) * MAX_PIECES > BARRIER_BASE:
            most = BARRIER_BASE // MAX_PIECES + 1
            raise ValueError(f"symmetric-memory exchange: at most {most} ranks per group, got {world}")
        if WORKSPACE_BYTES < 2 * FLAG_BYTES:
            raise ValueError(
                f"MXMOE_SYMM_WORKSPACE_MB gives {WORKSPACE_BYTES} bytes; expected at least {2 * FLAG_BYTES}"
            )
        t = symm_mem.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        t[WORKSPACE_BYTES - FLAG_BYTES :].zero_()
        handle = symm_mem.rendezvous(t, self.group)
        self.buffers = [
            t if r == handle.rank else handle.get_buffer(r, (WORKSPACE_BYTES,), torch.uint8)
            for r in range(handle.world_size)
        ]
        # flag words (uint32: what stream_write_value32 takes; int32 for the wait kernel)
        self.flags = [b[WORKSPACE_BYTES - FLAG_BYTES :].view(torch.uint32) for b in self.buffers]
        self._own_flags = t[WORKSPACE_BYTES - FLAG_BYTES :].view(torch.int32)
        torch.cuda.synchronize(self.device)
        handle.barrier(channel=0, timeout_ms=TIMEOUT_MS)
        self._handle, self.nbytes = handle, WORKSPACE_BYTES

    def next_epoch(self) -> int:
        """Number of the next exchange (1, 2, ...): its half is (epoch - 1) % 2, its flag value epoch."""
        self._calls += 1
        return self._calls

    def barrier(self, epoch: int | None = None) -> None:
        """Every rank's work queued so far is done and visible: flag_barrier for exchange `epoch`
        (BARRIER "flags"), else the symmetric-memory handle's barrier."""
        if epoch is not None and BARRIER == "flags":
            flag_barrier(self, self._handle.rank, self._handle.world_size, epoch)
        else:
            self._handle.barrier(channel=0, timeout_ms=TIMEOUT_MS)

    def put(self, dst: Tensor, src: Tensor) -> None:
        """dst (a peer's slot rows) <- src, on the current stream (a copy-engine memcpy over NVLink)."""
        dst.copy_(src)

    def signal(self, peer: int, index: int, value: int) -> None:
        """Set flag word `index` of `peer` to value on the current stream, after everything before it
        (cuStreamWriteValue32: a system-wide fence, then the write)."""
        from torch._C._distributed_c10d import _SymmetricMemory

        _SymmetricMemory.stream_write_value32(self.flags[peer], index, value)

    def wait(self, index: int, value: int, count: int = 1) -> None:
        """The current stream waits until this rank's flag words index .. index + count - 1 are all >=
        value (a one-warp kernel; it traps after MXMOE_SYMM_TIMEOUT_MS: the process fails instead of
        hanging)."""
        from mxmoe.comm.kernels import wait_flag

        wait_flag(self._own_flags[index:], value, TIMEOUT_MS, count)

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
    self_qdq_impl: str = "auto", mode: str | None = None,
):
    """One MXFP8 exchange of x's rows (x (sum(input_splits), C), contiguous) through workspace `ws`
    (a SymmWorkspace, or any object with its `buffers`, `nbytes`, `ensure`, `next_epoch`, `barrier`,
    `send_recv`, `put`, `signal` and `wait`). mode: "copy" or "store" (None: MODE).

    Returns y (sum(output_splits), C) in x.dtype (dequant) or (q e4m3, s e8m0) rows, in the output
    order (rows by source rank). Bit for bit the reference exchange."""
    mode = MODE if mode is None else mode
    if mode not in MODES:
        raise ValueError(f"MXMOE_SYMM_MODE={mode!r}; expected one of {MODES}")
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
    quant_kernel = resolve_kernel(kernel, x.device, "dim0")
    cast = backend(quant_kernel)
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
                cast.quantize_dim0(xs, _SPEC, out=(q_out[o0 : o0 + n_self], s_out[o0 : o0 + n_self]))

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
    streams = _Streams(dev, cur, len(peers)) if cuda else None  # forks here: outputs allocated

    # Pairs that do not fit a slot: NCCL send/recv (both ends know), on the current stream.
    sends = {
        p: tuple(t.view(torch.uint8) for t in cast.quantize_dim0(x[in_off[p] : in_off[p] + ins[p]], _SPEC))
        for p in peers
        if ins[p] > cap
    }
    recvs = {
        s: (torch.empty((outs[s], dim), dtype=torch.uint8, device=dev),
            torch.empty((outs[s], sdim), dtype=torch.uint8, device=dev))
        for s in peers
        if outs[s] > cap
    }

    if mode == "store":
        looping = STORE_PROGRAMS and cuda and quant_kernel == "triton"
        store_kw = {"programs": STORE_PROGRAMS} if looping else {}
        # 1. Stores into the peers' slots for me.
        for p in peers:
            n = ins[p]
            if 0 < n <= cap:
                q_dst, s_dst = lay.slot(ws.buffers[p], base, me, p)
                xp = x[in_off[p] : in_off[p] + n]
                cast.quantize_dim0(xp, _SPEC, out=(q_dst[:n], s_dst[:n]), **store_kw)
        # 2. The own rows, on a side stream.
        with streams.on(streams.side) if cuda else contextlib.nullcontext():
            own_rows()
        if sends or recvs:
            ws.send_recv(sends, recvs)
        # 3. Everyone's stores are done and visible.
        ws.barrier(epoch)
        # 4. Received rows into the output.
        for s in peers:
            n = outs[s]
            if 0 < n <= cap:
                q_in, s_in = lay.slot(ws.buffers[me], base, s, me)
                land(q_in[:n], s_in[:n], out_off[s])
    else:
        # 1. Each peer's rows, piece by piece: quantize into a local staging buffer (current stream),
        #    then on the peer's copy stream: copy the piece into the peer's slot, raise its flag there.
        staging = []
        for j, p in enumerate(peers):
            n = ins[p]
            if n > cap:
                continue
            q_dst, s_dst = lay.slot(ws.buffers[p], base, me, p)
            sq = torch.empty((n, dim), dtype=torch.uint8, device=dev)
            ss = torch.empty((n, sdim), dtype=torch.uint8, device=dev)
            staging.append((sq, ss))
            for i, (a, b) in enumerate(pieces(n)):
                if b > a:
                    xa = x[in_off[p] + a : in_off[p] + b]
                    cast.quantize_dim0(xa, _SPEC, out=(sq[a:b], ss[a:b]))
                with streams.follow(streams.copy[j]) if cuda else contextlib.nullcontext():
                    if b > a:
                        ws.put(q_dst[a:b], sq[a:b])
                        ws.put(s_dst[a:b], ss[a:b])
                    ws.signal(p, flag_index(me, p, world, i), epoch)
        # 2. The own rows (current stream: the SMs are free, the copy engines move the pieces).
        own_rows()
        if sends or recvs:
            ws.send_recv(sends, recvs)
        # 3. On the receive stream: each piece, once its flag is up, into the output (round robin over
        #    the sources, in the order their pieces land).
        with streams.on(streams.recv, from_fork=True) if cuda else contextlib.nullcontext():
            plan = {s: pieces(outs[s]) for s in peers if outs[s] <= cap}
            for i in range(max((len(v) for v in plan.values()), default=0)):
                for s, ps in plan.items():
                    if i >= len(ps):
                        continue
                    ws.wait(flag_index(s, me, world, i), epoch)
                    a, b = ps[i]
                    if b > a:
                        qs, sc = lay.slot(ws.buffers[me], base, s, me)
                        land(qs[a:b], sc[a:b], out_off[s] + a)
    for s in recvs:
        land(*recvs[s], out_off[s])
    if cuda:  # everything used on the side streams was allocated on (or before) `cur`, which waits
        streams.join()
    return y if dequant else (q_out, s_out)


class _Streams:
    """The side streams of one exchange on one device: `side` (own rows, store mode), `recv` (waits and
    landing of received pieces, copy mode), `copy[j]` (the copies to the j-th peer, copy mode). `on(s)`:
    run on s after everything queued on the current stream so far (from_fork: only after what was
    queued when this object was made); `follow(s)`: as on, for each piece; `join()`: the current
    stream waits for every side stream used."""

    _cache: dict[int, dict[str, list[torch.cuda.Stream]]] = {}

    def __init__(self, device: torch.device, cur, npeers: int) -> None:
        idx = device.index if device.index is not None else torch.cuda.current_device()
        pool = self._cache.setdefault(idx, {"side": [], "recv": [], "copy": []})
        for name, k in (("side", 1), ("recv", 1), ("copy", npeers)):
            while len(pool[name]) < k:
                pool[name].append(torch.cuda.Stream(device=idx))
        self.cur, self.side, self.recv = cur, pool["side"][0], pool["recv"][0]
        self.copy = pool["copy"][:npeers]
        self.used: set = set()
        self.fork = torch.cuda.Event()
        self.fork.record(cur)

    @contextlib.contextmanager
    def on(self, stream, from_fork: bool = False):
        if from_fork:
            stream.wait_event(self.fork)
        else:
            stream.wait_stream(self.cur)
        self.used.add(stream)
        with torch.cuda.stream(stream):
            yield

    follow = on

    def join(self) -> None:
        for s in self.used:
            self.cur.wait_stream(s)
