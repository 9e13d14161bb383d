"""The symmetric-memory exchange as one persistent Triton kernel (the protocol: `mxmoe.comm.symm`).

Flags are one per tile of NB blocks of 32 elements over a flat sequence of blocks (rows are
contiguous, so a tile may span rows); a work item covers ITEM consecutive tiles of one pair (the own
rows: ITEM * NB blocks). Programs take items by an atomic ticket counter, so item t is only taken
after items 0..t-1 were taken by running programs. Items, in ticket order:

  * the front, where nothing waits: store items (quantize x's rows for peer p into p's slot for this
    rank, then release writes of the item's tiles' flags in the slot), own items (quantize-dequantize
    into the output, or quantize into it for the dispatch) and receive items, all spread evenly; the
    receives start after `delay` communication items (stores and receives) so that the peers' first
    items have landed. A receive item reads its flags once (acquire): if they all hold this
    exchange's epoch the item is dequantized into the output (or copied out), else it is appended to
    the deferred list;
  * the back: each program adds the front items it finished to a counter and waits until the whole
    front is done, then takes the deferred receives by ticket, spinning (acquire) on each flag.

No deadlock: front items never wait, so every front item taken is finished by the program that took
it; a back program waits for that, then only for peers' stores, and every store of a peer is a front
item of the peer, finished without waiting. Spins time out (globaltimer; MXMOE_SYMM_TIMEOUT_MS): the
kernel records the source and tile in the error word and traps (on a GPU the process fails with a
CUDA error instead of hanging). The last program to finish resets the counters for the next exchange.

Memory ordering: a store item's threads write the peer's slot (weak st.global over NVLink: the
elements as SSUB * 32 / (32 * warps)-byte vectors, every warp 32 such stores of consecutive bytes;
the scales as int32 words of four blocks, SSUB bytes from one warp per register tile); a CTA
barrier (bar.sync) orders them before the threads of one warp (one per flag) write the flags with
atomic exchanges of release semantics at system scope (cumulative: they publish every write the
barrier ordered before them; one MEMBAR.SYS for the warp). A receive item reads its flags with
atomics of acquire semantics at system scope, a CTA barrier follows, and only then are the item's
bytes loaded (the acquire invalidates this SM's L1, so they come from L2, where the peer's NVLink
stores land).

Fast-bit flags (SFLAG, mxmoe.comm.symm._FAST_BIT_FLAGS): a store item also reduces its blocks' scale
bytes to their minimum (once an item, across warps, before the releases) and writes epoch | FAST_BIT
(bit 31) into its flags when that minimum is >= 10. A receive item compares the low 31 bits with the
epoch (epochs are below 2^31: int32 arguments) and, when every flag has the bit, dequantizes with the
fast path without the minimum of each register tile's scales (one load of each scale word, no
reduction across warps); else with the exact integer path (exact either way: the bit only picks
between two paths that give the same bits). The bit travels in the value that the release publishes
and the acquire reads, and describes only bytes that release publishes: the ordering argument above
is unchanged.

Memory-level parallelism: a work item's register tiles are loaded by asynchronous copies into shared
memory, issued STAGES - 1 (receives: RSTAGES - 1) register tiles ahead of their use (Triton's loop
pipeliner, `tl.range(num_stages=)`; receive scales are read as int32 words, which can be copied
asynchronously, single bytes cannot), so an item should pay about one memory latency instead of one
per register tile. The version that loaded one 16-byte vector a thread at a time (three programs of
8 warps an SM: at most 12 KiB of loads in flight an SM) and had one ticket and one system fence per
8192 elements was slower than the serial path; docs/benchmarks.md ("The symmetric-memory kernel's
schedule") has the model.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import globaltimer

from mxmoe.comm.kernels import _dequant_store, _qdq_tile
from mxmoe.quant.triton_cast import abs_key as _abs_key
from mxmoe.quant.triton_cast import apply_scale as _apply
from mxmoe.quant.triton_cast import block_scale as _block_scale
from mxmoe.quant.triton_cast import load_bits as _load_bits
from mxmoe.quant.triton_cast import to_elem as _to_elem

CTR_STRIDE: tl.constexpr = tl.constexpr(32)
# SFLAG: the flag bit (int32 sign) that says every scale byte of the store item is >= 10
FAST_BIT: tl.constexpr = tl.constexpr(-2147483648)
EPOCH_BITS: tl.constexpr = tl.constexpr(0x7FFFFFFF)

# Rows of the item table, in the order of mxmoe.comm.symm_layout.ROWS (int64, (12, PEERS + 1)).
ST_START, ST_XBLK, ST_NBLK, ST_Q, ST_S, ST_F = (tl.constexpr(i) for i in range(6))
RC_START, RC_YBLK, RC_NBLK, RC_Q, RC_S, RC_F = (tl.constexpr(i) for i in range(6, 12))


@triton.jit
def _meta(meta_ptr, row, i, PEERS: tl.constexpr):
    return tl.load(meta_ptr + row * (PEERS + 1) + i)


@triton.jit
def _which(meta_ptr, row, k, PEERS: tl.constexpr):
    """Index i with start[i] <= k < start[i + 1] (start: meta row `row`, prefix sums)."""
    i = k * 0
    for j in tl.static_range(1, PEERS):
        i += (k >= _meta(meta_ptr, row, j, PEERS)).to(tl.int64)
    return i


@triton.jit
def _as_ptr(addr, ty: tl.constexpr):
    """A slot address from the item table as a pointer; every slot region starts on 256 bytes (the
    hint lets the compiler use 16-byte loads and stores)."""
    return tl.multiple_of(addr.to(tl.pointer_type(ty)), 256)


@triton.jit
def _n_tiles(nblk, NB: tl.constexpr):
    """Flag tiles of a pair of `nblk` blocks (at least one: an empty pair still signals)."""
    return tl.maximum((nblk + NB - 1) // NB, 1)


@triton.jit
def _quantize_rows(X, MODE: tl.constexpr, IS_E5M2: tl.constexpr, EMAX: tl.constexpr, MBITS: tl.constexpr,
                   MIN_EXP: tl.constexpr, MAXBITS: tl.constexpr, RCEIL_C: tl.constexpr, T127: tl.constexpr,
                   T126: tl.constexpr, SOFT: tl.constexpr):
    """mxmoe.quant.triton_cast._quantize of X's rows (blocks along axis 1): the same bytes, but the
    0x7F elements of non-finite blocks are selected on 32-bit words of four elements (one PTX selp a
    word) instead of byte by byte after the fp8 conversion (unpack, select, repack: about four
    instructions an element in the sm_90 build). The interpreter (SOFT) takes _quantize's select."""
    e, nonfinite, s = _block_scale(tl.max(_abs_key(X), axis=1), MODE, EMAX, MBITS, RCEIL_C, T127, T126)
    if SOFT:
        q = _apply(X, e[:, None], nonfinite[:, None], IS_E5M2, MBITS, MIN_EXP, MAXBITS, SOFT)
    else:
        y = X.to(tl.float32, bitcast=True) * ((127 - e) << 23).to(tl.float32, bitcast=True)[:, None]
        q = _to_elem(y, IS_E5M2, MBITS, MIN_EXP, MAXBITS, SOFT)
        # a byte mask a word (0xFF where the element's block is non-finite), whatever rows its four
        # elements come from, then bytes 0x7F under it
        m = tl.broadcast_to(tl.where(nonfinite, 0xFF, 0)[:, None], q.shape)
        q = tl.inline_asm_elementwise(
            "{ .reg .b32 lo, hi, k; prmt.b32 lo, $2, $3, 0x0040; prmt.b32 hi, $4, $5, 0x0040; "
            "prmt.b32 k, lo, hi, 0x5410; lop3.b32 $0, $1, k, 0x7F7F7F7F, 0xB8; }",
            "=r,r,r,r,r,r", [q, m], dtype=tl.uint8, is_pure=True, pack=4)
    return q, s


@triton.jit
def _store_item(x_ptr, meta_ptr, k, epoch, PEERS: tl.constexpr, NB: tl.constexpr, ITEM: tl.constexpr,
                SUB: tl.constexpr, STAGES: tl.constexpr, SFLAG: tl.constexpr,
                IN_BF16: tl.constexpr, MODE: tl.constexpr, IS_E5M2: tl.constexpr, EMAX: tl.constexpr,
                MBITS: tl.constexpr, MIN_EXP: tl.constexpr, MAXBITS: tl.constexpr, RCEIL_C: tl.constexpr,
                T127: tl.constexpr, T126: tl.constexpr, SOFT: tl.constexpr):
    i = _which(meta_ptr, ST_START, k, PEERS)
    kk = k - _meta(meta_ptr, ST_START, i, PEERS)
    blk0 = kk * (ITEM * NB)
    xblk = _meta(meta_ptr, ST_XBLK, i, PEERS) + blk0
    n_all = _meta(meta_ptr, ST_NBLK, i, PEERS)
    nblk = n_all - blk0
    q_dst = _as_ptr(_meta(meta_ptr, ST_Q, i, PEERS), tl.uint8) + blk0 * 32
    # The scales leave as int32 words, four blocks' bytes each (little-endian: block b at bits
    # 8 (b % 4), the slot's byte layout): one 4-byte store a thread, SUB bytes from one warp in one
    # instruction, instead of single bytes from SUB threads. An item starts on a multiple of 4 blocks;
    # the last word of a pair may cover up to 3 blocks past its end: padding of the slot's scale
    # region (256-byte aligned, so never past it), which no receive reads.
    tl.static_assert(SUB % 4 == 0 and (ITEM * NB) % SUB == 0)
    tl.static_assert(ITEM <= 32)  # the flags' releases from one warp: one system fence
    s_dst = _as_ptr(_meta(meta_ptr, ST_S, i, PEERS), tl.int32) + blk0 // 4
    f_dst = _as_ptr(_meta(meta_ptr, ST_F, i, PEERS), tl.int32)
    smin = tl.full([SUB], 255, tl.int32)  # SFLAG: the smallest scale byte of the item's blocks so far
    for u in tl.range(0, ITEM * NB // SUB, num_stages=STAGES):
        b = tl.arange(0, SUB) + u * SUB
        bmask = b < nblk
        offs = b[:, None] * 32 + tl.arange(0, 32)[None, :]
        X = _load_bits(x_ptr + xblk * 32, offs, bmask[:, None], IN_BF16)
        q, s = _quantize_rows(X, MODE, IS_E5M2, EMAX, MBITS, MIN_EXP, MAXBITS, RCEIL_C, T127, T126, SOFT)
        tl.store(q_dst + offs, q, mask=bmask[:, None])
        # disjoint bit fields: the sum is the bytes side by side
        w = tl.sum(tl.reshape(s.to(tl.int32), [SUB // 4, 4]) << (8 * tl.arange(0, 4))[None, :], axis=1)
        wi = tl.arange(0, SUB // 4) + u * (SUB // 4)
        tl.store(s_dst + wi, w, mask=wi * 4 < nblk)
        if SFLAG:
            smin = tl.minimum(smin, tl.where(bmask, s.to(tl.int32), 255))
    tl.debug_barrier()  # every thread's stores of the item, then the releases below
    flag = epoch
    if SFLAG:
        # bit 31: every scale byte of the item is >= 10, so the receiver may take the dequantize's
        # fast path without reading its scales twice (published by the same release as the scales)
        flag = tl.where(tl.min(smin, axis=0) >= 10, epoch | FAST_BIT, epoch)
    if ITEM == 1:
        tl.atomic_xchg(f_dst + kk, flag, sem="release", scope="sys")
    else:
        # the item's flags from one warp: one system fence for all of them
        ft = kk * ITEM + tl.arange(0, ITEM)
        tl.atomic_xchg(f_dst + ft, tl.full([ITEM], 0, tl.int32) + flag, mask=ft < _n_tiles(n_all, NB),
                       sem="release", scope="sys")


@triton.jit
def _own_item(x_ptr, y_ptr, ys_ptr, k, own_xblk, own_yblk, own_nblk, NB: tl.constexpr, ITEM: tl.constexpr,
              SUB: tl.constexpr, STAGES: tl.constexpr,
              IN_BF16: tl.constexpr, DEQUANT: tl.constexpr, MODE: tl.constexpr, IS_E5M2: tl.constexpr,
              EMAX: tl.constexpr, MBITS: tl.constexpr, MIN_EXP: tl.constexpr, MAXBITS: tl.constexpr,
              RCEIL_C: tl.constexpr, T127: tl.constexpr, T126: tl.constexpr, SOFT: tl.constexpr):
    blk0 = k * (ITEM * NB)
    nblk = own_nblk - blk0
    x_ptr += (own_xblk + blk0) * 32
    for u in tl.range(0, ITEM * NB // SUB, num_stages=STAGES):
        b = tl.arange(0, SUB) + u * SUB
        bmask = b < nblk
        if DEQUANT:
            # SOFT (interpreter): the all-integer path; compiled, the fp8 conversion saturates itself
            _qdq_tile(x_ptr, y_ptr + (own_yblk + blk0) * 32, b.to(tl.int64), bmask,
                      RCEIL_C, T127, T126, IN_BF16, SOFT, not SOFT)
        else:
            offs = b[:, None] * 32 + tl.arange(0, 32)[None, :]
            X = _load_bits(x_ptr, offs, bmask[:, None], IN_BF16)
            q, s = _quantize_rows(X, MODE, IS_E5M2, EMAX, MBITS, MIN_EXP, MAXBITS, RCEIL_C, T127, T126, SOFT)
            tl.store(y_ptr + (own_yblk + blk0) * 32 + offs, q, mask=bmask[:, None])
            tl.store(ys_ptr + own_yblk + blk0 + b, s, mask=bmask)


@triton.jit
def _recv_where(meta_ptr, k, PEERS: tl.constexpr, NB: tl.constexpr):
    """Receive item k: (source index i, item kk of that source, the source's flag of tile 0, the
    source's number of tiles)."""
    i = _which(meta_ptr, RC_START, k, PEERS)
    kk = k - _meta(meta_ptr, RC_START, i, PEERS)
    f0 = _as_ptr(_meta(meta_ptr, RC_F, i, PEERS), tl.int32)
    return i, kk, f0, _n_tiles(_meta(meta_ptr, RC_NBLK, i, PEERS), NB)


@triton.jit
def _landed(f0, kk, n_tiles, epoch, ITEM: tl.constexpr, SFLAG: tl.constexpr):
    """Whether every flag of receive item kk holds `epoch` (one read each, acquire at system scope),
    and (SFLAG) whether every one also has FAST_BIT (False without SFLAG)."""
    if ITEM == 1:
        v = tl.atomic_add(f0 + kk, 0, sem="acquire", scope="sys")
        fast = v < 0
        if SFLAG:
            v = v & EPOCH_BITS
        ok = v == epoch
    else:
        ft = kk * ITEM + tl.arange(0, ITEM)
        v = tl.atomic_add(f0 + ft, tl.zeros([ITEM], tl.int32), mask=ft < n_tiles, sem="acquire", scope="sys")
        fast = tl.max(tl.where(ft < n_tiles, v, -1), axis=0) < 0
        if SFLAG:
            v = v & EPOCH_BITS
        ok = tl.min(tl.where(ft < n_tiles, v == epoch, True).to(tl.int32), axis=0) == 1
    return ok, fast  # fast: meaningless without SFLAG (unused there)


@triton.jit
def _recv_tile(y_ptr, ys_ptr, meta_ptr, i, kk, fast, NB: tl.constexpr, ITEM: tl.constexpr, SUB: tl.constexpr,
               RSTAGES: tl.constexpr, PEERS: tl.constexpr, IN_BF16: tl.constexpr, DEQUANT: tl.constexpr,
               SFLAG: tl.constexpr):
    """Dequantize (or copy out) item kk of source index i, whose flags were acquired. SFLAG: `fast`
    (every flag had FAST_BIT) picks the dequantize's path for the whole item; else each register
    tile's smallest scale does."""
    tl.debug_barrier()  # the acquire of the flags, then every thread's loads
    blk0 = kk * (ITEM * NB)
    yblk = _meta(meta_ptr, RC_YBLK, i, PEERS) + blk0
    nblk = _meta(meta_ptr, RC_NBLK, i, PEERS) - blk0
    q_src = _as_ptr(_meta(meta_ptr, RC_Q, i, PEERS), tl.uint8) + blk0 * 32
    s_src = _as_ptr(_meta(meta_ptr, RC_S, i, PEERS), tl.uint8) + blk0
    if DEQUANT:
        # The scales as int32 words, one load a block row (4-byte loads become asynchronous copies,
        # single bytes do not): the slot's scales start on 256 bytes, an item on a multiple of 4
        # blocks, and the region is padded to 256 bytes (a word past the last block is readable).
        s_words = s_src.to(tl.pointer_type(tl.int32))
        for u in tl.range(0, ITEM * NB // SUB, num_stages=RSTAGES):
            b = tl.arange(0, SUB) + u * SUB
            bmask = b < nblk
            offs = b[:, None] * 32 + tl.arange(0, 32)[None, :]
            q = tl.load(q_src + offs, mask=bmask[:, None], other=0, cache_modifier=".cg").to(tl.int32)
            w = tl.load(s_words + b // 4, mask=bmask, other=0x7F7F7F7F, cache_modifier=".cg")
            s = (w >> (8 * (b % 4)).to(tl.int32)) & 0xFF  # little-endian: block b's scale at bit 8 (b % 4)
            if SFLAG:  # each scale read once: no second load and no reduction across warps for its min
                smin = tl.where(fast, 10, 0)
            else:
                smin = tl.min(s, axis=0)
            _dequant_store(q, s[:, None], smin, y_ptr + yblk * 32, offs, bmask[:, None], IN_BF16)
    else:
        for u in tl.range(0, ITEM * NB // SUB, num_stages=RSTAGES):
            b = tl.arange(0, SUB) + u * SUB
            bmask = b < nblk
            offs = b[:, None] * 32 + tl.arange(0, 32)[None, :]
            q = tl.load(q_src + offs, mask=bmask[:, None], other=0, cache_modifier=".cg")
            tl.store(y_ptr + yblk * 32 + offs, q, mask=bmask[:, None])
            s = tl.load(s_src + b, mask=bmask, other=0, cache_modifier=".cg")
            tl.store(ys_ptr + yblk + b, s, mask=bmask)


@triton.jit
def _wait(ptr, want, timeout, err_ptr, code, SCOPE: tl.constexpr, CLOCK: tl.constexpr,
          MASK: tl.constexpr = -1):
    """Spin until *ptr (int32) & MASK == want (acquire at SCOPE), at most `timeout` (globaltimer ns, or
    polls without CLOCK). Returns (True when it holds, the last value read); else writes `code` into
    the error word and traps (GPU) or returns (False, the value) (interpreter)."""
    if CLOCK:
        t0 = globaltimer()
    else:
        t0 = want.to(tl.int64) * 0
    waited = t0 - t0
    v = tl.atomic_add(ptr, 0, sem="acquire", scope=SCOPE)
    while ((v & MASK) != want) & (waited < timeout):
        v = tl.atomic_add(ptr, 0, sem="acquire", scope=SCOPE)
        if CLOCK:
            waited = globaltimer() - t0
        else:
            waited += 1
    if (v & MASK) != want:
        tl.atomic_xchg(err_ptr, code.to(tl.int64))
        if CLOCK:
            tl.inline_asm_elementwise("trap;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
    return (v & MASK) == want, v


@triton.jit
def _recv_before(c, delay, n_comm, n_recv):
    """Receive tiles among the first c communication items: none before `delay`, then spread evenly."""
    return tl.minimum(tl.maximum(c - delay, 0) * n_recv // (n_comm - delay), n_recv)


@triton.jit(do_not_specialize=["epoch", "n_store", "n_own", "n_recv", "delay", "own_xblk", "own_yblk",
                               "own_nblk", "timeout", "nprog"])
def exchange_kernel(x_ptr, y_ptr, ys_ptr, meta_ptr, ctr_ptr, def_ptr, err_ptr, epoch, n_store, n_own,
                    n_recv, delay, own_xblk, own_yblk, own_nblk, timeout, nprog, PEERS: tl.constexpr,
                    NB: tl.constexpr, ITEM: tl.constexpr, SUB: tl.constexpr, SSUB: tl.constexpr,
                    RSUB: tl.constexpr, STAGES: tl.constexpr, RSTAGES: tl.constexpr, IN_BF16: tl.constexpr,
                    DEQUANT: tl.constexpr, CLOCK: tl.constexpr, SFLAG: tl.constexpr,
                    MODE: tl.constexpr, IS_E5M2: tl.constexpr, EMAX: tl.constexpr, MBITS: tl.constexpr,
                    MIN_EXP: tl.constexpr, MAXBITS: tl.constexpr, RCEIL_C: tl.constexpr,
                    T127: tl.constexpr, T126: tl.constexpr, SOFT: tl.constexpr):
    """One rank's whole exchange. x: bits of the input rows (int16 bf16 / int32 fp32). y: output bits
    (x's type; DEQUANT) or elements (uint8; dispatch), ys: scales (uint8; dispatch only). meta: int64
    (12, PEERS + 1), see symm.py. ctr: int32 (4 * CTR_STRIDE,): the ticket, finished programs,
    finished front items and deferred receives at k * CTR_STRIDE (own 128-byte lines: spinning reads
    of one do not slow the atomics of another), zero at launch and left zero. def: int32
    (>= n_recv,), the deferred receive tiles. err: int64, after a timeout 1 + source index * 2^32 +
    tile (a peer's tile), or -1 (this rank's front). Block offsets (`*blk`) count blocks of 32
    elements. NB: blocks per flag tile (ITEM tiles per work item), SUB: blocks per register tile of
    own items, SSUB: of store items (SSUB * 32 // (32 * num_warps) element bytes a thread in each
    store: 64 blocks and 8 warps give 8-byte stores, 128 give 16-byte ones), RSUB: of receive items
    (64: 8-byte loads of elements a thread, 128: 16-byte ones). SFLAG: fast-bit flags. delay:
    communication items (stores and receives) before the first receive, at most n_store."""
    n_comm = n_store + n_recv
    n_front = n_comm + n_own
    mine = n_front * 0  # front items this program finished
    # Tickets are relaxed atomics: they order nothing else (a release here would also wait for the
    # previous item's NVLink stores).
    t = tl.atomic_add(ctr_ptr, 1, sem="relaxed").to(tl.int64)
    while t < n_front:
        # The front spreads the communication items evenly among the own tiles, and the receives
        # evenly among the stores from the `delay`-th communication item on.
        c = (t * n_comm) // n_front
        if ((t + 1) * n_comm) // n_front > c:
            r = _recv_before(c, delay, n_comm, n_recv)
            if _recv_before(c + 1, delay, n_comm, n_recv) > r:
                # A receive: take it if its tile has landed, else defer it to the back (no waiting here).
                i, kk, f0, n_tiles = _recv_where(meta_ptr, r, PEERS, NB)
                ok, fast = _landed(f0, kk, n_tiles, epoch, ITEM, SFLAG)
                if ok:
                    _recv_tile(y_ptr, ys_ptr, meta_ptr, i, kk, fast, NB, ITEM, RSUB, RSTAGES, PEERS, IN_BF16,
                               DEQUANT, SFLAG)
                else:
                    slot = tl.atomic_add(ctr_ptr + 3 * CTR_STRIDE, 1, sem="relaxed")
                    tl.store(def_ptr + slot, r.to(tl.int32))
            else:
                _store_item(x_ptr, meta_ptr, c - r, epoch, PEERS, NB, ITEM, SSUB, STAGES, SFLAG, IN_BF16,
                            MODE, IS_E5M2, EMAX, MBITS, MIN_EXP, MAXBITS, RCEIL_C, T127, T126, SOFT)
        else:
            _own_item(x_ptr, y_ptr, ys_ptr, t - c, own_xblk, own_yblk, own_nblk, NB, ITEM, SUB, STAGES,
                      IN_BF16, DEQUANT, MODE, IS_E5M2, EMAX, MBITS, MIN_EXP, MAXBITS, RCEIL_C, T127, T126,
                      SOFT)
        mine += 1
        t = tl.atomic_add(ctr_ptr, 1, sem="relaxed").to(tl.int64)
    # The back: once every front item is done (they never wait, so this comes), the deferred receives,
    # waiting for each tile's flag. Every store of this rank is done by then.
    tl.debug_barrier()
    tl.atomic_add(ctr_ptr + 2 * CTR_STRIDE, mine.to(tl.int32), sem="release")
    if _wait(ctr_ptr + 2 * CTR_STRIDE, n_front.to(tl.int32), timeout, err_ptr, t * 0 - 1, "gpu", CLOCK)[0]:
        n_def = tl.atomic_add(ctr_ptr + 3 * CTR_STRIDE, 0, sem="acquire")
        j = t - n_front
        while j < n_def:
            r = tl.atomic_add(def_ptr + j, 0, sem="acquire").to(tl.int64)
            i, kk, f0, n_tiles = _recv_where(meta_ptr, r, PEERS, NB)
            ok = n_tiles > 0  # (always: a pair has a tile)
            fast = ok  # SFLAG: and every flag's FAST_BIT
            for g in range(0, ITEM):
                ft = kk * ITEM + g
                if ok & (ft < n_tiles):
                    if SFLAG:
                        ok, v = _wait(f0 + ft, epoch, timeout, err_ptr, 1 + i * (1 << 32) + ft, "sys", CLOCK,
                                      EPOCH_BITS)
                        fast = fast & (v < 0)
                    else:
                        ok = _wait(f0 + ft, epoch, timeout, err_ptr, 1 + i * (1 << 32) + ft, "sys", CLOCK)[0]
            if ok:
                _recv_tile(y_ptr, ys_ptr, meta_ptr, i, kk, fast, NB, ITEM, RSUB, RSTAGES, PEERS, IN_BF16,
                           DEQUANT, SFLAG)
            j = tl.atomic_add(ctr_ptr, 1, sem="relaxed").to(tl.int64) - n_front
    # Every program took its last ticket before it counts itself finished: the last one resets.
    if tl.atomic_add(ctr_ptr + 1 * CTR_STRIDE, 1) == nprog - 1:
        tl.atomic_xchg(ctr_ptr, 0)
        tl.atomic_xchg(ctr_ptr + 1 * CTR_STRIDE, 0)
        tl.atomic_xchg(ctr_ptr + 2 * CTR_STRIDE, 0)
        tl.atomic_xchg(ctr_ptr + 3 * CTR_STRIDE, 0)
