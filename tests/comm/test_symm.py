"""The symmetric-memory exchange's layout logic on CPU: W ranks as threads of one process, their
workspaces plain tensors that every thread can write (as NVLink peers can), the device barrier a
thread barrier. Each rank's result must equal quantize -> route rows -> dequantize, for uneven and zero
splits, both dtypes, the dispatch form, and consecutive exchanges (alternating halves, growing)."""

from __future__ import annotations

import threading

import pytest
import torch
from test_comm_a2a import assert_same_bits, make_rows, split_matrix

from mxmoe.comm.splits import offsets
from mxmoe.comm.symm import Layout, symm_mx_exchange
from mxmoe.quant import custom_ops


class FakeWorld:
    """W ranks' workspaces, filled with garbage so that a row never written cannot pass."""

    def __init__(self, world: int, nbytes: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.buffers = [
            torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g) for _ in range(world)
        ]
        self.sync = threading.Barrier(world, timeout=60)
        self.ensured: list[int] = []


class FakeWorkspace:
    def __init__(self, world: FakeWorld) -> None:
        self.world, self.buffers, self._calls = world, world.buffers, 0

    def ensure(self, half_bytes: int) -> None:
        self.world.ensured.append(half_bytes)
        assert 2 * half_bytes <= self.buffers[0].numel(), "test workspace too small"

    def next_base(self) -> int:
        base = (self._calls % 2) * (self.buffers[0].numel() // 2)
        self._calls += 1
        return base

    def barrier(self) -> None:
        self.world.sync.wait()


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
def test_symm_exchange_matches_routing(world, kind, dtype):
    dim = 64
    M = split_matrix(world, kind)
    Mt = [list(c) for c in zip(*M, strict=True)]
    xs = [make_rows(sum(M[r]), dim, dtype, seed=3 + r) for r in range(world)]
    gs = [make_rows(sum(Mt[r]), dim, dtype, seed=50 + r) for r in range(world)]
    fw = FakeWorld(world, 1 << 16)

    def rank(r: int):
        ws = FakeWorkspace(fw)
        y = symm_mx_exchange(xs[r], M, r, ws, "torch", True)
        q, s = symm_mx_exchange(xs[r], M, r, ws, "torch", False)
        back = symm_mx_exchange(gs[r], Mt, r, ws, "torch", True)  # the backward's exchange
        again = symm_mx_exchange(xs[r], M, r, ws, "torch", True)  # a half used before
        return y, q, s, back, again

    for r, (y, q, s, back, again) in enumerate(run_ranks(rank, world)):
        what = f"rank {r} of {world}, {kind}, {dtype}"
        want = expected(xs, M, r, True)
        assert_same_bits(y, want, "forward " + what)
        assert_same_bits(again, want, "repeat " + what)
        wq, wsc = expected(xs, M, r, False)
        assert torch.equal(q.view(torch.uint8), wq.view(torch.uint8)), "dispatch elements " + what
        assert torch.equal(s.view(torch.uint8), wsc.view(torch.uint8)), "dispatch scales " + what
        assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float8_e8m0fnu
        assert_same_bits(back, expected(gs, Mt, r, True), "backward " + what)
    # every rank asked for the same workspace size (the growth decision must agree)
    per_call = [fw.ensured[i::4] for i in range(4)]
    assert all(len(set(v)) == 1 for v in per_call), fw.ensured


def test_layout_regions_do_not_overlap():
    lay = Layout(cap=1000, dim=96)
    buf = torch.zeros(2 * lay.nbytes + 512, dtype=torch.uint8)
    q, s = lay.regions(buf, 512)
    q.fill_(1)
    s.fill_(2)
    assert int((buf == 1).sum()) == 1000 * 96 and int((buf == 2).sum()) == 1000 * 3
    b0 = buf.data_ptr()
    assert (q.data_ptr() - b0) % 256 == 0 and (s.data_ptr() - b0) % 256 == 0
    assert s.data_ptr() + s.numel() <= buf.data_ptr() + 512 + lay.nbytes
