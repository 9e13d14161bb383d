"""The symmetric-memory exchange's layout and protocol on CPU: W ranks as threads of one process, their
workspaces plain tensors that every thread can write (as NVLink peers can), the device barrier a
thread barrier. Each rank's result must equal quantize -> route rows -> dequantize, for uneven and
zero splits, both dtypes, the dispatch form, consecutive exchanges (alternating halves), and pairs too
large for a slot (the send/recv fallback)."""

from __future__ import annotations

import threading

import pytest
import torch
from test_comm_a2a import assert_same_bits, make_rows, split_matrix

from mxmoe.comm.splits import offsets
from mxmoe.comm.symm import Layout, halves_bytes, symm_mx_exchange
from mxmoe.quant import custom_ops


class FakeWorld:
    """W ranks' workspaces, filled with garbage so that a row never written cannot pass, and a mailbox
    for the point-to-point fallback."""

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

    def ensure(self) -> None:
        pass

    def next_epoch(self) -> int:
        self._calls += 1
        return self._calls

    def barrier(self) -> None:
        """As SymmWorkspace's device barrier: every rank's stores are done and visible."""
        self.world.sync.wait()

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
