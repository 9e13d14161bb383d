"""Process groups of the trainer's meshes honour parallelism.timeout_s (4 gloo ranks on CPU)."""

import datetime
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import spawn_ranks

from mxmoe.train import parallel


def _worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    pd = parallel.make_parallel_dims(4, -1, 2, 1)
    _, ep_mesh = parallel.build_meshes(pd, torch.device("cpu"), timeout_s=2)
    # every rank's sub-groups are connected before any rank goes on (or exits): on a loaded host a
    # rank that left early closed its sockets while a slower one was still connecting
    dist.barrier()
    gave_up = Path(out, "rank1_gave_up")
    if rank == 0:  # rank 1, in the same ep group, never joins this all_reduce
        try:
            dist.all_reduce(torch.ones(1), group=ep_mesh.get_group("ep"))
            result = "completed"
        except RuntimeError:
            result = "peer gone" if gave_up.exists() else "timed out"
        Path(out, "result").write_text(result)
    elif rank == 1:  # waits for rank 0's verdict; gives up (closing its sockets) after 60 s
        deadline = time.monotonic() + 60
        while not Path(out, "result").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        gave_up.touch()
    os._exit(0)  # skip destroy_process_group: rank 0's ep group is broken


def test_ep_groups_use_the_configured_timeout(tmp_path):
    spawn_ranks(_worker, 4, str(tmp_path))
    # without the timeout on the sub-groups, rank 0 waits until rank 1 gives up (gloo: 30 min default)
    assert (tmp_path / "result").read_text() == "timed out"


def test_more_local_ranks_than_gpus_is_a_clear_error(monkeypatch):
    """device auto on a host with 1 GPU and a second local rank: an error naming LOCAL_RANK, the
    visible device count and the ways out, before any process group (not an invalid-ordinal crash)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(RuntimeError, match=r"LOCAL_RANK=1 needs CUDA device 1, but 1 are visible; .*"
                       r"--nproc_per_node.*--training.device=cpu"):
        parallel.init_distributed("auto", 60)
    assert not dist.is_initialized()
