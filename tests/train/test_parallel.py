"""Process groups of the trainer's meshes honour parallelism.timeout_s (4 gloo ranks on CPU); a rank
that dies is named by the others."""

import contextlib
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
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    with pytest.raises(ValueError, match=r"LOCAL_RANK=1 needs CUDA device 1, but 1 are visible; .*"
                       r"--nproc_per_node.*--training.device=cpu"):
        parallel.init_distributed("auto", 60)
    assert not dist.is_initialized()


def _dying_peer(rank: int, world: int, port: int, out: str) -> None:
    """`mxmoe train` as rank `rank`; rank 1 vanishes in its third step (as the OOM killer would end
    it: no exception, no message)."""
    from test_trainer import TINY

    from mxmoe.train import trainer

    env = {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": world, "MASTER_PORT": port}
    os.environ.update(MASTER_ADDR="127.0.0.1", **{k: str(v) for k, v in env.items()})
    torch.set_num_threads(1)
    if rank == 1:
        step, calls = trainer._TrainStep.__call__, []

        def vanishes_in_step_3(self, x, y):
            calls.append(1)
            if len(calls) == 3:
                os._exit(0)
            return step(self, x, y)

        trainer._TrainStep.__call__ = vanishes_in_step_3
    with open(Path(out, f"err{rank}"), "w") as err, contextlib.redirect_stderr(err):
        rc = trainer.main(TINY + ["--training.steps=6", f"--job.dump_folder={out}/run"])
    Path(out, f"rc{rank}").write_text(str(rc))


def test_a_rank_that_dies_is_named_by_the_others(tmp_path):
    spawn_ranks(_dying_peer, 2, str(tmp_path))
    err = (tmp_path / "err0").read_text()
    # once gloo's raw RuntimeError ("Connection closed by peer ...") and a traceback
    assert (tmp_path / "rc0").read_text() == "1", err
    assert "mxmoe train: error: rank 0: a collective failed because rank 1 (pid " in err, err
    assert ") stopped (" in err and "OOM killer" in err and "Traceback" not in err, err
    assert not (tmp_path / "rc1").exists()


def test_a_collective_failure_says_which_rank_is_gone_or_that_it_timed_out():
    import socket
    import subprocess

    host = socket.gethostname()
    gone = subprocess.Popen(["true"])
    gone.wait()
    closed = RuntimeError(
        "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
        "[10.0.0.2]:38822. This is typically caused by a remote worker crashing."
    )
    assert parallel.is_collective_failure(closed) and not parallel.is_collective_failure(RuntimeError("oom"))
    peers = [(host, os.getpid()), (host, gone.pid)]
    msg = parallel.describe_collective_failure(closed, 0, peers, 60, wait_s=0)
    assert msg.startswith(f"rank 0: a collective failed because rank 1 (pid {gone.pid} on {host}) stopped "
                          "(Connection closed by peer [10.0.0.2]:38822)"), msg
    timeout = RuntimeError("[/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 60000ms")
    msg = parallel.describe_collective_failure(timeout, 0, [(host, os.getpid()), ("node2", 7)], 60, wait_s=0)
    assert "a collective timed out after parallelism.timeout_s=60 s" in msg and "other hosts (node2)" in msg


@pytest.mark.parametrize(
    "world, ep, experts, message",
    [
        (2, 2, 0, "expert_parallel_degree=2: the model is dense (model.num_experts=0), it has no experts"),
        (2, 2, 3, "expert_parallel_degree=2 must divide model num_experts=3"),
        (2, 4, 4, "expert_parallel_degree=4 must be >= 1 and divide the world size 2"),
        (4, 3, 6, "expert_parallel_degree=3 must be >= 1 and divide the world size 4"),
    ],
)
def test_expert_parallel_degrees_that_cannot_split_the_experts_are_named(world, ep, experts, message):
    """A dense model under ep > 1 was told ep 'must divide num_experts=0' (which it does)."""
    with pytest.raises(ValueError, match=message.replace("(", "\\(").replace(")", "\\)")):
        parallel.check_parallel_dims(parallel.make_parallel_dims(world, -1, ep, 1), experts)


def test_a_rank_left_alone_at_the_rendezvous_stops_naming_it(tmp_path, monkeypatch, capsys):
    """Rank 0 of 2 whose peer never starts: after parallelism.timeout_s it stops with one line naming
    the rendezvous and what to check (torch's DistStoreError traceback from inside
    init_process_group)."""
    from conftest import free_port
    from test_trainer import TINY

    from mxmoe.train import trainer

    port = free_port()
    env = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="2")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    argv = TINY + ["--parallelism.timeout_s=1", f"--job.dump_folder={tmp_path}/run"]
    start = time.monotonic()
    assert trainer.main(argv) == 1
    err = capsys.readouterr().err
    assert time.monotonic() - start < 60 and not dist.is_initialized()
    assert err.startswith("mxmoe train: error: rank 0: the 2 ranks did not all meet at start within "
                          "parallelism.timeout_s=1 s ("), err
    assert f"MASTER_PORT (here {port}) / WORLD_SIZE (here 2)" in err and "Traceback" not in err, err
