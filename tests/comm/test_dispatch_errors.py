"""The expert-parallel dispatcher's inputs on 2 gloo ranks (issue 59, case 10): before its first
exchange the ranks agree on D, dtype and num_experts and share the outcome of their own checks, so a
bad rank makes *every* rank raise an error naming the rank and the mismatch (never a torch error on
one rank and "Connection reset" on its peer, garbage split sizes or a huge allocation), and the group
is still in step afterwards. A process group timeout bounds every wait; spawn_ranks bounds the test."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
from conftest import spawn_ranks

from mxmoe.comm.a2a_dispatcher import AllToAllDispatcher
from mxmoe.recipe import recipe
from mxmoe.token_dispatch import UNQUANTIZED, ExpertRows

T, D, K, E = 8, 64, 2, 4
MX_ROWS = ExpertRows(recipe("mxfp8_rceil", dim0_kernel="torch", dim1_kernel="torch"))


def _inputs(rank: int, d: int = D, dtype=torch.float32):
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(T, d, generator=g).to(dtype)
    return x, torch.randint(0, E, (T, K), generator=g), torch.rand(T, K, generator=g)


def _expect(
    rank: int, exc: type, pieces: dict[int, list[str]], x, idx, scores, num_experts=E, rows_as=UNQUANTIZED
):
    """A fresh dispatcher's first dispatch raises `exc` on every rank, with pieces[rank] in the message;
    then a collective completes (the ranks are in step)."""
    d = AllToAllDispatcher(dist.group.WORLD, transport="nccl")
    with pytest.raises(exc) as info:
        d.dispatch(x, idx, scores, num_experts=num_experts, rows_as=rows_as)
    for p in pieces[rank]:
        assert p in str(info.value), f"rank {rank}: {p!r} not in {info.value}"
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 2


def _worker(rank: int, world: int, port: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        x, idx, scores = _inputs(rank)
        # a bad id on rank 1 only: rank 1 names its own error, rank 0 names rank 1 and the error
        bad = idx.clone().fill_(E) if rank == 1 else idx
        msg = "idx holds expert id 4; expected ids in [0, num_experts=4)"
        pieces = {1: ["rank 1: ", msg], 0: ["rank 1 rejected its inputs", msg]}
        _expect(rank, ValueError, pieces, x, bad, scores)
        neg = torch.where(idx == idx[0, 0], -1, idx) if rank == 0 else idx
        _expect(rank, ValueError, {0: ["rank 0: ", "expert id -1"], 1: ["rank 0 rejected", "expert id -1"]},
                x, neg, scores)
        # wrong dtypes / shapes on one rank
        both = {0: ["rank 1"], 1: ["rank 1"]}
        _expect(rank, TypeError, {r: [*v, "idx has dtype torch.int32"] for r, v in both.items()},
                x, idx.int() if rank == 1 else idx, scores)
        _expect(rank, ValueError, {r: [*v, "scores has shape (8, 1)"] for r, v in both.items()},
                x, idx, scores[:, :1] if rank == 1 else scores)
        _expect(rank, ValueError, {r: [*v, "idx has shape (8,)"] for r, v in both.items()},
                x, idx[:, 0] if rank == 1 else idx, scores)
        _expect(rank, ValueError, {r: [*v, "x has shape (8, 2, 32)"] for r, v in both.items()},
                x.view(T, 2, D // 2) if rank == 1 else x, idx, scores)
        _expect(rank, TypeError, {r: [*v, "num_experts=4.0 (float)"] for r, v in both.items()},
                x, idx, scores, num_experts=4.0 if rank == 1 else E)
        _expect(rank, ValueError, {r: [*v, "num_experts=0"] for r, v in both.items()},
                x, idx, scores, num_experts=0 if rank == 1 else E)
        x40 = _inputs(rank, 40)[0]  # MXFP8 rows need D % 32 == 0: on every rank here
        _expect(rank, ValueError, {r: [f"rank {r}", "D=40", "block size 32"] for r in (0, 1)},
                x40, idx, scores, rows_as=MX_ROWS)
        # the ranks disagree (each rank's inputs fine on its own): every rank names the mismatch
        x32 = _inputs(rank, 32)[0] if rank == 1 else x
        d_msg = "the ranks disagree on D (x.shape[1]): rank 1 has 32, rank 0 has 64"
        _expect(rank, ValueError, {0: [d_msg], 1: [d_msg]}, x32, idx, scores)
        xb = x.bfloat16() if rank == 1 else x
        t_msg = "disagree on x's dtype: rank 1 has torch.bfloat16, rank 0 has torch.float32"
        _expect(rank, ValueError, {0: [t_msg], 1: [t_msg]}, xb, idx, scores)
        e_msg = "disagree on num_experts: rank 1 has 8, rank 0 has 4"
        _expect(rank, ValueError, {0: [e_msg], 1: [e_msg]}, x, idx, scores, num_experts=8 if rank == 1 else E)
        m_msg = "disagree on the MX rows' block size (0: rows unquantized): rank 1 has 32, rank 0 has 0"
        _expect(rank, ValueError, {0: [m_msg], 1: [m_msg]}, x, idx, scores,
                rows_as=MX_ROWS if rank == 1 else UNQUANTIZED)
        # MX rows of another format on one rank: e5m2 bytes were read as e4m3 without a word
        e5m2 = ExpertRows(recipe("mxfp8_rceil", elem_dtype=torch.float8_e5m2, dim0_kernel="torch"))
        f_msg = ("disagree on the MX rows' element dtype: rank 1 has torch.float8_e5m2, rank 0 has "
                 "torch.float8_e4m3fn")
        _expect(rank, ValueError, {0: [f_msg], 1: [f_msg]}, x, idx, scores,
                rows_as=e5m2 if rank == 1 else MX_ROWS)
        floor = ExpertRows(recipe("mxfp8", dim0_kernel="torch"))
        s_msg = "disagree on the MX rows' scaling mode: rank 1 has floor, rank 0 has rceil"
        _expect(rank, ValueError, {0: [s_msg], 1: [s_msg]}, x, idx, scores,
                rows_as=floor if rank == 1 else MX_ROWS)
        # agreed inputs still dispatch and combine (the agreement runs once per signature)
        d = AllToAllDispatcher(dist.group.WORLD, transport="nccl")
        for _ in range(2):
            rows, counts, h = d.dispatch(x, idx, scores, num_experts=E)
            assert counts.shape == (E // 2,) and rows.shape == (int(counts.sum()), D)
            assert d.combine(rows, h).shape == (T, D)
        # after the agreement a bad id (CPU: checked for free) still raises on every rank, naming the
        # rank, before any row moves; the group stays in step
        pieces = {0: ["rank 0: AllToAllDispatcher.dispatch: idx holds expert id 4"],
                  1: ["rank(s) [0] could not dispatch", "nothing was exchanged"]}
        with pytest.raises(ValueError) as info:
            d.dispatch(x, idx.clone().fill_(E) if rank == 0 else idx, scores, num_experts=E)
        for p in pieces[rank]:
            assert p in str(info.value), f"rank {rank}: {p!r} not in {info.value}"
        rows, counts, h = d.dispatch(x, idx, scores, num_experts=E)
        assert d.combine(rows, h).shape == (T, D)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_expert_parallel_dispatch_errors_on_every_rank():
    spawn_ranks(_worker, 2)
