"""The symmetric-memory exchange's layout and protocol on CPU: W ranks as threads of one process, their
workspaces plain tensors that every thread can write (as NVLink peers can), the device barrier a
thread barrier, a piece's flag a word of the receiver's workspace that its waits block on. Each rank's
result must equal quantize -> route rows -> dequantize, for uneven and zero splits, both dtypes, the
dispatch form, consecutive exchanges (alternating halves), both modes ("copy": pieces and flags,
"store": stores and a barrier), one and many pieces per pair."""

from __future__ import annotations

import threading

import pytest
import torch
from test_comm_a2a import assert_same_bits, make_rows, split_matrix

from mxmoe.comm import symm
from mxmoe.comm.splits import offsets
from mxmoe.comm.symm import FLAG_BYTES, MAX_PIECES, Layout, halves_bytes, pieces, symm_mx_exchange
from mxmoe.quant import custom_ops


class FakeWorld:
    """W ranks' workspaces, filled with garbage so that a row never written cannot pass, and a mailbox
    for the point-to-point fallback."""

    def __init__(self, world: int, nbytes: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.buffers = [
            torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g) for _ in range(world)
        ]
        for b in self.buffers:  # as SymmWorkspace.ensure: the flags start at 0
            b[nbytes - FLAG_BYTES :].zero_()
        self.flags = [b[nbytes - FLAG_BYTES :].view(torch.int32) for b in self.buffers]
        self.raised = threading.Condition()
        self.sync = threading.Barrier(world, timeout=60)
        self.mail: dict[tuple[int, int], list] = {}  # (src, dst) -> [tensors...] per exchange, in order
        self.posted = threading.Condition()
        self.p2p_pairs: set[tuple[int, int]] = set()


class FakeWorkspace:
    def __init__(self, world: FakeWorld, rank: int) -> None:
        self.world, self.rank, self.buffers, self._calls = world, rank, world.buffers, 0
        self.nbytes = self.buffers[0].numel()

    def ensure(self) -> None:
        pass

    def next_epoch(self) -> int:
        self._calls += 1
        return self._calls

    def barrier(self, epoch: int | None = None) -> None:
        """As SymmWorkspace: the flag barrier (signal / wait below) for an exchange, else a thread
        barrier."""
        if epoch is not None and symm.BARRIER == "flags":
            symm.flag_barrier(self, self.rank, len(self.buffers), epoch)
        else:
            self.world.sync.wait()

    def put(self, dst, src) -> None:
        dst.copy_(src)

    def signal(self, peer: int, index: int, value: int) -> None:
        w = self.world
        with w.raised:
            w.flags[peer][index] = value
            w.raised.notify_all()

    def wait(self, index: int, value: int, count: int = 1) -> None:
        w = self.world
        words = w.flags[self.rank][index : index + count]
        assert words.numel() == count
        with w.raised:
            assert w.raised.wait_for(lambda: bool((words >= value).all()), timeout=60), "no flag"

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
        q, s = custom_ops.quantize_dim0(xs[src][a : a + M[src][r]], 32, "rceil", torch.float8_e4m3fn, "torch")
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
@pytest.mark.parametrize("nbytes", [(1 << 16) + FLAG_BYTES, 3000 + FLAG_BYTES], ids=["fits", "p2p"])
@pytest.mark.parametrize("mode,piece_rows,barrier", [("copy", 8192, "flags"), ("copy", 3, "flags"),
                                                    ("store", 8192, "flags"), ("store", 8192, "torch")],
                         ids=["copy", "copy-pieces", "store", "store-torch-barrier"])
def test_symm_exchange_matches_routing(world, kind, dtype, nbytes, mode, piece_rows, barrier, monkeypatch):
    """nbytes 3000 (+ flags): slots of a few rows, so the larger pairs take the send/recv fallback.
    piece_rows 3: many pieces per pair (each with its flag). barrier: the store mode's flag barrier,
    or a plain (thread) barrier standing for the symmetric-memory handle's."""
    monkeypatch.setattr(symm, "PIECE_ROWS", piece_rows)
    monkeypatch.setattr(symm, "BARRIER", barrier)
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
        y = symm_mx_exchange(xs[r], ins, outs, r, ws, "torch", True, mode=mode)
        q, s = symm_mx_exchange(xs[r], ins, outs, r, ws, "torch", False, mode=mode)
        back = symm_mx_exchange(gs[r], outs, ins, r, ws, "torch", True, mode=mode)  # the backward's
        again = symm_mx_exchange(xs[r], ins, outs, r, ws, "torch", True, mode=mode)  # a half used before
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
    if nbytes > 3000 + FLAG_BYTES:
        assert not fw.p2p_pairs
    for dst in range(world):
        for src in (s for s in range(world) if s != dst):
            if mode == "copy":  # every pair that used a slot raised each of its pieces' flags, 4 exchanges
                if max(M[src][dst], M[dst][src]) <= cap:
                    assert int(fw.flags[dst][symm.flag_index(src, dst, world, 0)]) == 4, (src, dst)
            else:  # every rank raised its barrier word in every peer at each of the 4 exchanges
                want = 4 if barrier == "flags" else 0
                assert int(fw.flags[dst][symm.barrier_index(src, dst, world)]) == want, (src, dst)


@pytest.mark.parametrize("n", [0, 1, 2, 7, 100, 8191, 8192, 8193, 65536, 10**6])
@pytest.mark.parametrize("piece_rows", [1, 3, 8192])
def test_pieces_cover_the_rows_in_order(n, piece_rows, monkeypatch):
    monkeypatch.setattr(symm, "PIECE_ROWS", piece_rows)
    ps = pieces(n)
    assert 1 <= len(ps) <= MAX_PIECES
    assert ps[0][0] == 0 and ps[-1][1] == n
    assert all(b0 == a1 for (_, b0), (a1, _) in zip(ps, ps[1:], strict=False))
    sizes = [b - a for a, b in ps]
    assert max(sizes) - min(sizes) <= 1 and (n == 0 or min(sizes) >= 1)
    assert len(ps) == min(MAX_PIECES, max(1, -(-n // piece_rows)))


def test_flag_words_fit_and_differ():
    for world in (2, 3, 8):
        seen = {symm.flag_index(s, d, world, i) for d in range(world) for s in range(world) if s != d
                for i in range(MAX_PIECES)}
        per_dst = (world - 1) * MAX_PIECES
        assert max(seen) < per_dst <= symm.BARRIER_BASE
        bar = sorted(symm.barrier_index(s, 0, world) for s in range(1, world))  # consecutive: one wait
        assert bar == list(range(symm.BARRIER_BASE, symm.BARRIER_BASE + world - 1))
        assert bar[-1] < FLAG_BYTES // 4
        words = {symm.flag_index(s, 0, world, i) for s in range(1, world) for i in range(MAX_PIECES)}
        assert len(words) == per_dst


def test_bad_mode_is_refused():
    with pytest.raises(ValueError, match="MXMOE_SYMM_MODE='fast'"):
        symm_mx_exchange(torch.zeros(4, 32), [4], [4], 0, None, "torch", True, mode="fast")


@pytest.mark.parametrize("world", [2, 3, 8])
def test_layout_slots_are_disjoint_and_inside_the_half(world):
    dim, half = 96, 200_192  # a multiple of 256, like every real half (MiB multiples)
    lay = Layout(world, dim, half)
    assert lay.slot_rows > 0
    buf = torch.zeros(2 * half, dtype=torch.uint8)
    b0 = buf.data_ptr()
    for base in (0, half):
        for dst in range(world):
            for src in (r for r in range(world) if r != dst):
                q, s = lay.slot(buf, base, src, dst)
                assert q.shape == (lay.slot_rows, dim) and s.shape == (lay.slot_rows, dim // 32)
                assert (q.data_ptr() - b0) % 256 == 0 and (s.data_ptr() - b0) % 256 == 0
                assert base <= q.data_ptr() - b0 and s.data_ptr() + s.numel() - b0 <= base + half
                if dst == 0:  # every slot of one receiver marked once: no overlap
                    q.add_(1)
                    s.add_(1)
        if base == 0:
            assert int(buf.max()) == 1
            assert int((buf == 1).sum()) == (world - 1) * lay.slot_rows * (dim + dim // 32)
            buf.zero_()


def test_backward_uses_the_forward_symm_mode(monkeypatch):
    """The backward's exchange runs in the symm mode the forward ran in, even if MODE changed between
    (the benchmark times backward passes outside the forward's `using_mode`)."""
    from mxmoe.comm import a2a
    from mxmoe.comm.splits import Plan

    seen = []

    def fake_exchange(x, plan, group, kernel, dequant, chunks, transport="nccl", symm_mode=None):
        seen.append(symm_mode)
        return x.clone()

    monkeypatch.setattr(a2a, "_mx_exchange", fake_exchange)
    plan = Plan(rank=0, world=1, input_splits=(4,), output_splits=(4,), row_shape=(32,))
    for fn in (a2a._MXA2A, a2a._Combine):
        seen.clear()
        x = torch.zeros(4, 32, requires_grad=True)
        with symm.using_mode("copy"):
            y = fn.apply(x, plan, None, "torch", None, "symm")
        with symm.using_mode("store"):
            y.sum().backward()
        assert seen[-1] == "copy", (fn.__name__, seen)
    with pytest.raises(ValueError, match="symm mode 'fast'"):
        with symm.using_mode("fast"):
            pass
