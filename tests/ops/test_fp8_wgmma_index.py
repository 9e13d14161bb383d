"""The Gluon fp8 kernel (mxmoe/ops/fp8_wgmma.py) run on CPU, for the launches of the GPU tests in
tests/ops/test_fp8_gemm.py and for random ragged groups.

The kernel's own source runs here as plain Python: its device functions (`_tile`, `_issue_loads`,
`_store_tile`, and for the whole-kernel emulation `_fp8_ws_kernel` with everything it calls) are
executed with `gl`, `tma`, `mbarrier` and `warpgroup_mma` replaced by small shims, so what is checked
is the kernel's code, not a copy of it. Shared memory is numpy arrays (NaN until written), a TMA copy
a synchronous box copy with zero fill, each mbarrier tracks arrivals, transaction bytes and phases,
a wgmma is an fp64 matmul rounded to fp32. The grid runs one CTA after another (races between CTAs
are out of reach); within a CTA the partitions run as threads taking turns at the mbarriers in a
fixed priority (`_Partitions`: the loader ahead of the consumers as far as the ring lets it, or the
consumers ahead), so a wait that could never complete or would read a stale ring slot, a copy still
in flight at exit, a race between partitions and wrong results are in reach (a missing wait shows
as a hang or a wrong result: `test_ws_emulation_catches_a_broken_ring`).

Checked, for every TMA copy the kernel would issue:
- the coordinate along the descriptor's innermost dimension is a multiple of 16 bytes (Hopper
  traps otherwise: "an illegal instruction was encountered"; Triton's interpreter asserts the same
  rule, "block offset start must be 16-byte aligned");
- the stage's `mbarrier.expect` byte count equals the bytes of the boxes it copies (a mismatch
  hangs or corrupts the ring);
and for every output element: stored exactly once, by a tile of its own group (grouped rows), or
zeroed (rows after offs[-1]); in the emulation, within the fp32 accumulation bound of the fp64
product.
"""

import threading
import types

import numpy as np
import pytest
import torch

from mxmoe.ops import fp8_wgmma
from mxmoe.ops.fp8_wgmma import WgmmaConfig
from mxmoe.recipe import MXRecipe

CONFIGS = [  # those of the GPU tests (tests/ops/test_fp8_gemm.py WGMMA_CONFIGS)
    fp8_wgmma.DEFAULT_CONFIG,
    WgmmaConfig(bn=64, bk=256, stages=3),
    WgmmaConfig(bk=64, stages=8),
    WgmmaConfig(persistent=False),
]


# ------------------------------------------------------------------------------------------------
# Shims: the few gl / tma / mbarrier operations the three device functions use, on Python ints and
# numpy arrays
# ------------------------------------------------------------------------------------------------


class _Arr(np.ndarray):
    def to(self, *_):
        return self


class _OffsPtr:
    def __init__(self, vals, off=0):
        self.vals, self.off = vals, off

    def __add__(self, k):
        return _OffsPtr(self.vals, self.off + int(k))

    def __sub__(self, k):
        return _OffsPtr(self.vals, self.off - int(k))


class _Out:
    """c_ptr: `c_ptr + offsets` gives the element offsets a store writes."""

    dtype = types.SimpleNamespace(element_ty=None)

    def __add__(self, offsets):
        return _Ptrs(np.asarray(offsets))


class _Ptrs:
    dtype = _Out.dtype

    def __init__(self, offsets):
        self.offsets = offsets

    def __add__(self, more):
        return _Ptrs(self.offsets + np.asarray(more))


class _Acc:
    def to(self, *_):
        return self


class _Recorder:
    def __init__(self):
        self.stores = []  # element offsets written
        self.expects = []  # (barrier, bytes)
        self.copies = []  # (descriptor, coordinates, barrier)
        self.bars = []  # the mbarriers of the CTA being emulated


def _gl_shim(rec: _Recorder):
    def store(ptrs, _value, mask):
        rec.stores.append(ptrs.offsets[np.broadcast_to(mask, ptrs.offsets.shape)])

    return types.SimpleNamespace(
        load=lambda p, **_: int(p.vals[p.off]),
        cdiv=lambda a, b: -(-a // b),
        where=lambda c, a, b: a if c else b,
        minimum=min,
        maximum=max,
        static_range=range,
        arange=lambda a, b, layout=None: np.arange(a, b).view(_Arr),
        SliceLayout=lambda *_: None,
        int64=None,
        store=store,
    )


def _tma_shim(rec: _Recorder):
    def copy(desc, coords, bar, _smem, pred=True):
        if pred:
            rec.copies.append((desc, [int(c) for c in coords], bar))

    def expect(bar, nbytes, pred=True):
        if pred:
            rec.expects.append((bar, nbytes))

    return (types.SimpleNamespace(async_copy_global_to_shared=copy),
            types.SimpleNamespace(expect=expect))


def _host(jit_fn, **names):
    """The device function's Python source, run with `names` in place of its module globals."""
    fn = jit_fn.fn
    return types.FunctionType(fn.__code__, {**fn.__globals__, **names}, fn.__name__, fn.__defaults__,
                              fn.__closure__)


class _Desc:
    """A host TensorDescriptor seen as the kernel sees it (block_type), keeping the host one."""

    def __init__(self, name, d):
        self.name, self.host = name, d
        nbytes = int(np.prod(d.block_shape)) * d.base.element_size()
        self.block_type = types.SimpleNamespace(shape=list(d.block_shape), nbytes=nbytes)


class _Smem:
    def index(self, i):
        return i


class _Ready:
    def index(self, s):
        return s


# ------------------------------------------------------------------------------------------------
# One launch on CPU: the launcher's arguments, then the kernel's tiles, loads and stores
# ------------------------------------------------------------------------------------------------


def launch_args(monkeypatch, aq, as_, bq, bs, offs, out, cfg):
    got = {}
    monkeypatch.setattr(fp8_wgmma, "_fp8_ws_kernel", WsLaunch(got))
    monkeypatch.setattr(fp8_wgmma, "_resident_ctas", lambda cfg, device: 10**9)  # one CTA per tile
    fp8_wgmma.launch(aq, as_, bq, bs, offs, out, cfg)
    monkeypatch.undo()
    return got


def run_index_math(got):
    """The kernel's tiles, TMA copies and stores for one launch (every tile of the grid)."""
    a_desc, b_desc, sa_desc, sb_desc, _c, offs_t, M, N, K, E, KB_PAD, stride_cm, stride_ce = got["args"]
    kw = got["kw"]
    mode, BM, BN, BK, STAGES, GROUP_M = (kw[k] for k in ("MODE", "BM", "BN", "BK", "STAGES", "GROUP_M"))
    rec = _Recorder()
    gl_ = _gl_shim(rec)
    tma_, mbar_ = _tma_shim(rec)
    tile_fn = _host(fp8_wgmma._tile, gl=gl_)
    store_fn = _host(fp8_wgmma._store_tile, gl=gl_)
    loads_fn = _host(fp8_wgmma._issue_loads, gl=gl_, tma=tma_, mbarrier=mbar_)
    descs = [_Desc(n, d) for n, d in zip(("a", "b", "sa", "sb"), (a_desc, b_desc, sa_desc, sb_desc),
                                         strict=True)]
    smem = [_Smem()] * 4
    offs_l = offs_t.tolist()
    offs_p = _OffsPtr(offs_l)
    grid = got["grid"]
    num_tiles = grid[0]
    num_n = -(-N // BN)
    assert num_tiles % num_n == 0
    num_m = num_tiles // num_n
    grouped = mode == 1

    def stage(kstep, m0, n0, b_row, sb_row, k0):
        n_before = len(rec.copies)
        loads_fn(*descs, *smem, _Ready(), kstep % STAGES, kstep, m0, n0, b_row, sb_row, k0, True, BK)
        bar, nbytes = rec.expects[-1]
        new = rec.copies[n_before:]
        assert all(c[2] == bar for c in new)
        assert nbytes == sum(d.block_type.nbytes for d, _, _ in new), "expect bytes != copied bytes"

    tiles = []
    for t in range(num_tiles):
        if mode == 2:
            for e in range(grid[1]):
                k_lo = offs_l[e - 1] if e > 0 else 0
                n_blocks = (offs_l[e] - k_lo) // 32
                _, m0, n0, b_row, sb_row, row_lo, row_hi = tile_fn(t, offs_p, M, N, E, KB_PAD, num_m, num_n,
                                                                   False, BM, BN, GROUP_M)
                for kstep in range(-(-n_blocks // (BK // 32))):
                    stage(kstep, m0, n0, b_row, sb_row, k_lo)
                store_fn(_Out() + e * stride_ce, _Acc(), m0, n0, row_lo, row_hi, N, stride_cm, BM, BN, None)
            continue
        kind, m0, n0, b_row, sb_row, row_lo, row_hi = tile_fn(t, offs_p, M, N, E, KB_PAD, num_m, num_n,
                                                              grouped, BM, BN, GROUP_M)
        n_stores = len(rec.stores)
        if kind == 1:
            for kstep in range(-(-K // BK)):
                stage(kstep, m0, n0, b_row, sb_row, 0)
            store_fn(_Out(), _Acc(), m0, n0, row_lo, row_hi, N, stride_cm, BM, BN, None)
        elif kind == 2:
            store_fn(_Out(), _Acc(), m0, n0, m0, M, N, stride_cm, BM, BN, None)
        tiles.append((kind, b_row // N if kind == 1 else -1, rec.stores[n_stores:]))
    return rec, tiles


def check_tma_alignment(rec):
    bad = []
    for d, coords, _ in rec.copies:
        inner_bytes = coords[-1] * d.host.base.element_size()
        if inner_bytes % 16:
            bad.append((d.name, coords))
    assert not bad, f"{len(bad)} TMA copies with an innermost coordinate not 16-byte aligned, e.g. {bad[:4]}"


def check_rows_coverage(tiles, offs, M, N):
    """Grouped rows: every (row, column) written exactly once, by its group's tile or a zero tile."""
    group_of = np.full(M, -1)
    lo = 0
    for g, hi in enumerate(offs):
        group_of[lo:hi] = g
        lo = hi
    count = np.zeros(M * N, dtype=np.int64)
    for kind, g, stores in tiles:
        for offsets in stores:
            np.add.at(count, offsets, 1)
            rows = offsets // N
            want = group_of[rows]
            assert (want == g).all(), f"a tile of group {g} (kind {kind}) stores rows of groups {set(want)}"
    never, twice = int((count == 0).sum()), int((count > 1).sum())
    assert never == twice == 0, f"{never} outputs never stored, {twice} more than once"


# ------------------------------------------------------------------------------------------------
# Cases: the GPU tests' launches (file order), then random ragged groups
# ------------------------------------------------------------------------------------------------


def _q(rows, k, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-8, 8, (rows, k), generator=g).to(torch.float8_e4m3fn)
    s = torch.randint(120, 130, (rows, k // 32), generator=g).to(torch.uint8).view(torch.float8_e8m0fnu)
    return q, s


def rows_case(counts, extra, N, K):
    E, T = len(counts), sum(counts) + extra
    aq, as_ = _q(T, K, 1)
    bq, bs = _q(E * N, K, 2)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    return aq, as_, bq.view(E, N, K), bs.view(E, N, K // 32), offs, torch.empty(T, N)


def k_case(kc, M, N):
    T = max(32, sum(kc))
    aq, as_ = _q(M, T, 3)
    bq, bs = _q(N, T, 4)
    offs = torch.tensor(kc).cumsum(0).to(torch.int32)
    return aq, as_, bq, bs, offs, torch.empty(len(kc), M, N)


def dense_case(M, N, K):
    aq, as_ = _q(M, K, 5)
    bq, bs = _q(N, K, 6)
    return aq, as_, bq, bs, None, torch.empty(M, N)


# (test, case builder args, configs): the launches of tests/ops/test_fp8_gemm.py's GPU tests that call
# the kernel directly, in file order; test_gpu_grouped's first launch is the one that trapped on the H200
ALL = list(range(len(CONFIGS)))
GPU_TEST_LAUNCHES = [
    ("test_gpu_dense[512]", dense_case, (512, 768, 1024), [0]),
    ("test_gpu_dense[1000]", dense_case, (1000, 300, 4096), [0]),
    ("test_gpu_exact_and_adversarial/exact", dense_case, (300, 264, 2048), [0]),
    ("test_gpu_exact_and_adversarial/adv", dense_case, (256, 320, 1024), [0]),
    ("test_gpu_grouped/rows", rows_case, ([0, 300, 1, 0, 555, 128, 0, 40], 17, 256, 512), [0]),
    ("test_gpu_grouped/k", k_case, ([0, 320, 32, 0, 640, 96], 200, 136), [0]),
    ("test_gpu_scale_byte_extremes", dense_case, (4, 4, 64), [0]),
    ("test_gpu_wgmma_edges_and_tiles/dense", dense_case, (333, 250, 1056), ALL),
    ("test_gpu_wgmma_edges_and_tiles/rows", rows_case, ([0, 130, 1, 0, 70, 128, 0], 9, 250, 1056), ALL),
    ("test_gpu_wgmma_edges_and_tiles/k", k_case, ([0, 160, 32, 0, 416, 96, 224], 200, 136), ALL),
    ("test_gpu_wgmma_persistent_many_tiles/dense", dense_case, (2048, 2304, 256), ALL),
    ("test_gpu_wgmma_persistent_many_tiles/rows", rows_case,
     ([700, 0, 1, 1400, 0, 333, 900, 64], 40, 1024, 256), ALL),
]


def _check_launch(monkeypatch, case, cfg):
    aq, as_, bq, bs, offs, out = case
    got = launch_args(monkeypatch, aq, as_, bq, bs, offs, out, cfg)
    rec, tiles = run_index_math(got)
    assert rec.copies or not out.numel()
    check_tma_alignment(rec)
    if got["kw"]["MODE"] == 1:
        check_rows_coverage(tiles, offs.tolist(), out.shape[0], out.shape[1])
    elif got["kw"]["MODE"] == 0:
        check_rows_coverage(tiles, [out.shape[0]], out.shape[0], out.shape[1])
    else:  # grouped K: every group's (M, N) output stored once (empty groups too: zeros)
        count = np.zeros(out.numel(), dtype=np.int64)
        for offsets in rec.stores:
            np.add.at(count, offsets, 1)
        assert (count == 1).all()


@pytest.mark.parametrize("name,build,args,cfgs", GPU_TEST_LAUNCHES, ids=[x[0] for x in GPU_TEST_LAUNCHES])
def test_gpu_test_launches_index_math(name, build, args, cfgs, monkeypatch):
    """Every launch of the GPU tests: TMA coordinates 16-byte aligned along the innermost dimension,
    expect bytes = copied bytes, every output stored once by its own group."""
    case = build(*args)
    for i in cfgs:
        _check_launch(monkeypatch, case, CONFIGS[i])


@pytest.mark.parametrize("seed", range(4))
def test_random_ragged_groups_index_math(seed, monkeypatch):
    """Ragged and empty groups at every row offset mod 4 and mod the tile, many groups (the grid's
    row-tile bound), every config."""
    g = torch.Generator().manual_seed(seed)
    E = [3, 9, 33, 70][seed]
    counts = torch.randint(0, 90, (E,), generator=g)
    counts[torch.randint(0, E, (E // 3,), generator=g)] = 0
    counts = counts.tolist()
    case = rows_case(counts, int(torch.randint(0, 7, (1,), generator=g)), 72, 256)
    for cfg in CONFIGS:
        _check_launch(monkeypatch, case, cfg)


# ------------------------------------------------------------------------------------------------
# The whole kernel on CPU: `_fp8_ws_kernel`'s source run grid-sequentially with every device
# function of the module shimmed (shared memory as numpy arrays, TMA as a synchronous box copy with
# zero fill, each mbarrier's arrivals, transaction bytes and phases tracked, wgmma as an fp64 matmul)
# ------------------------------------------------------------------------------------------------


class _I(int):
    """A device scalar: int arithmetic with `.to` (as `gl.program_id(1).to(gl.int64)`)."""

    def to(self, *_):
        return _I(self)


for _op in ("add", "sub", "mul", "floordiv", "mod", "radd", "rsub", "rmul", "rfloordiv", "and", "or", "xor",
            "rand", "ror", "lt", "le", "gt", "ge", "eq", "ne"):
    def _make(name):
        base = getattr(int, f"__{name}__")
        return lambda self, other: (lambda r: r if r is NotImplemented else _I(r))(base(self, other))
    setattr(_I, f"__{_op}__", _make(_op))
_I.__hash__ = int.__hash__
_I.__neg__ = lambda self: _I(-int(self))


class _Bar:
    """One mbarrier: init(count), arrive/expect (count 1 each), transaction bytes, completed phases."""

    def __init__(self):
        self.count = self.pending = self.tx = self.phase = 0
        self.live = False

    def check_phase(self):
        if self.pending == 0 and self.tx == 0:
            self.phase += 1
            self.pending = self.count


class _View:
    def __init__(self, a, bars=None):
        self.a, self.bars = a, bars

    @property
    def shape(self):
        return self.a.shape

    def index(self, i):
        if self.bars is not None:
            return self.bars[int(i)]
        return _View(self.a[int(i)])

    def slice(self, start, length, dim=0):
        idx = [slice(None)] * self.a.ndim
        idx[dim] = slice(int(start), int(start) + length)
        return _View(self.a[tuple(idx)])

    def permute(self, order):
        return _View(self.a.transpose(order))

    def _reinterpret(self, _dtype, shape, layout):
        if isinstance(layout, tuple) and layout[0] == "linear":  # `_sb_perm_layout`: offset -> column
            cols = [0] * len(self.a)
            for o in range(len(self.a)):
                for i, (b,) in enumerate(layout[1]):
                    if o >> i & 1:
                        cols[o] ^= b
            logical = np.empty_like(self.a)
            logical[cols] = self.a
            return _View(logical)
        return _View(self.a.reshape(shape))

    def load(self, _layout=None):
        return np.array(self.a, dtype=np.float32).view(_Arr)


class WsLaunch:
    """`_fp8_ws_kernel[grid](...)` intercepted: records the launch into `got`."""

    def __init__(self, got):
        self.got = got

    def __getitem__(self, grid):
        def record(*args, maxnreg, **kw):
            assert maxnreg == fp8_wgmma.WS_MAXNREG and kw["num_warps"] == 4
            self.got.update(grid=grid, args=args, kw=kw)
        return record


class _Partitions:
    """`gl.warp_specialize` on CPU, deterministic: every partition a thread, but one runs at a
    time; at each mbarrier wait or state change (arrival, expect, copy) the scheduler hands the
    turn to the first partition in `order` (indices into the warp_specialize list) that can run
    (not waiting on a phase that has not completed). "loader": the loader (the last partition)
    first, so it runs ahead as far as the `empty` barriers let it (a refill racing a read shows as
    a wrong result); "consumers": the consumers first (a read racing its fill shows as NaN, the
    shared memory's initial value). No partition able to run while some have not finished: a hang,
    reported at once."""

    def __init__(self, order="loader"):
        self.cond = threading.Condition()
        self.order = order
        self.local = threading.local()
        self.active = False

    def run(self, functions_and_args, worker_num_warps, worker_num_regs):
        assert len(functions_and_args) == len(worker_num_warps) + 1 == len(worker_num_regs) + 1
        assert all(24 <= r <= 256 and r % 8 == 0 for r in worker_num_regs)
        n = len(functions_and_args)
        self.prio = list(range(n))[::-1] if self.order == "loader" else list(range(n))
        self.blocked = {}  # partition -> the condition it waits for
        self.done, self.turn, self.failed = set(), None, None

        def body(i, fn, args):
            self.local.i = i
            try:
                with self.cond:
                    self._await_turn(i)
                fn(*args)
            except BaseException as e:  # noqa: BLE001 (re-raised in the launching thread)
                with self.cond:
                    self.failed = self.failed or e
            finally:
                with self.cond:
                    self.done.add(i)
                    self._schedule(n)

        threads = [threading.Thread(target=body, args=(i, *fa), daemon=True)
                   for i, fa in enumerate(functions_and_args)]
        self.active = True
        for t in threads:
            t.start()
        with self.cond:
            self._schedule(n)
        for t in threads:
            t.join(timeout=600)
        self.active = False
        if self.failed is not None:
            raise self.failed

    def _schedule(self, n):
        """(under the lock) Give the turn to the first partition in priority order that can run."""
        self.turn = next((i for i in self.prio if i not in self.done
                          and (i not in self.blocked or self.blocked[i]())), None)
        if self.turn is None and len(self.done) < n and self.failed is None:
            waits = {i: self.blocked[i].__doc__ for i in self.blocked if i not in self.done}
            self.failed = AssertionError(f"hang: every unfinished partition waits on a phase that "
                                         f"never completes: {waits}")
        self.cond.notify_all()

    def _await_turn(self, i):
        self.cond.wait_for(lambda: self.turn == i or self.failed is not None)
        if self.failed is not None:
            raise RuntimeError("another partition failed")

    def switch(self, until=None):
        """A scheduling point of the calling partition: it waits for `until` (a predicate) if given,
        and runs again when it is its turn."""
        i = self.local.i
        with self.cond:
            if until is not None:
                self.blocked[i] = until
            self._schedule(len(self.prio))
            self._await_turn(i)
            self.blocked.pop(i, None)

    def wait(self, bar, parity):
        """Until the phase of parity `parity` has completed: the barrier's current (incomplete)
        phase has the other parity (a fresh barrier: phase 0 running, so parity 1 passes)."""
        def done():
            return (bar.phase & 1) != int(parity)
        done.__doc__ = f"parity {int(parity)}, {bar.phase} phases completed"
        self.switch(done)

    def update(self, change):
        """Apply `change` (an mbarrier's state) under the lock; then a scheduling point."""
        with self.cond:
            change()
        if self.active:
            self.switch()


def _kernel_shims(rec: _Recorder, pid, nprog, out_flat, descs_np, order="loader"):
    def alloc(dtype, shape, _layout):
        if dtype == "i64":
            bars = [_Bar() for _ in range(shape[0])]
            rec.bars.extend(bars)
            return _View(None, bars=bars)
        return _View(np.full(shape, np.nan))  # never-written shared memory poisons the result

    def load(p, mask=True, other=0):
        return _I(p.vals[p.off]) if mask else _I(other)

    def store(ptrs, value, mask):
        m = np.broadcast_to(mask, ptrs.offsets.shape)
        out_flat[ptrs.offsets[m]] = np.asarray(value, dtype=np.float32)[m]

    def init(bar, count):
        bar.count = bar.pending = count
        bar.live = True

    def expect(bar, nbytes, pred=True):
        def change():
            assert bar.live
            rec.expects.append((bar, nbytes))
            bar.pending -= 1
            bar.tx += nbytes
            bar.check_phase()

        if pred:
            parts.update(change)

    parts = _Partitions(order)

    def wait(bar, parity):
        if parts.active:
            return parts.wait(bar, parity)
        # sequential: every copy has landed, so a phase not completed yet never will (a hang)
        assert bar.phase >= 1 and (bar.phase - 1) & 1 == int(parity), \
            f"mbarrier wait for parity {parity} after {bar.phase} completed phases: a hang or a stale slot"

    def arrive(bar, count=1, pred=True):
        def change():
            assert bar.live and bar.pending >= count, "more arrivals than the mbarrier's count"
            bar.pending -= count
            bar.check_phase()

        if pred:
            parts.update(change)

    def invalidate(bar):
        assert bar.pending == bar.count and bar.tx == 0, "mbarrier invalidated with a TMA copy in flight"
        bar.live = False

    def copy(desc, coords, bar, dst, pred=True):
        if not pred:
            return
        rec.copies.append((desc, [int(c) for c in coords], bar))
        src = descs_np[desc.name]
        (r0, c0), (br, bc) = coords, desc.block_type.shape
        box = np.zeros((br, bc))
        rs, cs = slice(max(r0, 0), min(r0 + br, src.shape[0])), slice(max(c0, 0), min(c0 + bc, src.shape[1]))
        if rs.start < rs.stop and cs.start < cs.stop:
            box[rs.start - r0:rs.stop - r0, cs.start - c0:cs.stop - c0] = src[rs, cs]
        dst.a[...] = box

        def change():
            bar.tx -= desc.block_type.nbytes
            assert bar.tx >= 0, "more bytes copied than expected on the mbarrier"
            bar.check_phase()

        parts.update(change)

    gl_ = _gl_shim(rec)
    gl_.__dict__.update(
        load=load, store=store, allocate_shared_memory=alloc, int64="i64", float8e4nv="f8", float32="f32",
        int32="i32", NVMMADistributedLayout=lambda **_: None, SwizzledSharedLayout=lambda *a, **k: None,
        SharedLinearLayout=lambda bases: ("linear", bases),
        zeros=lambda shape, *_: np.zeros(shape, np.float32).view(_Arr),
        program_id=lambda axis: _I(pid[axis]), num_programs=lambda axis: _I(nprog[axis]),
        to_tensor=lambda x: x, warp_specialize=parts.run)
    mbar_ = types.SimpleNamespace(MBarrierLayout=lambda: None, init=init, expect=expect, wait=wait,
                                  invalidate=invalidate, arrive=arrive)
    tma_ = types.SimpleNamespace(async_copy_global_to_shared=copy)

    def mma(a, b, _acc, use_acc=False, is_async=True):
        return (a.a.astype(np.float64) @ b.a.astype(np.float64)).astype(np.float32).view(_Arr)

    return dict(gl=gl_, mbarrier=mbar_, tma=tma_, fence_async_shared=lambda: None, warpgroup_mma=mma,
                warpgroup_mma_wait=lambda n, deps: deps[0])


def emulate_kernel(got, patch=None, order="loader"):
    """Run the launch `got` (from `launch_args`) through the kernel's own source; returns the
    recorder (copies for the alignment check) and fills the launch's output tensor. `patch`:
    device function name -> (shims -> globals to override in that function only); `order`: the
    warp-specialized kernel's partition priority (`_Partitions`)."""
    a_desc, b_desc, sa_desc, sb_desc, out, offs_t, *ints = got["args"]
    assert out.dtype == torch.float32 and out.is_contiguous()
    descs = {n: _Desc(n, d) for n, d in zip(("a", "b", "sa", "sb"), (a_desc, b_desc, sa_desc, sb_desc),
                                            strict=True)}
    for d in descs.values():
        d.layout = None
    descs_np = {n: d.host.base.float().numpy().astype(np.float64) for n, d in descs.items()}
    out_flat = out.view(-1).numpy()
    rec = _Recorder()
    grid = tuple(got["grid"]) + (1,) * (3 - len(got["grid"]))
    pid = [0, 0, 0]
    shims = _kernel_shims(rec, pid, grid, out_flat, descs_np, order)
    jit = {k: v for k, v in vars(fp8_wgmma).items() if hasattr(v, "fn") and callable(getattr(v, "fn", None))}
    hosts = {}
    for k, v in jit.items():  # each device function sees the others' host versions
        hosts[k] = types.FunctionType(v.fn.__code__, {}, v.fn.__name__, v.fn.__defaults__, v.fn.__closure__)
    for k, v in jit.items():
        hosts[k].__globals__.update({**v.fn.__globals__, **shims, **hosts})
    for k, override in (patch or {}).items():
        f = hosts[k]
        hosts[k] = types.FunctionType(f.__code__, {**f.__globals__, **override(shims)}, f.__name__,
                                      f.__defaults__, f.__closure__)
        for h in hosts.values():
            h.__globals__[k] = hosts[k]
    kernel = hosts["_fp8_ws_kernel"]
    for p1 in range(grid[1]):
        for p0 in range(grid[0]):
            pid[0], pid[1] = p0, p1
            rec.bars = []
            kernel(descs["a"], descs["b"], descs["sa"], descs["sb"], _Out(), _OffsPtr(offs_t.tolist()),
                   *[_I(x) for x in ints], **got["kw"])
            # at the CTA's exit: no TMA copy in flight, no phase half-arrived
            assert all(b.tx == 0 and b.pending == b.count for b in rec.bars), "a CTA exits mid-phase"
    return rec


def _emulated(monkeypatch, case, cfg, resident=10**9, patch=None, order="loader"):
    aq, as_, bq, bs, offs, out = case
    got = {}
    monkeypatch.setattr(fp8_wgmma, "_fp8_ws_kernel", WsLaunch(got))
    monkeypatch.setattr(fp8_wgmma, "_resident_ctas", lambda cfg, device: resident)
    fp8_wgmma.launch(aq, as_, bq, bs, offs, out, cfg)
    monkeypatch.undo()
    got["args"] = (*got["args"][:4], out, *got["args"][5:])
    rec = emulate_kernel(got, patch, order)
    check_tma_alignment(rec)
    return out


def _dq64(q, s):
    f = torch.exp2(s.view(torch.uint8).double() - 127)
    return q.double() * torch.repeat_interleave(f, 32, dim=-1)


def _reference(case):
    """(fp64 result, fp64 sum of |products|, reduction length) of a case."""
    aq, as_, bq, bs, offs, out = case
    A, B = _dq64(aq, as_), _dq64(bq.reshape(-1, bq.shape[-1]), bs.reshape(-1, bs.shape[-1]))
    if offs is None:
        return A @ B.t(), A.abs() @ B.abs().t(), A.shape[1]
    ref, mag = torch.zeros(out.shape, dtype=torch.float64), torch.zeros(out.shape, dtype=torch.float64)
    lo = 0
    for e, hi in enumerate(offs.tolist()):
        if bq.ndim == 3:  # grouped rows
            Be = B.view(bq.shape[0], bq.shape[1], -1)[e]
            ref[lo:hi], mag[lo:hi] = A[lo:hi] @ Be.t(), A[lo:hi].abs() @ Be.abs().t()
        else:  # grouped K
            ref[e], mag[e] = A[:, lo:hi] @ B[:, lo:hi].t(), A[:, lo:hi].abs() @ B[:, lo:hi].abs().t()
        lo = hi
    return ref, mag, A.shape[1]


def test_mx_ops_on_the_emulated_gluon_kernel(monkeypatch):
    """mx_mm and mx_grouped_mm forward, dgrad and wgrad with gemm_backend='fp8' at the shapes of the
    GPU tests test_gpu_mx_ops_fp8_close_to_emulated and test_gpu_mx_grouped_mm_fp8_close_to_emulated
    (ragged and empty experts), every GEMM run by the emulated Gluon kernel in the operand layouts
    the ops hand it, against gemm_backend='emulated' on the same quantized operands."""
    from mxmoe.ops import fp8_gemm, mx_grouped_mm, mx_mm

    launches = []

    def gluon_on_cpu(a_q, a_s, b_q, b_s, offs, out_dtype, config=None):
        fp8_gemm._check(a_q, a_s, b_q, b_s, offs, out_dtype)
        out = torch.full(fp8_gemm._out_shape(a_q, b_q, offs), float("nan"))
        with pytest.MonkeyPatch.context() as mp:
            _emulated(mp, (a_q, a_s, b_q, b_s, offs, out), fp8_wgmma.DEFAULT_CONFIG)
        launches.append(None if offs is None else offs.tolist())
        return out.to(out_dtype)

    monkeypatch.setattr(fp8_gemm, "launch", gluon_on_cpu)
    monkeypatch.setattr(fp8_gemm, "why_unavailable", lambda device: None)
    kw = {"dim0_kernel": "torch", "dim1_kernel": "torch"}
    torch.manual_seed(0)
    x = torch.randn(1000, 1024, requires_grad=True)
    w = (torch.randn(768, 1024) * 0.03).requires_grad_()
    E, K, N = 6, 512, 384
    counts = [0, 300, 7, 0, 650, 64]
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    a = torch.randn(sum(counts) + 5, K, requires_grad=True)
    we = (torch.randn(E, N, K) * K**-0.5).requires_grad_()
    dy = torch.randn(a.shape[0], N)
    outs = []
    for backend in ("fp8", "emulated"):
        x.grad = w.grad = a.grad = we.grad = None
        cfg = MXRecipe(gemm_backend=backend, **kw)
        y = mx_mm(x, w.t(), cfg)
        y.square().sum().backward()
        ye = mx_grouped_mm(a, we.transpose(-2, -1), offs, cfg)
        ye.backward(dy)
        outs.append((y.detach(), x.grad, w.grad, ye.detach(), a.grad, we.grad))
    assert len(launches) == 6 and sum(lo is not None for lo in launches) == 3
    for got, ref in zip(outs[0], outs[1], strict=True):
        # same quantized operands, both fp32-accumulated in different orders (K up to 1024)
        assert (got - ref).abs().max() <= 1e-5 * ref.abs().max()
    assert not outs[0][5][0].any() and not outs[0][5][3].any()  # empty experts: zero dW


# ------------------------------------------------------------------------------------------------
# The warp-specialized kernel (`_fp8_ws_kernel`) on CPU: its partitions as threads taking turns at
# the emulated mbarriers (`_Partitions`), the loader running ahead of the consumers as far as the
# ring lets it, or the consumers ahead of the loader
# ------------------------------------------------------------------------------------------------


def _within_bound(out, ref, mag, k):
    err = (out.double() - ref).abs()
    bound = mag * (k + 2) * 2.0**-23 + (k // 32 + 1) * 2.0**-126
    return not torch.isnan(out).any() and bool((err <= bound).all())


@pytest.mark.parametrize("name,build,args,cfgs", GPU_TEST_LAUNCHES, ids=[x[0] for x in GPU_TEST_LAUNCHES])
def test_ws_kernel_emulated(name, build, args, cfgs, monkeypatch):
    """Every launch of the GPU tests through the kernel's source, each config the GPU test runs,
    3 persistent CTAs (several tiles per CTA: the ring's slots and phases run on across tiles),
    loader first and consumers first: no hang, no read of a slot before its fill or after its
    refill, aligned TMA copies, every output within the fp32 accumulation bound of the fp64
    product (rows after offs[-1] and empty groups exactly zero; the output starts as NaN)."""
    case = build(*args)
    ref, mag, k = _reference(case)
    for cfg in (CONFIGS[i] for i in cfgs):
        for order in ("loader", "consumers"):
            out = torch.full_like(case[5], float("nan"))
            _emulated(monkeypatch, (*case[:5], out), cfg, resident=3, order=order)
            assert _within_bound(out, ref, mag, k), (name, cfg, order)


@pytest.mark.parametrize("seed", range(2))
def test_ws_random_ragged_groups_emulated(seed, monkeypatch):
    """Random ragged and empty groups (starts at every row offset mod 4) through the kernel, every
    config, 2 persistent CTAs."""
    g = torch.Generator().manual_seed(200 + seed)
    E = [6, 19][seed]
    counts = torch.randint(0, 150, (E,), generator=g)
    counts[torch.randint(0, E, (E // 3,), generator=g)] = 0
    case = rows_case(counts.tolist(), int(torch.randint(0, 9, (1,), generator=g)), 72, 320)
    ref, mag, k = _reference(case)
    for cfg, order in zip(CONFIGS, ("loader", "consumers") * 2, strict=True):
        out = torch.full_like(case[5], float("nan"))
        _emulated(monkeypatch, (*case[:5], out), cfg, resident=2, order=order)
        assert _within_bound(out, ref, mag, k), (cfg, order)


# (the emulator's fp8 -> float copy of A warns on the NaN element it is given on purpose)
@pytest.mark.filterwarnings("ignore:invalid value encountered in cast:RuntimeWarning")
def test_ws_grouped_k_partial_stage_drops_the_next_groups_nan(monkeypatch):
    """Grouped K: a group's partial last stage (3 blocks; BK/32 = 2, 4, 8) also loads the next
    group's first blocks, which the check must drop without arithmetic: with a NaN A scale (byte
    255) and a NaN fp8 element in the next group's first block, the first group's output stays
    finite and within the bound (a multiply by 0 would leak the NaN), while the next group's rows
    that hold them are NaN; every config, loader first and consumers first."""
    M, N = 72, 136
    case = k_case([96, 160], M, N)
    aq, as_ = case[0], case[1]
    as_.view(torch.uint8)[5, 3] = 255  # row 5, block 3: the second group's first block
    aq.view(torch.uint8)[6, 3 * 32 + 7] = 0x7F  # row 6: an e4m3fn NaN element in that block
    ref, mag, k = _reference(case)
    for cfg in CONFIGS:
        for order in ("loader", "consumers"):
            out = torch.full_like(case[5], float("nan"))
            _emulated(monkeypatch, (*case[:5], out), cfg, resident=1, order=order)
            assert _within_bound(out[0], ref[0], mag[0], k), (cfg, order)
            assert out[1, 5:7].isnan().all(), (cfg, order)
            rest = torch.cat([out[1, :5], out[1, 7:]])
            assert _within_bound(rest, torch.cat([ref[1, :5], ref[1, 7:]]),
                                 torch.cat([mag[1, :5], mag[1, 7:]]), k), (cfg, order)


def _without(op):
    """A `patch` of `emulate_kernel`: the function's mbarrier `op` does nothing."""
    return lambda shims: {"mbarrier": types.SimpleNamespace(**{**vars(shims["mbarrier"]),
                                                               op: lambda *a, **k: None})}


@pytest.mark.parametrize("broken,order", [("_ws_loader/wait", "loader"), ("_ws_stage/arrive", "loader"),
                                          ("_ws_stage/wait", "consumers")])
def test_ws_emulation_catches_a_broken_ring(broken, order, monkeypatch):
    """The emulation's teeth: a loader that does not wait for the consumers' release (a refill
    racing the reads of the slot's previous stage), consumers that never release a slot, and
    consumers that do not wait for a slot's fill each fail: a hang or a wrong result."""
    case = dense_case(256, 128, 1024)  # 32 blocks: 8 stages through a 4-slot ring per tile
    ref, mag, k = _reference(case)
    fn, op = broken.split("/")
    out = torch.full_like(case[5], float("nan"))
    try:
        _emulated(monkeypatch, (*case[:5], out), CONFIGS[0], resident=1, patch={fn: _without(op)},
                  order=order)
    except AssertionError as e:
        assert "hang" in str(e) or "copied than expected" in str(e) or "arrivals" in str(e), e
        return
    assert not _within_bound(out, ref, mag, k), f"{broken} passed"
