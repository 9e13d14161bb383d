"""The symmetric-memory exchange's layout and protocol on CPU: W ranks as threads of one process, their
workspaces plain tensors that every thread can write (as NVLink peers can), the device barrier a
thread barrier. Each rank's result must equal quantize -> route rows -> dequantize, for uneven and
zero splits, both dtypes, the dispatch form, consecutive exchanges (alternating halves), and pairs too
large for a slot (the send/recv fallback)."""

from __future__ import annotations

import os
import threading

import pytest
import torch
from conftest import JobResult, assert_sm90_check
from test_comm_a2a import assert_same_bits, make_rows, split_matrix

from mxmoe.comm import symm
from mxmoe.comm.symm import Layout, halves_bytes, symm_mx_exchange, tiles
from mxmoe.comm.transport import offsets
from mxmoe.quant import custom_ops


class FakeWorld:
    """W ranks' workspaces (garbage until each rank's first exchange zeroes its own, as
    SymmWorkspace.ensure does) and a mailbox for the point-to-point fallback."""

    def __init__(self, world: int, nbytes: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.buffers = [
            torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g) for _ in range(world)
        ]
        self.sync = threading.Barrier(world, timeout=60)
        self.mail: dict[tuple[int, int], list] = {}  # (src, dst) -> [tensors...] per exchange, in order
        self.posted = threading.Condition()
        self.p2p_pairs: set[tuple[int, int]] = set()


class FakeWorkspace:
    def __init__(self, world: FakeWorld, rank: int) -> None:
        self.world, self.rank, self.buffers, self._calls = world, rank, world.buffers, 0
        self.nbytes = self.buffers[0].numel()
        self.counters = torch.zeros(4 * 32, dtype=torch.int32)
        self.deferred = torch.empty(0, dtype=torch.int32)
        self.error = torch.zeros(1, dtype=torch.int64)
        self._ready = False

    def ensure(self) -> None:
        """As SymmWorkspace.ensure: zero this rank's buffer once, then a barrier."""
        if not self._ready:
            self.buffers[self.rank].zero_()
            self.world.sync.wait()
            self._ready = True

    def next_epoch(self) -> int:
        self._calls += 1
        return self._calls

    def send_recv(self, sends, recvs) -> None:
        """Pairwise, like NCCL send/recv: only the two ends of a pair take part."""
        w = self.world
        with w.posted:
            for p, ts in sends.items():
                w.mail.setdefault((self.rank, p), []).append(tuple(t.clone() for t in ts))
                w.p2p_pairs.add((self.rank, p))
            w.posted.notify_all()
        for s, ts in recvs.items():
            with w.posted:
                assert w.posted.wait_for(lambda s=s: w.mail.get((s, self.rank)), timeout=60), "no send"
                got = w.mail[s, self.rank].pop(0)
            for dst, src in zip(ts, got, strict=True):
                dst.copy_(src)


def expected(xs: list[torch.Tensor], M, r: int, dequant: bool):
    """Rows sent to rank r by every source (in source order), quantized; dequantized if asked."""
    W = len(M)
    qs, ss = [], []
    for src in range(W):
        a = offsets(M[src])[r]
        q, s = custom_ops.quantize_dim0(xs[src][a : a + M[src][r]], "mxfp8_e4m3_rceil", "torch")
        qs.append(q)
        ss.append(s)
    q, s = torch.cat(qs), torch.cat(ss)
    if dequant:
        return custom_ops.dequantize(q, s, 32, xs[0].dtype, "torch")
    return q, s


def run_ranks(fn, world: int) -> list:
    results: list = [None] * world
    errors: list = []

    def target(r: int) -> None:
        try:
            results[r] = fn(r)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=target, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    if errors:
        raise errors[0]
    return results


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("kind", ["equal", "uneven", "zeros"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("nbytes", [1 << 16, 3000], ids=["fits", "p2p"])
def test_symm_exchange_matches_routing(world, kind, dtype, nbytes):
    """nbytes 3000: slots of a few rows, so the larger pairs take the send/recv fallback."""
    dim = 64
    M = split_matrix(world, kind)
    Mt = [list(c) for c in zip(*M, strict=True)]
    xs = [make_rows(sum(M[r]), dim, dtype, seed=3 + r) for r in range(world)]
    gs = [make_rows(sum(Mt[r]), dim, dtype, seed=50 + r) for r in range(world)]
    fw = FakeWorld(world, nbytes)
    cap = Layout(world, dim, halves_bytes(nbytes)).slot_rows

    def rank(r: int):
        ws = FakeWorkspace(fw, r)
        ins, outs = M[r], Mt[r]
        y = symm_mx_exchange(xs[r], ins, outs, r, ws, "torch", True)
        q, s = symm_mx_exchange(xs[r], ins, outs, r, ws, "torch", False)
        back = symm_mx_exchange(gs[r], outs, ins, r, ws, "torch", True)  # the backward's
        again = symm_mx_exchange(xs[r], ins, outs, r, ws, "torch", True)  # a half used before
        return y, q, s, back, again

    for r, (y, q, s, back, again) in enumerate(run_ranks(rank, world)):
        what = f"rank {r} of {world}, {kind}, {dtype}, slots of {cap} rows"
        want = expected(xs, M, r, True)
        assert_same_bits(y, want, "forward " + what)
        assert_same_bits(again, want, "repeat " + what)
        wq, wsc = expected(xs, M, r, False)
        assert torch.equal(q.view(torch.uint8), wq.view(torch.uint8)), "dispatch elements " + what
        assert torch.equal(s.view(torch.uint8), wsc.view(torch.uint8)), "dispatch scales " + what
        assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float8_e8m0fnu
        assert_same_bits(back, expected(gs, Mt, r, True), "backward " + what)
    big = {(a, b) for a in range(world) for b in range(world) if a != b and (M[a][b] > cap or M[b][a] > cap)}
    assert fw.p2p_pairs <= big and (nbytes > 3000 or not big or fw.p2p_pairs), (fw.p2p_pairs, big)
    if nbytes > 3000:
        assert not fw.p2p_pairs


@pytest.mark.parametrize("world", [2, 3, 8])
def test_layout_slots_are_disjoint_and_inside_the_half(world):
    half = 200_192  # a multiple of 256, like every real half (MiB multiples)
    for dim in (96, 5120):
        lay = Layout(world, dim, half)
        assert lay.slot_rows > 0
        buf = torch.zeros(2 * half, dtype=torch.uint8)
        b0 = buf.data_ptr()
        for base in (0, half):
            for dst in range(world):
                for src in (r for r in range(world) if r != dst):
                    q, s, f = lay.slot(buf, base, src, dst)
                    assert q.shape == (lay.slot_rows, dim) and s.shape == (lay.slot_rows, dim // 32)
                    assert f.shape == (tiles(lay.slot_rows, dim),) and f.dtype == torch.int32
                    assert 4 * f.numel() <= lay.flag_bytes
                    assert all((t.data_ptr() - b0) % 256 == 0 for t in (q, s, f))
                    assert base <= f.data_ptr() - b0 and s.data_ptr() + s.numel() - b0 <= base + half
                    if dst == 0:  # every slot of one receiver marked once: no overlap
                        q.add_(1)
                        s.add_(1)
                        f.view(torch.uint8).add_(1)
            if base == 0:
                assert int(buf.max()) == 1
                per_slot = lay.slot_rows * (dim + dim // 32) + 4 * tiles(lay.slot_rows, dim)
                assert int((buf == 1).sum()) == (world - 1) * per_slot
                buf.zero_()


def test_flags_do_not_move_with_the_row_width():
    """Flags sit at the same bytes for every dim (never on bytes an exchange of another width wrote as
    elements or scales, which could hold a later epoch's value by chance)."""
    buf = torch.zeros(1 << 20, dtype=torch.uint8)
    for world in (2, 3):
        lays = [Layout(world, d, 1 << 19) for d in (32, 96, 1056, 5120)]
        for base in (0, 1 << 19):
            for src, dst in ((0, 1), (1, 0), (world - 1, 0)):
                f0s = {lay.offsets(base, src, dst)[2] for lay in lays}
                assert len(f0s) == 1
                data = [lay.slot(buf, base, src, dst)[:2] for lay in lays]
                end = f0s.pop() + lays[0].flag_bytes
                assert all(t.data_ptr() - buf.data_ptr() >= end for ts in data for t in ts)


class SharedWorkspace:
    """A rank's view of workspaces in shared memory (one process per rank: the Triton interpreter
    runs one kernel per process), zeroed by the parent; no fallback pairs. ensure() waits until every
    rank's process has started (`ready`, shared int32 (W,)), so start-up time is not waiting time."""

    def __init__(self, buffers: list[torch.Tensor], ready: torch.Tensor, rank: int) -> None:
        self.buffers, self.nbytes, self._calls = buffers, buffers[0].numel(), 0
        self.counters = torch.zeros(4 * 32, dtype=torch.int32)
        self.deferred = torch.empty(0, dtype=torch.int32)
        self.error = torch.zeros(1, dtype=torch.int64)
        self.ready, self.rank = ready, rank

    def ensure(self) -> None:
        import time

        self.ready[self.rank] = 1
        deadline = time.monotonic() + 300
        while not bool(self.ready.all()):
            assert time.monotonic() < deadline, "a rank's process never started"
            time.sleep(0.01)

    def next_epoch(self) -> int:
        self._calls += 1
        return self._calls

    def send_recv(self, sends, recvs) -> None:
        raise AssertionError("the test's workspace fits every pair")


def _poll_politely() -> None:
    """In this process, an interpreted atomic read (add 0) of the address the previous atomic read
    read sleeps 0.2 ms first: a rank spinning on a peer's flag leaves the CPU to the peers (the ranks
    outnumber the test host's cores; spinning took half the test's CPU time). Memory effects and the
    order of reads are unchanged."""
    import time

    import numpy as np
    from triton.runtime import interpreter as ti

    rmw = ti.InterpreterBuilder.create_atomic_rmw
    last: list = [None]

    def create_atomic_rmw(self, op, ptr, val, mask, sem, scope):
        read = getattr(op, "name", "") == "ADD" and not np.any(val.data)
        key = ptr.data.tobytes() if read else None
        if key is not None and key == last[0]:
            time.sleep(2e-4)
        last[0] = key
        return rmw(self, op, ptr, val, mask, sem, scope)

    ti.InterpreterBuilder.create_atomic_rmw = create_atomic_rmw


def _kernel_worker(rank, world, port, per_item, store_sub, fast_bit, recv_sub, buffers, ready, xs, gs, M,
                   outs_y, outs_q, outs_s, outs_back) -> None:
    _poll_politely()
    symm.ITEM_TILES, symm._STORE_SUB_BLOCKS, symm._FAST_BIT_FLAGS = per_item, store_sub, fast_bit
    symm._RECV_SUB_BLOCKS = dict.fromkeys(symm._RECV_SUB_BLOCKS, recv_sub)
    ws = SharedWorkspace(buffers, ready, rank)
    ins, outs = M[rank], [row[rank] for row in M]
    outs_y[rank].copy_(symm_mx_exchange(xs[rank], ins, outs, rank, ws, "torch", True, impl="kernel"))
    q, s = symm_mx_exchange(xs[rank], ins, outs, rank, ws, "torch", False, impl="kernel")
    outs_q[rank].copy_(q.view(torch.uint8))
    outs_s[rank].copy_(s.view(torch.uint8))
    outs_back[rank].copy_(symm_mx_exchange(gs[rank], outs, ins, rank, ws, "torch", True, impl="kernel"))
    assert not ws.counters.any(), "the last program resets the counters"


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy overflow notes
@pytest.mark.parametrize(("world", "dtype", "dim", "per_item", "store_sub", "fast_bit", "recv_sub"), [
    (2, torch.bfloat16, 96, 2, 64, False, 64), (3, torch.float32, 64, 2, 64, False, 64),
    (2, torch.float32, 64, 1, 64, False, 64), (2, torch.bfloat16, 96, 4, 128, False, 64),
    (2, torch.bfloat16, 96, 8, 128, False, 128), (2, torch.bfloat16, 64, 16, 64, False, 64),
    (2, torch.bfloat16, 96, 1, 128, True, 128), (3, torch.float32, 64, 2, 64, True, 64),
])
def test_exchange_kernel_under_the_interpreter(world, dtype, dim, per_item, store_sub, fast_bit, recv_sub,
                                               spawn_ranks):
    """The Triton exchange kernel itself (tickets, release/acquire flags, epochs, tiles spanning rows,
    the last partial tile, items of several flag tiles with the last ones missing, empty pairs, scales
    stored as words of four blocks with pairs ending inside a word, store and receive register tiles
    of 64 and 128 blocks, fast-bit flags): one process per rank under TRITON_INTERPRET=1, workspaces
    in shared memory, three exchanges (both halves, then the first again)."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        pytest.skip("needs TRITON_INTERPRET=1 (CPU)")
    # rank 1 sends nothing to rank 0; others several tiles of 128 blocks (the last one partial)
    M = [[(150 + 37 * r + 11 * p) if (r, p) != (1, 0) else 0 for p in range(world)] for r in range(world)]
    Mt = [list(c) for c in zip(*M, strict=True)]
    xs = [make_rows(sum(M[r]), dim, dtype, seed=7 + r).share_memory_() for r in range(world)]
    gs = [make_rows(sum(Mt[r]), dim, dtype, seed=70 + r).share_memory_() for r in range(world)]
    buffers = [torch.zeros(1 << 18, dtype=torch.uint8).share_memory_() for _ in range(world)]
    assert Layout(world, dim, halves_bytes(1 << 18)).slot_rows >= max(map(max, M))

    def shared(rows, cols, dt):
        return [torch.zeros(rows[r], cols, dtype=dt).share_memory_() for r in range(world)]

    rows_out = [sum(Mt[r]) for r in range(world)]
    ys, qs, ss = shared(rows_out, dim, dtype), shared(rows_out, dim, torch.uint8), shared(
        rows_out, dim // 32, torch.uint8
    )
    backs = shared([sum(M[r]) for r in range(world)], dim, dtype)
    ready = torch.zeros(world, dtype=torch.int32).share_memory_()
    spawn_ranks(_kernel_worker, world, per_item, store_sub, fast_bit, recv_sub, buffers, ready, xs, gs, M, ys,
                qs, ss, backs, timeout_s=900)
    for r in range(world):
        what = f"rank {r} of {world}, {dtype}"
        assert_same_bits(ys[r], expected(xs, M, r, True), "forward " + what)
        wq, wsc = expected(xs, M, r, False)
        assert torch.equal(qs[r], wq.view(torch.uint8)), "dispatch elements " + what
        assert torch.equal(ss[r], wsc.view(torch.uint8)), "dispatch scales " + what
        assert_same_bits(backs[r], expected(gs, Mt, r, True), "backward " + what)
    # the third exchange's flags (first half): the epoch, with the fast bit where asked for and earned
    _check_fast_bits(buffers, Mt, dim, halves_bytes(1 << 18), 0, 3, fast_bit, per_item)


def _check_fast_bits(buffers, rows, dim, half, base, epoch, fast_bit, per_item, both=True) -> None:
    """After exchange `epoch` of rows[src][dst] rows into the half at `base`: every flag of a pair's
    tiles holds `epoch` in its low 31 bits, and bit 31 exactly where `fast_bit` is on and every scale
    byte of the flag's item is >= 10 (the first rows of every rank carry a zero block and a tiny one,
    the others scales far above 10: with `both`, both kinds occur)."""
    world = len(rows)
    lay = Layout(world, dim, half)
    span = per_item * symm.TILE_BLOCKS
    seen = set()
    for src in range(world):
        for dst in (r for r in range(world) if r != src):
            _, sc, f = lay.slot(buffers[dst], base, src, dst)
            nblk = rows[src][dst] * (dim // 32)
            scales = sc.reshape(-1)[:nblk]
            for t in range(tiles(rows[src][dst], dim)):
                v = int(f[t])
                item = scales[t // per_item * span : (t // per_item + 1) * span]
                want = fast_bit and (item.numel() == 0 or int(item.min()) >= 10)
                assert (v & 0x7FFFFFFF, v < 0) == (epoch, want), (src, dst, t, v)
                seen.add(want)
    assert seen == ({False, True} if fast_bit else {False}) or not both and seen <= {fast_bit}, seen


@pytest.mark.parametrize("per_item", symm.ITEM_TILES_ACCEPTED)
@pytest.mark.parametrize("world", [2, 3, 5])
def test_work_items_order_and_tiles(world, per_item, monkeypatch):
    """The ticket order: communication items (stores, receives) spread evenly among the own tiles,
    no receive among the first `delay` communication items, then receives spread evenly among the
    stores, each item once; item counts (`per_item` flag tiles each) and block ranges per pair (empty
    pairs: one empty tile; pairs over a slot: one empty tile, their rows go through the fallback)."""
    monkeypatch.setattr(symm, "ITEM_TILES", per_item)
    dim, sd = 96, 3
    g = torch.Generator().manual_seed(world)
    M = torch.randint(0, 400, (world, world), generator=g).tolist()
    M[0][1 % world] = 0
    nbytes = 1 << 17
    fw = FakeWorld(world, nbytes)
    lay = Layout(world, dim, halves_bytes(nbytes))
    cap = lay.slot_rows
    M[1][0] = cap + 1  # over a slot
    for me in range(world):
        ins, outs = M[me], [row[me] for row in M]
        items = symm.work_items(ins, outs, me, FakeWorkspace(fw, me), lay, 0)
        kinds = [items.kind(t) for t in range(items.front)]
        n_comm = items.n_store + items.n_recv
        assert items.delay == items.n_store // symm.RECV_DELAY
        comm = [k for k, _ in kinds if k != "own"]
        for t in range(items.front + 1):
            assert sum(k != "own" for k, _ in kinds[:t]) == t * n_comm // items.front
        assert "recv" not in comm[: items.delay]
        for c in range(items.delay, n_comm + 1):
            assert comm[:c].count("recv") == (c - items.delay) * items.n_recv // (n_comm - items.delay)
        for kind, n in (("store", items.n_store), ("own", items.n_own), ("recv", items.n_recv)):
            assert [i for k, i in kinds if k == kind] == list(range(n))
        assert items.per_item == per_item
        assert items.n_own == -(-ins[me] * sd // (symm.TILE_BLOCKS * per_item))
        for i in range(world - 1):
            p, s = (me + 1 + i) % world, (me - 1 - i) % world
            n_send = ins[p] if ins[p] <= cap else 0
            n_recv = outs[s] if outs[s] <= cap else 0
            st, rc = items.row("st_start"), items.row("rc_start")
            assert tiles(n_send, dim) == max(1, -(-n_send * sd // symm.TILE_BLOCKS))
            assert st[i + 1] - st[i] == -(-tiles(n_send, dim) // per_item)
            assert rc[i + 1] - rc[i] == -(-tiles(n_recv, dim) // per_item)
            assert items.row("st_nblk")[i] == n_send * sd and items.row("rc_nblk")[i] == n_recv * sd
            q, sc, f = lay.slot(fw.buffers[p], 0, me, p)
            assert items.row("st_q")[i] == q.data_ptr() and items.row("st_f")[i] == f.data_ptr()
            q, sc, f = lay.slot(fw.buffers[me], 0, s, me)
            assert items.row("rc_s")[i] == sc.data_ptr() and items.row("rc_f")[i] == f.data_ptr()


@pytest.mark.parametrize("fast_bit", [False, True])
@pytest.mark.parametrize("per_item", symm.ITEM_TILES_ACCEPTED)
@pytest.mark.parametrize("world", [2, 3])
def test_symm_exchange_many_tiles(world, per_item, fast_bit, monkeypatch):
    """Pairs of several tiles (tiles spanning rows, a partial last one; items of `per_item` tiles, the
    last one short), one pair over a slot (the fallback) and an empty one, six consecutive exchanges
    (each half three times); flags with and without the fast bit."""
    monkeypatch.setattr(symm, "ITEM_TILES", per_item)
    monkeypatch.setattr(symm, "_FAST_BIT_FLAGS", fast_bit)
    dim = 96
    M = [[(150 + 37 * r + 11 * p) for p in range(world)] for r in range(world)]
    M[1][0], M[0][world - 1] = 0, 900
    Mt = [list(c) for c in zip(*M, strict=True)]
    nbytes = 1 << 17
    assert 300 < Layout(world, dim, halves_bytes(nbytes)).slot_rows < 900
    xs = [make_rows(sum(M[r]), dim, torch.bfloat16, seed=9 + r) for r in range(world)]
    fw = FakeWorld(world, nbytes)

    def rank(r: int):
        ws = FakeWorkspace(fw, r)
        return [symm_mx_exchange(xs[r], M[r], Mt[r], r, ws, "torch", True) for _ in range(6)]

    for r, ys in enumerate(run_ranks(rank, world)):
        want = expected(xs, M, r, True)
        for i, y in enumerate(ys):
            assert_same_bits(y, want, f"rank {r} of {world}, exchange {i + 1}")
    assert fw.p2p_pairs == {(0, world - 1)}
    half = halves_bytes(nbytes)
    in_slots = [[0 if (a, b) == (0, world - 1) else n for b, n in enumerate(row)] for a, row in enumerate(M)]
    _check_fast_bits(fw.buffers, in_slots, dim, half, half, 6, fast_bit, per_item, both=False)


@pytest.mark.parametrize("per_item", [0, 3, 32])
def test_item_tiles_outside_the_accepted_values_is_an_error(per_item, monkeypatch):
    monkeypatch.setattr(symm, "ITEM_TILES", per_item)
    fw = FakeWorld(2, 1 << 16)
    lay = Layout(2, 64, halves_bytes(1 << 16))
    with pytest.raises(ValueError, match=f"ITEM_TILES={per_item}; expected None or one of"):
        symm.work_items([4, 4], [4, 4], 0, FakeWorkspace(fw, 0), lay, 0)


def test_item_tiles_by_size(monkeypatch):
    """ITEM_TILES None: items of 8 tiles once that gives 16 items a program, else of 4 (on 396
    programs, an H200's 132 SMs x 3, 5120-wide rows split evenly over 2 ranks: 4 at 1 and 4 x 8192
    rows a rank, 8 at 16 x 8192); a set ITEM_TILES wins; the table follows the choice."""
    monkeypatch.setattr(symm, "ITEM_TILES", None)
    per_rank = {b: 3 * symm.tiles(b * 8192 // 2, 5120) for b in (1, 4, 16)}  # stores, own, receives
    assert {b: symm.item_tiles(n, 396) for b, n in per_rank.items()} == {1: 4, 4: 4, 16: 8}
    assert symm.item_tiles(8 * 16 * 396, 396) == 8 and symm.item_tiles(8 * 16 * 396 - 1, 396) == 4
    fw = FakeWorld(2, 1 << 20)
    lay = Layout(2, 64, halves_bytes(1 << 20))  # 2 blocks a row: 128 rows a tile
    small = symm.work_items([128 * 4, 128 * 4], [128 * 4, 128 * 4], 0, FakeWorkspace(fw, 0), lay, 0)
    assert (small.per_item, small.n_store, small.n_own, small.n_recv) == (4, 1, 1, 1)
    # 16 items of 8 tiles on one program (the interpreter's) over stores, own rows and receives
    big = 128 * 8 * 16 // 3 + 128
    large = symm.work_items([big, big], [big, big], 0, FakeWorkspace(fw, 0), lay, 0)
    assert large.per_item == 8
    monkeypatch.setattr(symm, "ITEM_TILES", 2)
    assert symm.item_tiles(10**9, 1) == 2
    assert symm.work_items([big, big], [big, big], 0, FakeWorkspace(fw, 0), lay, 0).per_item == 2


def test_symm_exchange_times_out_instead_of_hanging(monkeypatch):
    """A peer that never exchanges: the waiting rank raises (naming the source) after the timeout."""
    monkeypatch.setattr(symm, "TIMEOUT_MS", 300)
    fw = FakeWorld(2, 1 << 16)
    x = make_rows(8, 64, torch.bfloat16, seed=1)

    def rank(r: int):
        ws = FakeWorkspace(fw, r)
        ws.ensure()
        if r == 0:
            with pytest.raises(RuntimeError, match="no data from source index 0 .* tile 0 after MXMOE_SYMM"):
                symm_mx_exchange(x, [4, 4], [4, 4], 0, ws, "torch", True)

    run_ranks(rank, 2)


def test_exchange_kernel_compiles_for_sm90(triton_sm90: JobResult):
    """The exchange kernel (and the standalone kernels sharing its tile helpers) builds for an
    H100/H200 (sm_90) on this machine (Triton ships ptxas and cuobjdump), with the argument types the
    launch gives it: the exchange kernel's system-scope release flag write (one system fence per store
    tile), acquire flag reads, vector stores, the store items' NVLink stores (elements as one 8- or
    16-byte vector a thread, scales as 4-byte words), the work items' loads issued ahead as
    asynchronous copies, timer and trap; registers and shared memory for the programs per SM it
    launches, spills only of values reloaded once a work item (none in the register-tile loops)."""
    assert_sm90_check(triton_sm90, "symm_exchange_kernel", "exchange_helper_kernels")

