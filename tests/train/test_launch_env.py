"""The launcher's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) is checked at
the door: one malformed or inconsistent is an error naming the variable, its value and what is
expected, before any process group (a RANK outside WORLD_SIZE waited at the rendezvous and stopped
with torch's C++ stack; WORLD_SIZE=1 with RANK=1 trained with its log silenced; a non-integer was a
traceback or "invalid literal for int()" naming nothing)."""

import time

import pytest
import torch.distributed as dist
from test_trainer import TINY

from mxmoe.train import parallel, trainer

LAUNCH = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
RDV = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")


@pytest.mark.parametrize(
    "env, message",
    [
        (dict(WORLD_SIZE="2", RANK="5", **RDV), "RANK=5: expected 0 <= RANK < WORLD_SIZE=2"),
        (dict(WORLD_SIZE="1", RANK="1"), "RANK=1: expected 0 <= RANK < WORLD_SIZE=1"),
        (dict(WORLD_SIZE="2", RANK="-1", **RDV), "RANK=-1: expected 0 <= RANK < WORLD_SIZE=2"),
        (dict(WORLD_SIZE="2", RANK="x", **RDV), "RANK='x': expected an integer"),
        (dict(WORLD_SIZE="two"), "WORLD_SIZE='two': expected an integer"),
        (dict(WORLD_SIZE="0"), "WORLD_SIZE=0: expected the number of processes, >= 1"),
        (dict(WORLD_SIZE="2", **RDV), "WORLD_SIZE=2 but RANK is not set: expected each process's rank, 0..1"),
        (dict(WORLD_SIZE="2", RANK="0", LOCAL_RANK="a", **RDV), "LOCAL_RANK='a': expected an integer"),
        (dict(WORLD_SIZE="2", RANK="0", LOCAL_RANK="-1", **RDV), "LOCAL_RANK=-1: expected >= 0"),
        (dict(WORLD_SIZE="2", RANK="0", MASTER_ADDR="127.0.0.1"), "WORLD_SIZE=2 but MASTER_PORT is not set"),
        (dict(WORLD_SIZE="2", RANK="0", MASTER_PORT="29500"), "WORLD_SIZE=2 but MASTER_ADDR is not set"),
        (dict(WORLD_SIZE="2", RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="abc"),
         "MASTER_PORT='abc': expected a TCP port, 1..65535"),
    ],
)
def test_a_bad_launch_environment_is_named_at_the_door(tmp_path, monkeypatch, capsys, env, message):
    for k in LAUNCH:
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError, match="^environment variable " + message.replace("(", r"\(")):
        parallel.launch_env()
    start = time.monotonic()
    assert trainer.main(TINY + [f"--job.dump_folder={tmp_path}/run", "--parallelism.timeout_s=1"]) == 2
    err = capsys.readouterr().err
    assert time.monotonic() - start < 10 and not dist.is_initialized()
    assert err.startswith(f"mxmoe train: error: environment variable {message}"), err
    assert "Traceback" not in err and not (tmp_path / "run").exists(), err


def test_a_torchrun_environment_and_none_are_accepted(monkeypatch):
    for k in LAUNCH:
        monkeypatch.delenv(k, raising=False)
    assert parallel.launch_env() == (0, 1, 0)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("MASTER_ADDR", "node0")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert parallel.launch_env() == (3, 4, 1)


def test_bench_train_names_a_bad_launch_environment_before_any_row(monkeypatch, capsys):
    """`mxmoe bench train` read WORLD_SIZE with a bare int() (a traceback naming nothing)."""
    from mxmoe.bench import train as bench_train

    for k in LAUNCH:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "abc")
    with pytest.raises(SystemExit) as e:
        bench_train.main(["--config", "debug_moe", "--steps", "1", "--warmup-steps", "1"])
    assert e.value.code == 2
    assert "WORLD_SIZE='abc': expected an integer" in capsys.readouterr().err
