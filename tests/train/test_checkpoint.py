"""Checkpoints a team can trust: checksums verified on resume, a fallback on request, pruning that
keeps the newest good checkpoint, runs that stop on a non-finite loss, resumes of another shape."""

import json
from pathlib import Path

import pytest
import torch
from test_trainer import TINY, losses

from mxmoe.train import trainer
from mxmoe.train.checkpoint import MANIFEST, Checkpointer, CheckpointError


def _train(tmp_path: Path, name: str, *extra: str) -> int:
    run = tmp_path / name
    return trainer.main(TINY + [f"--metrics.folder={run}", f"--checkpoint.folder={tmp_path}/ckpt", *extra])


def _shard(step_dir: Path) -> Path:
    (shard,) = step_dir.glob("*.distcp")
    return shard


@pytest.fixture
def four_steps(tmp_path):
    """A run of 4 steps with checkpoints at steps 2 and 4 in tmp_path/ckpt; its losses."""
    args = ["--training.steps=4", "--checkpoint.interval=2", "--checkpoint.keep_latest=2"]
    assert _train(tmp_path, "full", *args) == 0
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step-00000002", "step-00000004"]
    return losses(tmp_path / "full")


def test_every_checkpoint_has_a_manifest_of_sizes_and_sha256(tmp_path, four_steps):
    step4 = tmp_path / "ckpt" / "step-00000004"
    manifest = json.loads((step4 / MANIFEST).read_text())
    assert manifest["step"] == 4
    assert set(manifest["files"]) == {p.name for p in step4.iterdir() if p.name != MANIFEST}
    assert manifest["files"][".metadata"]["size"] == (step4 / ".metadata").stat().st_size
    assert manifest["run"]["global_batch"] == 2 and manifest["run"]["seq_len"] == 32


@pytest.mark.parametrize(
    "damage, message",
    [
        ("flip", "does not match its SHA-256"),
        ("truncate", "bytes, its manifest says"),
        ("delete", "is missing"),
        ("metadata", ".metadata is missing"),
        ("manifest", f"has no {MANIFEST}"),
    ],
)
def test_a_damaged_checkpoint_is_a_clear_error_and_nothing_is_pruned(
    tmp_path, capsys, four_steps, damage, message
):
    step4 = tmp_path / "ckpt" / "step-00000004"
    shard = _shard(step4)
    data = bytearray(shard.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    elif damage == "truncate":
        shard.write_bytes(bytes(data[: len(data) // 2]))
    elif damage == "delete":
        shard.unlink()
    elif damage == "metadata":
        (step4 / ".metadata").unlink()
    else:
        (step4 / MANIFEST).unlink()
    capsys.readouterr()
    assert _train(tmp_path, "resumed", "--training.steps=6", "--checkpoint.interval=2") == 1
    err = capsys.readouterr().err
    assert message in err and "--checkpoint.fallback=true" in err and "step-00000002" in err, err
    if damage in ("flip", "truncate", "delete"):
        assert str(shard) in err
    assert "Traceback" not in err
    # nothing trained, nothing pruned
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step-00000002", "step-00000004"]
    assert not (tmp_path / "resumed" / "metrics.jsonl").exists()


def test_fallback_resumes_from_the_previous_checkpoint_exactly(tmp_path, capsys, four_steps):
    shard = _shard(tmp_path / "ckpt" / "step-00000004")
    data = bytearray(shard.read_bytes())
    data[100] ^= 0x01
    shard.write_bytes(bytes(data))
    args = ["--training.steps=4", "--checkpoint.interval=2", "--checkpoint.fallback=true"]
    assert _train(tmp_path, "resumed", *args) == 0
    assert "moved aside as step-00000004.corrupt" in capsys.readouterr().err
    got = losses(tmp_path / "resumed")
    assert sorted(got) == [3, 4] and got[3] == four_steps[3] and got[4] == four_steps[4]
    names = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert names == ["step-00000002", "step-00000004", "step-00000004.corrupt"]
    Checkpointer(str(tmp_path / "ckpt")).verify(tmp_path / "ckpt" / "step-00000004")


def test_pruning_never_deletes_the_checkpoint_just_written(tmp_path):
    # an earlier run's checkpoint of a higher step sits in the folder (e.g. --checkpoint.resume=false)
    ck = Checkpointer(str(tmp_path), keep_latest=1)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    old = ck.save(100, model, opt, {"step": 100})
    new = ck.save(5, model, opt, {"step": 5})
    # keep_latest=1 keeps the highest step, and the one just saved is kept as well
    assert new.is_dir() and ck.verify(new)["step"] == 5 and old.is_dir()
    ck.save(6, model, opt, {"step": 6})
    assert not new.exists() and old.is_dir() and (tmp_path / "step-00000006").is_dir()


def test_nonfinite_loss_stops_the_run_and_saves_nothing(tmp_path, capsys):
    # lr 1e30 (finite, so accepted) blows the weights up: the gradient norm is NaN at step 2
    args = ["--training.lr=1e30", "--training.warmup_steps=0", "--training.steps=4"]
    args += ["--checkpoint.interval=1"]
    assert _train(tmp_path, "run", *args) == 1
    err = capsys.readouterr().err
    assert "step 2: non-finite" in err and "nothing saved" in err and "Traceback" not in err, err
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step-00000001"]


@pytest.mark.parametrize(
    "change, message",
    [
        ("--training.batch_size=4", "global_batch: checkpoint 2, this run 4"),
        ("--training.seq_len=64", "seq_len: checkpoint 32, this run 64"),
        ("--model.dim=64", "model.dim: checkpoint 32, this run 64"),
    ],
)
def test_resuming_a_run_of_another_shape_is_a_clear_error(tmp_path, capsys, change, message):
    assert _train(tmp_path, "a", "--training.steps=1") == 0
    capsys.readouterr()
    assert _train(tmp_path, "b", "--training.steps=2", change) == 1
    err = capsys.readouterr().err
    assert "written by a run of another shape" in err and message in err and "Traceback" not in err, err
    with pytest.raises(CheckpointError, match="another shape"):
        Checkpointer(str(tmp_path / "ckpt"), run={"seq_len": 7}).load(
            tmp_path / "ckpt" / "step-00000001", None, None, {}
        )
