"""One run, one folder: a live run locks its metrics folder, records carry a run id and a time, are
strict JSON, and a resumed run's records continue without duplicates."""

import errno
import json
import math
import os
import shutil

import pytest
from test_trainer import TINY, losses

from mxmoe.train import metrics, trainer
from mxmoe.train.metrics import DROPPED, MetricsWriter, RunLock


def _strict(line: str) -> dict:
    def no_constants(name):
        raise AssertionError(f"non-standard JSON constant {name}")

    return json.loads(line, parse_constant=no_constants)


def _records(folder) -> list[dict]:
    return [_strict(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]


def test_a_second_run_on_a_live_folder_is_refused(tmp_path, capsys):
    run = tmp_path / "run"
    live = RunLock(run, "live-run-id")  # another run holding the folder
    try:
        assert trainer.main(TINY + ["--training.steps=1", f"--job.dump_folder={run}"]) == 2
        err = capsys.readouterr().err
        assert "is in use by a live run (run live-run-id, pid" in err and "--job.dump_folder" in err, err
        assert not (run / "metrics.jsonl").exists()
    finally:
        live.release()
    # once it has finished, the folder is free again (and a finished run leaves it free too)
    assert trainer.main(TINY + ["--training.steps=1", f"--job.dump_folder={run}"]) == 0
    RunLock(run, "next").release()


def test_records_carry_run_id_and_time_and_are_strict_json(tmp_path):
    assert trainer.main(TINY + ["--training.steps=2", f"--job.dump_folder={tmp_path}"]) == 0
    recs = _records(tmp_path)
    assert [r["step"] for r in recs] == [1, 2]
    assert len({r["run_id"] for r in recs}) == 1 and recs[0]["run_id"]
    assert json.loads((tmp_path / "config.json").read_text())["run_id"] == recs[0]["run_id"]
    assert all(isinstance(r["time"], float) and r["time"] > 1.7e9 for r in recs)
    w = MetricsWriter(str(tmp_path / "nan"), True, False, {}, "rid")
    w.log({"step": 1, "loss": math.nan, "grad_norm": math.inf, "lr": 1e-3})
    w.close()
    (rec,) = _records(tmp_path / "nan")
    assert rec["loss"] is None and rec["grad_norm"] is None and rec["lr"] == 1e-3
    assert rec["nonfinite"] == ["grad_norm", "loss"]


def test_a_resumed_run_continues_the_records_without_duplicates(tmp_path):
    run = tmp_path / "run"
    args = TINY + [f"--job.dump_folder={run}", f"--checkpoint.folder={run}/ckpt"]
    args += ["--checkpoint.keep_latest_k=0"]
    assert trainer.main(args + ["--training.steps=4", "--checkpoint.interval=2"]) == 0
    first = _records(run)
    # the run died after logging step 4 but before its checkpoint: the resume starts at step 2
    shutil.rmtree(run / "ckpt" / "step-00000004")
    assert trainer.main(args + ["--training.steps=4"]) == 0
    recs = _records(run)
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    assert recs[:2] == first[:2]
    assert recs[2]["run_id"] == recs[3]["run_id"] != first[0]["run_id"]
    assert [r["loss"] for r in recs[2:]] == [r["loss"] for r in first[2:]]  # resumed exactly
    dropped = [_strict(x) for x in (run / DROPPED).read_text().splitlines()]
    assert dropped == first[2:]
    assert sorted(losses(run)) == [1, 2, 3, 4]


@pytest.mark.parametrize("full", ["config.json", "metrics.jsonl"])
def test_a_full_disk_under_the_metrics_folder_is_an_error_not_a_traceback(
    tmp_path, capsys, monkeypatch, full
):
    if full == "config.json":

        def write_atomic(path, text):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

        monkeypatch.setattr(metrics, "write_atomic", write_atomic)
    else:  # records go to a file of a full disk: /dev/full fails every write with ENOSPC
        monkeypatch.setattr(metrics, "_no_follow", lambda path, flags: os.open("/dev/full", os.O_WRONLY))
    run = tmp_path / "run"
    assert trainer.main(TINY + ["--training.steps=2", f"--job.dump_folder={run}"]) == 1
    err = capsys.readouterr().err
    want = f"mxmoe train: error: job.dump_folder={str(run)!r}: cannot write {full}: No space left on device"
    assert want in err
    assert "Traceback" not in err, err


def _wandb_records(folder, timeout_s: float = 60.0) -> list:
    """The records of the one offline W&B run under `folder`/wandb, through its exit record: its
    `.wandb` file read as wandb writes it (a 7-byte file header, then LevelDB-log records in 32 KiB
    blocks, each a protobuf `Record`). wandb's service process may finish writing the file after
    `finish()` returns: it is read again until the exit record is there."""
    import struct
    import time

    from wandb.proto import wandb_internal_pb2 as pb

    deadline = time.monotonic() + timeout_s
    while True:
        (file,) = (folder / "wandb").glob("offline-run-*/run-*.wandb")
        data, pos, block, buf, out = file.read_bytes(), 7, 32768, b"", []
        while pos + 7 <= len(data):
            if block - pos % block < 7:  # a block's tail too short for a header is padding
                pos += block - pos % block
                continue
            _crc, n, kind = struct.unpack("<IHB", data[pos : pos + 7])
            if kind == 0 and n == 0:
                break
            buf, pos = buf + data[pos + 7 : pos + 7 + n], pos + 7 + n
            if kind in (1, 4):  # a whole record, or its last part
                rec = pb.Record()
                rec.ParseFromString(buf)
                out.append(rec)
                buf = b""
        if (out and out[-1].WhichOneof("record_type") == "exit") or time.monotonic() > deadline:
            assert data[:4] == b":W&B", data[:7]
            return out
        time.sleep(0.2)


@pytest.fixture
def fresh_wandb(monkeypatch):
    """wandb with no settings kept from an earlier run in this process (its setup is a singleton
    that reads the environment once), torn down after the test."""
    wandb = pytest.importorskip("wandb")
    wandb.teardown()
    yield
    wandb.teardown()


def test_wandb_logs_what_tensorboard_gets(tmp_path, monkeypatch, fresh_wandb):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = tmp_path / "run"
    args = [
        "--training.steps=3",
        f"--job.dump_folder={run}",
        "--metrics.enable_wandb",
        "--metrics.wandb_project=p",
    ]
    assert trainer.main(TINY + args) == 0
    recs = _wandb_records(run)
    kinds = [r.WhichOneof("record_type") for r in recs]
    assert kinds.count("run") == 1 and kinds[-1] == "exit", kinds
    (start,) = [r.run for r in recs if r.WhichOneof("record_type") == "run"]
    run_id = _records(run)[0]["run_id"]
    assert (start.display_name, start.project) == (run_id, "p")
    config = {i.key: json.loads(i.value_json) for i in start.config.update}
    assert config["training"]["steps"] == 3
    history = [
        {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
        for r in recs
        if r.WhichOneof("record_type") == "history"
    ]
    # every number of each metrics.jsonl record (what TensorBoard gets), at its step
    for rec, row in zip(_records(run), history, strict=True):
        numbers = {
            k: v
            for k, v in rec.items()
            if k not in ("step", "run_id", "time") and isinstance(v, (int, float))
        }
        assert row["_step"] == rec["step"]
        assert {k: row[k] for k in numbers} == pytest.approx(numbers)


def test_wandb_that_cannot_start_is_an_error_naming_the_fix(tmp_path, monkeypatch, capsys, fresh_wandb):
    for var in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc, no wandb settings: not logged in
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    run = tmp_path / "run"
    argv = ["--training.steps=1", f"--job.dump_folder={run}", "--metrics.enable_wandb"]
    assert trainer.main(TINY + argv) == 1
    err = capsys.readouterr().err
    assert "mxmoe train: error: metrics.enable_wandb: W&B did not start (" in err
    assert "set WANDB_MODE=offline" in err and "Traceback" not in err
