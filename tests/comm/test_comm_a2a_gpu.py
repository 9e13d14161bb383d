"""The MXFP8 all-to-all on GPUs: the CUDA pipeline (side streams, Triton dequantize-into) against the
reference, on one GPU without a process group and on two GPUs over NCCL. Run with `pytest -m gpu`."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
from conftest import assert_same_bits, spawn_ranks
from test_comm_a2a import _check_all_paths, make_rows

from mxmoe.comm import a2a_dispatch_mxfp8, reference_mxfp8_a2a, to_mxfp8_a2a_dequant

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
