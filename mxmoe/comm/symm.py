"""The MXFP8 all-to-all through symmetric memory: quantize straight into the peers' buffers, with
the stores, the own rows and the dequantize of landed tiles overlapped in one kernel.

Why: over NCCL the exchange costs quantize + send + dequantize in series (or NCCL and the casts
fight for the same SMs and memory when overlapped); see docs/benchmarks.md. Here the quantize is
itself the send: its stores go over NVLink into the receiving GPU's buffer, so the element and scale
bytes cross the link once, at the rate of the link, with no staging copy and no NCCL kernel; the own
rows and the dequantize of tiles that have landed use HBM and CUDA cores while stores are in flight.

Layout (the arithmetic: `mxmoe.comm.symm_layout`). Every rank has a workspace (torch symmetric
memory, one per process group and device, size MXMOE_SYMM_WORKSPACE_MB, default 1024; zeroed when
made) of two halves used by alternate exchanges.
A half has one slot per peer: one int32 flag per tile of TILE_BLOCKS blocks of 32 (room for any row
width, at offsets that do not depend on it), then up to `slot_rows` rows (elements (slot_rows, C),
then scales (slot_rows, C//32)). Rows from source s sit in slot (s - r - 1) mod W of receiver r,
from row 0. So a rank needs only its own splits: where its rows go in a peer, and where a peer's
rows are in its own slots, follow from the ranks alone (no split matrix, no collective, no host
sync).

One exchange (number `epoch`, 1, 2, ...) on rank `me` of W ranks is one launch of
`mxmoe.comm.symm_kernel.exchange_kernel` (work items taken in the order of an atomic ticket):
  * store items for each peer p (staggered: me+1, me+2, ...): quantize `item_tiles` tiles of
    TILE_BLOCKS blocks of the rows for p into p's slot for `me`, then write `epoch` into the tiles'
    flags there (release, system scope). Every pair has at least one tile, an empty one when it
    exchanges no rows;
  * own items: quantize-dequantize straight into the output rows (the dispatch quantizes them);
  * receive items (sources staggered: me-1, me-2, ...): if the item's flags in this rank's slot of
    the source hold `epoch` (acquire, system scope), dequantize it into its output rows (or copy it
    out); else defer it;
  all three spread evenly over the tickets (receives from the first 1/RECV_DELAY of the stores on),
  and none of them waits. Then each program waits until every front item is done and takes the
  deferred receives, now waiting for each flag.
  * A pair whose rows exceed slot_rows (both ends see it: it is input_splits[p] on one side and
    output_splits[me] on the other) sends an empty tile in the kernel and its rows through NCCL
    send/recv after it.
Flags need no reset: exchange n finds values of n - 2 or less in its half. Alternate halves make a
barrier before the stores unnecessary: rank s writes half h in exchange n only after its exchange
n - 1 waited for a flag of every peer r in n - 1, which r wrote after its exchange n - 2 (the one that
read half h) had finished.

Every rank must make the same exchanges in the same order (as with any collective), with consistent
splits. A wait lasts at most MXMOE_SYMM_TIMEOUT_MS milliseconds (default 300000); then the kernel
writes which source and tile it waited for into the workspace's error word and traps: the process
fails with a CUDA error instead of hanging (on CPU the emulation raises a RuntimeError). NVLink
multicast is never used (TORCH_SYMM_MEM_DISABLE_MULTICAST=1).

On CPU (tests: W ranks as threads over plain tensors) `impl="python"` runs the same work items in
the same ticket order with torch casts, flags and waits (`mxmoe.comm.symm_emulation`); under
TRITON_INTERPRET=1 `impl="kernel"` runs the kernel itself.
"""

from __future__ import annotations

import functools
import os
import threading

import torch
import torch.distributed as dist
from torch import Tensor

from mxmoe.comm.kernels import dequantize_into
from mxmoe.comm.symm_emulation import emulate_exchange
from mxmoe.comm.symm_layout import (  # noqa: F401  (Layout .. items_of: importable from here too)
    ALIGN,
    BLOCK_SIZE,
    ELEM_DTYPE,
    FORMAT,
    ROWS,
    TILE_BLOCKS,
    Items,
    Layout,
    halves_bytes,
    items_of,
    layout,
    tiles,
    timeout_error,
)
from mxmoe.comm.symm_layout import SPEC as _SPEC
from mxmoe.comm.transport import TRANSPORTS, ExchangeSite, Transport, load_transport, offsets
from mxmoe.quant.backends import cast_fn, resolve_kernel, triton_interpret
from mxmoe.registry import Backend

WORKSPACE_BYTES = int(os.environ.get("MXMOE_SYMM_WORKSPACE_MB", "1024")) << 20
TIMEOUT_MS = int(os.environ.get("MXMOE_SYMM_TIMEOUT_MS", "300000"))
# A flag tile's TILE_BLOCKS blocks of 32 (symm_layout) are done in register tiles of _SUB_BLOCKS (8
# elements a thread); warps and register cap per program, programs per SM: 80 registers (no spills in
# the register-tile loops; tests/comm/test_symm.py checks the sm_90 build with the launch's argument
# types) let three programs of 8 warps share an SM (NVLink stores need many in flight).
_SUB_BLOCKS = 64
# Register tile of store items, in blocks: its element bytes a thread are the width of each NVLink
# store (64 blocks over 8 warps: 8-byte st.global.v2, 256 consecutive bytes a warp; 128: 16-byte
# st.global.v4, 512 a warp, 16 elements a thread). At 80 registers the launch's build (int32 scalars)
# spills 24 (64) or 32 (128) bytes of values that stay the same over the front loop, stored once and
# reloaded once a work item, none in the register-tile loops (its sm_90 SASS). 128: the fastest in
# scripts/symm_sweep.py on 2 H200s (docs/benchmarks.md, "MXFP8 all-to-all").
_STORE_SUB_BLOCKS = 128
# Register tile of receive items, in blocks, by the rows' dtype: 64 (8 element bytes a thread: 8-byte
# asynchronous copies, 8 output elements) or 128 (16: 16-byte copies that bypass L1, 16 outputs; the
# per-tile work (addresses, masks, barriers, the scale minimum) over twice the elements: sm_90 SASS,
# bf16, ~206 -> ~173 instructions per 8 elements a thread and warp, ~163 -> ~150 with fast-bit flags;
# 48 bytes of spills of values reloaded once a work item, none in the register-tile loops).
# bf16 128: the faster in scripts/symm_sweep.py on 2 H200s at 4 and 16 x 8192 rows (docs/benchmarks.md,
# "MXFP8 all-to-all"); fp32 spills inside the loops at 128.
_RECV_SUB_BLOCKS = {torch.bfloat16: 128, torch.float32: 64}
_WARPS, _MAXNREG, _PROGS_PER_SM = 8, 80, 3
# Pipeline depth of a work item's register tiles (Triton's num_stages: STAGES - 1 register tiles are
# loaded ahead, by asynchronous copies into shared memory) for store and own items, then for receive
# items, by the rows' dtype: as deep as 80 registers allow without spills in the register-tile loops
# (the sm_90 build test checks it). With one register tile at a time each paid a full memory
# latency, and three programs of 8 warps kept at most 12 KiB of loads in flight an SM.
_STAGES = {torch.bfloat16: (4, 3), torch.float32: (2, 1)}
# Flag tiles per work item (one of ITEM_TILES_ACCEPTED; scripts/symm_sweep.py measures them): an
# item pays a ticket, and a store item one system-scope fence (it waits for the CTA's NVLink stores
# to be acknowledged), whatever its size; larger items pay them over more bytes, smaller ones balance
# the programs' ends better. Flags stay one per tile (the workspace layout does not depend on it, nor
# on the peers' item size); a store item releases its flags from one warp (at most 32 lanes), a
# receive item waits for all of them. None: `item_tiles` picks 8 for large exchanges and 4 otherwise
# (scripts/symm_sweep.py: 8 is faster at 16 x 8192 rows a rank, 4 at 4 x 8192 and below, where 8-tile
# items leave programs idle; 1 and 2 were slower than 4 at every size). An int forces that size
# (sweeps and tests).
ITEM_TILES: int | None = None
# ... 8 once the exchange has at least this many 8-tile items a program (16 x 8192 rows: 39; 4 x
# 8192: 10; the crossover between them is not measured).
_LARGE_ITEMS_PER_PROGRAM = 16
ITEM_TILES_ACCEPTED = (1, 2, 4, 8, 16)
# Whether a store item's flags also say that every scale byte of the item is >= 10 (bit 31, FAST_BIT:
# the value is epoch | FAST_BIT), so that a receive item takes the dequantize's fast path from its
# flags: each scale is read once (one 4-byte word a block row) and no register tile reduces its
# scales across warps (two CTA barriers and a second load of the scale words each; sm_90 SASS, bf16:
# ~206 -> ~163 instructions a register tile and warp). The store item pays one reduction across warps
# an item instead. A receive item whose flags do not all have the bit takes the exact integer path
# for all its register tiles (a block of zeros has scale byte 0: one such block in an item is
# enough). Flags compare their low 31 bits with the epoch. True: faster in every pair of the sweep
# (scripts/symm_sweep.py) but one, equal, at 4 and 16 x 8192 rows.
_FAST_BIT_FLAGS = True  # the bit: symm_emulation.FAST_BIT
# Receives start after 1/RECV_DELAY of the stores (the peers' first tiles have landed by then; a tile
# that has not is deferred to the end of the exchange).
RECV_DELAY = 4


class SymmWorkspace:
    """A symmetric-memory buffer of one process group on one device, with every rank's buffer mapped
    here (`buffers[r]`, 1D uint8), the exchange kernel's counters (`counters`, int32 (128,), zero),
    deferred-receive list (`deferred`, int32, grown on demand) and error word (`error`, int64 (1,)),
    and NCCL send/recv for the rows that do not fit."""

    _cache: dict[tuple[str, int], SymmWorkspace] = {}
    _lock = threading.Lock()

    def __init__(self, group, device: torch.device) -> None:
        self.group = group
        self.device = device
        self.nbytes = 0
        self.buffers: list[Tensor] = []
        self.counters = torch.zeros(4 * 32, dtype=torch.int32, device=device)
        self.deferred = torch.empty(0, dtype=torch.int32, device=device)
        self.error = torch.zeros(1, dtype=torch.int64, device=device)
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
        """Allocate, zero and map the workspace (collective: the first exchange of every rank calls
        it; a device barrier follows the zeroing, so no peer stores into it before)."""
        if self._handle is not None:
            return
        import torch.distributed._symmetric_memory as symm_mem

        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        if WORKSPACE_BYTES < 2 * ALIGN:
            raise ValueError(
                f"MXMOE_SYMM_WORKSPACE_MB gives {WORKSPACE_BYTES} bytes; expected at least {2 * ALIGN}"
            )
        t = symm_mem.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        handle = symm_mem.rendezvous(t, self.group)
        t.zero_()  # flags: 0 is no epoch
        self.buffers = [
            t if r == handle.rank else handle.get_buffer(r, (WORKSPACE_BYTES,), torch.uint8)
            for r in range(handle.world_size)
        ]
        self._handle, self.nbytes = handle, WORKSPACE_BYTES
        self._handle.barrier(channel=0, timeout_ms=TIMEOUT_MS)

    def next_epoch(self) -> int:
        """Number of the next exchange (1, 2, ...): its half is (epoch - 1) % 2."""
        self._calls += 1
        return self._calls

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
    installed (the exchange kernel is Triton). Decided from facts every rank shares (for the auto
    choice to agree)."""
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


# --------------------------------------------------------------------------------------------
# Work items
# --------------------------------------------------------------------------------------------

def item_tiles(n_tiles: int, programs: int) -> int:
    """Flag tiles per work item of an exchange whose rank quantizes, stores and receives `n_tiles`
    flag tiles on `programs` programs: ITEM_TILES if set, else 8 when that gives at least
    _LARGE_ITEMS_PER_PROGRAM items a program, else 4."""
    if ITEM_TILES is not None:
        if ITEM_TILES not in ITEM_TILES_ACCEPTED:
            raise ValueError(f"ITEM_TILES={ITEM_TILES}; expected None or one of {ITEM_TILES_ACCEPTED}")
        return ITEM_TILES
    return 8 if n_tiles >= 8 * _LARGE_ITEMS_PER_PROGRAM * programs else 4


def work_items(ins: list[int], outs: list[int], me: int, ws, lay: Layout, base: int) -> Items:
    """The item table of rank `me` for an exchange into the half at byte `base` (see ROWS); cached
    per workspace for repeated splits (the table and its device copy are reused)."""
    cache = ws.__dict__.setdefault("_items", {})
    key = (tuple(ins), tuple(outs), me, lay, base, ITEM_TILES, RECV_DELAY)
    hit = cache.get(key)
    if hit is not None:
        return hit
    world, sd = lay.world, lay.dim // BLOCK_SIZE
    buf = ws.buffers[me]
    programs = _sm_count(buf.device.index) * _PROGS_PER_SM if buf.is_cuda else 1
    per_item = item_tiles(tiles(sum(ins), lay.dim) + tiles(sum(outs) - outs[me], lay.dim), programs)
    cap = lay.slot_rows
    in_off, out_off = offsets(ins), offsets(outs)
    table = [[0] * world for _ in ROWS]
    col = {name: table[r] for r, name in enumerate(ROWS)}
    for i in range(world - 1):
        p, s = (me + 1 + i) % world, (me - 1 - i) % world
        n_send = ins[p] if ins[p] <= cap else 0
        n_recv = outs[s] if outs[s] <= cap else 0
        col["st_start"][i + 1] = col["st_start"][i] + items_of(n_send, lay.dim, per_item)
        col["rc_start"][i + 1] = col["rc_start"][i] + items_of(n_recv, lay.dim, per_item)
        col["st_xblk"][i], col["st_nblk"][i] = in_off[p] * sd, n_send * sd
        col["rc_yblk"][i], col["rc_nblk"][i] = out_off[s] * sd, n_recv * sd
        for kind, buf, offs in (
            ("st", ws.buffers[p], lay.offsets(base, me, p)),
            ("rc", ws.buffers[me], lay.offsets(base, s, me)),
        ):
            if buf.is_cuda and buf.data_ptr() % ALIGN:  # the kernel's vector accesses rely on it
                raise ValueError(f"workspace buffer at {buf.data_ptr():#x} is not {ALIGN}-byte aligned")
            for part, off in zip("qsf", offs, strict=True):
                col[f"{kind}_{part}"][i] = buf.data_ptr() + off
    n_own = -(-ins[me] * sd // (TILE_BLOCKS * per_item))
    n_store = col["st_start"][world - 1]
    items = Items(table, n_store, n_own, col["rc_start"][world - 1], in_off[me] * sd, out_off[me] * sd,
                  ins[me] * sd, n_store // RECV_DELAY, per_item)
    if len(cache) >= 64:
        cache.clear()
    cache[key] = items
    return items


# --------------------------------------------------------------------------------------------
# The exchange
# --------------------------------------------------------------------------------------------


def symm_mx_exchange(
    x: Tensor, input_splits, output_splits, me: int, ws, kernel: str, dequant: bool, impl: str = "auto"
):
    """One MXFP8 exchange of x's rows (x (sum(input_splits), C) bf16/fp32, contiguous) through
    workspace `ws` (a SymmWorkspace, or any object with its `buffers`, `nbytes`, `counters`,
    `deferred`, `error`, `ensure`, `next_epoch` and `send_recv`).

    Returns y (sum(output_splits), C) in x.dtype (dequant) or (q e4m3, s e8m0) rows, in the output
    order (rows by source rank). Bit for bit the reference exchange. kernel: the cast backend of the
    NCCL fallback's quantize and of the CPU emulation. impl: "kernel" (the Triton exchange kernel:
    CUDA, or CPU under TRITON_INTERPRET=1), "python" (the same work items in Python, CPU) or "auto"
    (kernel on CUDA, python elsewhere)."""
    if impl not in ("auto", "kernel", "python"):
        raise ValueError(f"impl={impl!r} is not one of 'auto', 'kernel', 'python'")
    if impl == "auto":
        impl = "kernel" if x.is_cuda else "python"
    world = len(input_splits)
    dim = x.shape[1]
    sdim = dim // BLOCK_SIZE
    ins, outs = list(input_splits), list(output_splits)
    in_off, out_off = offsets(ins), offsets(outs)
    rows_out = sum(outs)
    ws.ensure()
    half = halves_bytes(ws.nbytes)
    lay = layout(world, dim, half)
    cap = lay.slot_rows
    epoch = ws.next_epoch()
    base = ((epoch - 1) % 2) * half
    dev = x.device

    if dequant:
        y = torch.empty((rows_out, dim), dtype=x.dtype, device=dev)
        outputs = (y,)
    else:
        q_out = torch.empty((rows_out, dim), dtype=ELEM_DTYPE, device=dev)
        s_out = torch.empty((rows_out, sdim), dtype=FORMAT.scale_dtype, device=dev)
        outputs = (q_out, s_out)
    items = work_items(ins, outs, me, ws, lay, base)
    if impl == "kernel":
        _run_kernel(x, outputs, items, ws, epoch, dequant)
    else:
        emulate_exchange(
            x,
            outputs,
            items,
            epoch,
            kernel,
            dequant,
            lay,
            ws,
            base,
            me,
            fast_bit=_FAST_BIT_FLAGS,
            timeout_ms=TIMEOUT_MS,
        )

    # Pairs that do not fit a slot: NCCL send/recv (both ends know), after the kernel.
    peers = [(me + i) % world for i in range(1, world)]
    if all(ins[p] <= cap and outs[p] <= cap for p in peers):
        return y if dequant else (q_out, s_out)
    quant = cast_fn(resolve_kernel(kernel, dev, "dim0"), "dim0")
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
    ws.send_recv(sends, recvs)
    for s, (q_in, s_in) in recvs.items():
        o0, n = out_off[s], outs[s]
        if dequant:
            dequantize_into(q_in, s_in, y[o0 : o0 + n], kernel)
        else:
            q_out[o0 : o0 + n].view(torch.uint8).copy_(q_in)
            s_out[o0 : o0 + n].view(torch.uint8).copy_(s_in)
    return y if dequant else (q_out, s_out)


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _run_kernel(x: Tensor, outputs: tuple[Tensor, ...], items: Items, ws, epoch: int, dequant: bool) -> None:
    """One launch of the exchange kernel (CUDA, or CPU under TRITON_INTERPRET=1)."""
    from mxmoe.comm.symm_kernel import exchange_kernel
    from mxmoe.quant.triton_cast import spec_args as _spec_args

    interpret = not x.is_cuda
    if interpret and not triton_interpret():
        raise RuntimeError("impl='kernel' needs CUDA tensors (or TRITON_INTERPRET=1 on CPU)")
    world = len(items.table[0])
    meta = items.meta.get(x.device)
    if meta is None:
        meta = torch.tensor(items.table, dtype=torch.int64)
        if x.is_cuda:  # the pinned source stays alive in the cache until the copy is done
            items.meta["pinned"] = meta = meta.pin_memory()
            meta = meta.to(x.device, non_blocking=True)
        items.meta[x.device] = meta
    nprog = 1 if interpret else min(items.front, _sm_count(x.device.index) * _PROGS_PER_SM)
    bf16 = x.dtype == torch.bfloat16
    bits = torch.int16 if bf16 else torch.int32
    if dequant:
        y, ys = outputs[0].view(bits), outputs[0].view(torch.uint8)
    else:
        y, ys = outputs[0].view(torch.uint8), outputs[1].view(torch.uint8)
    # spin limit: nanoseconds of the GPU's globaltimer; polls under the interpreter
    timeout = TIMEOUT_MS * (1 if interpret else 1_000_000)
    if ws.deferred.numel() < items.n_recv:  # stream-ordered: a kernel still using the old one keeps it
        n = max(items.n_recv, 2 * ws.deferred.numel())
        ws.deferred = torch.empty(n, dtype=torch.int32, device=x.device)
    exchange_kernel[(nprog,)](
        x.view(bits), y, ys, meta, ws.counters, ws.deferred, ws.error, epoch,
        items.n_store, items.n_own, items.n_recv, items.delay, items.own_xblk, items.own_yblk,
        items.own_nblk, timeout, nprog, PEERS=world - 1, NB=TILE_BLOCKS, ITEM=items.per_item,
        SUB=_SUB_BLOCKS, SSUB=_STORE_SUB_BLOCKS, RSUB=_RECV_SUB_BLOCKS[x.dtype],
        STAGES=_STAGES[x.dtype][0], RSTAGES=_STAGES[x.dtype][1], IN_BF16=bf16,
        DEQUANT=dequant, CLOCK=not interpret, SFLAG=_FAST_BIT_FLAGS, num_warps=_WARPS, maxnreg=_MAXNREG,
        **_spec_args(_SPEC, interpret),
    )
    if interpret and int(ws.error[0]):
        code = int(ws.error[0]) - 1
        ws.error.zero_()
        raise timeout_error(code, TIMEOUT_MS)


class SymmTransport(Transport):
    """MXFP8 rows through symmetric memory (`symm_mx_exchange`); rows in their own dtype go through
    the process group (`mxmoe.comm.nccl`)."""

    name = "symm"

    def mx_exchange(self, x, plan, group, fmt, kernel, dequant, chunks):
        ws = SymmWorkspace.get(group, x.device)
        return symm_mx_exchange(x, plan.input_splits, plan.output_splits, plan.rank, ws, kernel, dequant)

    def exchange(self, x, plan, group):
        return load_transport("nccl").exchange(x, plan, group)




def _why_unavailable(site: ExchangeSite) -> str | None:
    """Why the symmetric-memory exchange cannot run at `site` (None: it can)."""
    if site.device_type != "cuda" or (site.world > 1 and not symm_usable(site.group, torch.device("cuda"))):
        return (
            "needs CUDA tensors, an NCCL process group of GPUs on one host, "
            "torch.distributed._symmetric_memory and triton; use transport='nccl' or 'auto'"
        )
    if site.fmt is not None and site.fmt != FORMAT:
        f = site.fmt
        return (
            f"exchanges the default format only ({FORMAT.name}: RCEIL, e4m3, blocks of 32); the recipe "
            f"asks for {f.name} ({f.scaling_mode.value}, {f.elem_dtype}, blocks of {f.block_size}): use "
            "transport='nccl' or 'auto'"
        )
    return None


TRANSPORT = SymmTransport()
BACKEND = Backend(
    "symm",
    __name__,
    why_unavailable=_why_unavailable,
    auto_rank=lambda site: None if site.chunks else 0,  # `chunks` asks for the NCCL pipeline
)
""""auto" takes it wherever it can run, unless `chunks` asks for the NCCL pipeline."""
TRANSPORTS.register(BACKEND)
