"""The MXFP8 all-to-all on GPUs: the CUDA pipeline (side streams, Triton dequantize-into) against the
reference, on one GPU without a process group and on two GPUs over NCCL. Run with `pytest -m gpu`."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
from conftest import assert_same_bits, spawn_ranks
from test_comm_a2a import _check_all_paths, make_rows

from mxmoe.comm import a2a_combine, a2a_dispatch_mxfp8, reference_mxfp8_a2a, to_mxfp8_a2a_dequant

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("chunks", [None, 1, 3, 8])
def test_single_gpu_pipeline_matches_reference(dtype, chunks):
    x0 = make_rows(4099, 256, dtype, 1).cuda()
    g = make_rows(4099, 256, dtype, 2).cuda()
    xr = x0.clone().requires_grad_()
    yr = reference_mxfp8_a2a(xr, [4099], [4099])
    yr.backward(g)
    x = x0.clone().requires_grad_()
    y = to_mxfp8_a2a_dequant(x, [4099], [4099], chunks=chunks)
    assert_same_bits(y, yr.detach(), "forward")
    y.backward(g)
    assert_same_bits(x.grad, xr.grad, "backward")
    assert_same_bits(a2a_dispatch_mxfp8(x0, [4099], [4099], chunks=chunks).dequantize(), yr.detach())


@pytest.mark.parametrize("chunks", [None, 3])
def test_single_gpu_exchange_follows_the_recipe(chunks):
    """A non-default recipe on CUDA (generic casts in the pipeline's own-rows and landing steps)."""
    from test_comm_a2a import OTHER_RECIPES

    x0 = make_rows(4099, 256, torch.bfloat16, 5).cuda()
    g = make_rows(4099, 256, torch.bfloat16, 6).cuda()
    for r in OTHER_RECIPES:
        xr = x0.clone().requires_grad_()
        yr = reference_mxfp8_a2a(xr, [4099], [4099], recipe=r)
        yr.backward(g)
        x = x0.clone().requires_grad_()
        y = to_mxfp8_a2a_dequant(x, [4099], [4099], chunks=chunks, recipe=r)
        assert_same_bits(y, yr.detach(), f"forward {r}")
        y.backward(g)
        assert_same_bits(x.grad, xr.grad, f"backward {r}")
        mx = a2a_dispatch_mxfp8(x0, [4099], [4099], chunks=chunks, recipe=r)
        assert_same_bits(mx.dequantize(), yr.detach(), f"dispatch {r}")


def _nccl_worker(rank: int, world: int, port: int, workspace_bytes: int | None = None) -> None:
    from mxmoe.comm import symm

    torch.cuda.set_device(rank)
    if workspace_bytes is not None:  # slots of a few rows: larger pairs take the NCCL send/recv fallback
        symm.WORKSPACE_BYTES = workspace_bytes
    dist.init_process_group(
        "nccl",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
        device_id=torch.device("cuda", rank),
    )
    try:
        for kind, dtype, dim in (
            ("equal", torch.bfloat16, 128),
            ("uneven", torch.float32, 64),
            ("zeros", torch.bfloat16, 96),
        ):
            _check_all_paths(rank, world, dim, dtype, kind, seed=11, device="cuda")
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("workspace_bytes", [None, 8192], ids=["symm", "symm-tiny-workspace"])
def test_two_gpus_nccl_matches_reference(workspace_bytes):
    """Every path (symmetric memory, NCCL) against the reference on 2 GPUs; a tiny workspace (slots of a
    few rows) sends the larger pairs through NCCL send/recv."""
    spawn_ranks(_nccl_worker, 2, workspace_bytes)


def _symm_large_worker(rank: int, world: int, port: int) -> None:
    """Many tiles and programs: uneven splits of thousands of rows (tiles spanning rows, a partial
    last tile, an empty pair), both dtypes, forward / backward / dispatch / combine, five rounds (both
    workspace halves, epochs 1..n) against the reference."""
    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=60), device_id=torch.device("cuda", rank),
    )
    try:
        S = [[3001, 4097], [0, 2500]]  # rank 1 sends nothing to rank 0
        ins, outs = S[rank], [S[p][rank] for p in range(world)]
        for dtype, dim in ((torch.bfloat16, 5120), (torch.float32, 1056)):
            x0 = make_rows(sum(ins), dim, dtype, 21 + rank).cuda()
            g = make_rows(sum(outs), dim, dtype, 41 + rank).cuda()
            xr = x0.clone().requires_grad_()
            yr = reference_mxfp8_a2a(xr, outs, ins)
            yr.backward(g)
            for it in range(5):
                what = f"rank {rank} {dtype} dim {dim} round {it}"
                x = x0.clone().requires_grad_()
                y = to_mxfp8_a2a_dequant(x, outs, ins, transport="symm", check=False)
                assert_same_bits(y, yr.detach(), "forward " + what)
                y.backward(g)
                assert_same_bits(x.grad, xr.grad, "backward " + what)
                mx = a2a_dispatch_mxfp8(x0, outs, ins, transport="symm", check=False)
                assert_same_bits(mx.dequantize(), yr.detach(), "dispatch " + what)
                xc = x0.clone().requires_grad_()
                a2a_combine(xc, outs, ins, transport="symm", check=False).backward(g)
                assert_same_bits(xc.grad, xr.grad, "combine backward " + what)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_gpus_symm_kernel_many_tiles():
    spawn_ranks(_symm_large_worker, 2)


class _OneGpuWorkspace:
    """A rank's workspace where every rank's buffer is plain memory of this one GPU (the peers are
    simulated; nothing crosses a link): for the exchange kernel's tests without a process group."""

    def __init__(self, buffers: list[torch.Tensor]) -> None:
        self.buffers, self.nbytes, self._calls = buffers, buffers[0].numel(), 0
        self.counters = torch.zeros(4 * 32, dtype=torch.int32, device="cuda")
        self.deferred = torch.empty(0, dtype=torch.int32, device="cuda")
        self.error = torch.zeros(1, dtype=torch.int64, device="cuda")

    def ensure(self) -> None:
        pass

    def next_epoch(self) -> int:
        self._calls += 1
        return self._calls

    def send_recv(self, sends, recvs) -> None:
        raise AssertionError("the test's workspace fits every pair")


@pytest.mark.parametrize(("per_item", "store_sub", "fast_bit", "recv_sub"),
                         [(1, 64, False, 64), (2, 64, False, 64), (4, 64, False, 64), (2, 128, False, 64),
                          (4, 128, False, 64), (8, 128, False, 64), (16, 128, False, 64), (1, 64, True, 64),
                          (4, 128, True, 64), (16, 128, True, 64), (4, 128, False, 128), (8, 128, True, 128)])
def test_one_gpu_two_simulated_ranks_kernel(per_item, store_sub, fast_bit, recv_sub, monkeypatch):
    """The exchange kernel of two ranks running at once on one GPU (two streams, workspaces in this
    GPU's memory, few programs each so both are resident): both outputs bit for bit the routing
    reference, over 4 exchanges (both halves twice), forward and dispatch, with work items of 1 to 16
    flag tiles, store register tiles of 64 and 128 blocks (33 blocks a row: pairs that end inside a
    scale word), receive register tiles of 64 and 128 blocks, and with the fast-bit flags off and on
    (symm._FAST_BIT_FLAGS)."""
    from test_symm import expected

    from mxmoe.comm import symm

    monkeypatch.setattr(symm, "ITEM_TILES", per_item)
    monkeypatch.setattr(symm, "_STORE_SUB_BLOCKS", store_sub)
    monkeypatch.setattr(symm, "_FAST_BIT_FLAGS", fast_bit)
    monkeypatch.setattr(symm, "_RECV_SUB_BLOCKS", {torch.bfloat16: recv_sub, torch.float32: 64})
    monkeypatch.setattr(symm, "_sm_count", lambda index: 8)  # 16 programs per rank: both resident
    monkeypatch.setattr(symm, "TIMEOUT_MS", 20_000)
    M = [[3001, 4097], [0, 2500]]
    Mt = [list(c) for c in zip(*M, strict=True)]
    dim = 1056
    xs = [make_rows(sum(M[r]), dim, torch.bfloat16, 31 + r) for r in range(2)]
    # awkward blocks in rows that rank 0 stores into rank 1 (make_rows puts its own at rows 0..3, which
    # stay on rank 0): NaN and Inf blocks (0x7F elements), zeros, tiny scales (items without the fast bit)
    xs[0][3001 + 7, 64] = float("nan")
    xs[0][3001 + 700, 100] = float("-inf")
    xs[0][3001 + 1400, :96] = 0.0
    xs[0][3001 + 2100, 32:64] *= 2.0**-140
    bufs = [torch.zeros(64 << 20, dtype=torch.uint8, device="cuda") for _ in range(2)]
    wss = [_OneGpuWorkspace(bufs) for _ in range(2)]
    xg = [x.cuda() for x in xs]
    streams = [torch.cuda.Stream() for _ in range(2)]
    torch.cuda.synchronize()
    for it in range(4):
        out = []
        dequant = it % 2 == 0
        for r in range(2):
            with torch.cuda.stream(streams[r]):
                y = symm.symm_mx_exchange(xg[r], M[r], Mt[r], r, wss[r], "auto", dequant, impl="kernel")
                out.append(y)
        torch.cuda.synchronize()
        for r in range(2):
            if it % 2 == 0:
                assert_same_bits(out[r].cpu(), expected(xs, M, r, True), f"rank {r} exchange {it + 1}")
            else:
                wq, wsc = expected(xs, M, r, False)
                assert torch.equal(out[r][0].cpu().view(torch.uint8), wq.view(torch.uint8))
                assert torch.equal(out[r][1].cpu().view(torch.uint8), wsc.view(torch.uint8))
        assert not any(w.counters.any() for w in wss)


def _symm_timeout_worker(rank: int, world: int, port: int) -> None:
    """Rank 0 of a simulated pair on one GPU exchanges; rank 1 never does: the kernel must fail
    after the timeout (a CUDA error from its trap), not hang. No process group: nothing but the
    kernel's own trap can end the wait."""
    import os
    import time

    from mxmoe.comm import symm

    symm.TIMEOUT_MS = 2000
    bufs = [torch.zeros(16 << 20, dtype=torch.uint8, device="cuda") for _ in range(2)]
    ws = _OneGpuWorkspace(bufs)
    x = torch.randn(4096, 256, device="cuda", dtype=torch.bfloat16)
    t0 = time.monotonic()
    try:
        symm.symm_mx_exchange(x, [2048, 2048], [2048, 2048], 0, ws, "auto", True, impl="kernel")
        torch.cuda.synchronize()
    except RuntimeError as e:
        took = time.monotonic() - t0
        print(f"failed after {took:.1f} s as it should: {e}", flush=True)
        os._exit(0 if 1.5 < took < 30 else 3)
    os._exit(4)  # the exchange completed without its peer


def test_symm_kernel_times_out_instead_of_hanging():
    spawn_ranks(_symm_timeout_worker, 1, timeout_s=90)
