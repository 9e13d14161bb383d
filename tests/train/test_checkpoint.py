"""Checkpoints a team can trust: checksums verified on resume, a fallback on request, pruning that
keeps the newest good checkpoint, runs that stop on a non-finite loss, resumes of another shape;
nothing in a checkpoint runs code on load, the manifest lists exactly the files present, every
save / load failure is a CheckpointError, and a live run holds its checkpoint folder."""

import errno
import hashlib
import json
import os
import pickle
from pathlib import Path

import pytest
import torch
from test_trainer import TINY, losses

from mxmoe.train import trainer
from mxmoe.train.checkpoint import MANIFEST, Checkpointer, CheckpointError


def _train(tmp_path: Path, name: str, *extra: str) -> int:
    run = tmp_path / name
    return trainer.main(TINY + [f"--job.dump_folder={run}", f"--checkpoint.folder={tmp_path}/ckpt", *extra])


def _shard(step_dir: Path) -> Path:
    """Rank 0's first file (a save writes one a thread, `--checkpoint.threads`)."""
    shard = step_dir / "__0_0.distcp"
    assert shard.is_file(), sorted(p.name for p in step_dir.iterdir())
    return shard


def _entries(folder: Path) -> list[str]:
    """The folder's entries but the run lock."""
    return sorted(p.name for p in folder.iterdir() if p.name != ".lock")


def _rehash(step_dir: Path, **changes) -> None:
    """What an attacker (or a careless script) does after editing a checkpoint: recompute the
    manifest's sizes and SHA-256 of the files present; `changes` replace manifest fields."""
    manifest = json.loads((step_dir / MANIFEST).read_text())
    manifest["files"] = {
        p.name: {"size": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
        for p in step_dir.iterdir()
        if p.name != MANIFEST
    }
    manifest.update(changes)
    (step_dir / MANIFEST).write_text(json.dumps(manifest))


class _MakeDirs:
    """Unpickling this calls os.makedirs(path): code run from a checkpoint."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return os.makedirs, (self.path,)


@pytest.fixture
def four_steps(tmp_path):
    """A run of 4 steps with checkpoints at steps 2 and 4 in tmp_path/ckpt; its losses."""
    args = ["--training.steps=4", "--checkpoint.interval=2", "--checkpoint.keep_latest_k=2"]
    assert _train(tmp_path, "full", *args) == 0
    assert _entries(tmp_path / "ckpt") == ["step-00000002", "step-00000004"]
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
    assert _entries(tmp_path / "ckpt") == ["step-00000002", "step-00000004"]
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
    names = _entries(tmp_path / "ckpt")
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


def test_a_resumed_run_trains_with_its_own_optimizer_and_schedule_settings(tmp_path, capsys, four_steps):
    from mxmoe.train.build import build_run, check_values, lr_lambda

    new = ["--optimizer.lr=1e-4", "--lr_scheduler.warmup_steps=0", "--optimizer.beta1=0.8",
           "--optimizer.beta2=0.9", "--optimizer.weight_decay=0.05", "--lr_scheduler.min_lr_factor=0.5",
           "--training.steps=6"]
    # what a resume builds: this config's settings in the param groups, its schedule at step 4
    folders = [f"--job.dump_folder={tmp_path}/x", f"--checkpoint.folder={tmp_path}/ckpt"]
    cfg = trainer.parse_args(TINY + folders + new)
    check_values(cfg)
    run = build_run(cfg, 0, 1, torch.device("cpu"))
    lam = lr_lambda(cfg)
    assert run.step == 4
    for group, decay in zip(run.optimizer.param_groups, (0.05, 0.0), strict=True):
        assert (group["betas"], group["weight_decay"], group["initial_lr"]) == ((0.8, 0.9), decay, 1e-4)
        assert group["lr"] == 1e-4 * lam(4)
    assert run.optimizer.state[run.optimizer.param_groups[0]["params"][0]]["step"] == 4  # moments kept
    # the run: steps 5 and 6 at the new schedule's rates; the log names every changed setting
    capsys.readouterr()
    assert _train(tmp_path, "resumed", *new) == 0
    err = capsys.readouterr().err
    for changed in ("optimizer.lr=0.0001 (checkpoint: 0.003)", "lr_scheduler.warmup_steps=0 (checkpoint: 2)",
                    "optimizer.beta1=0.8 (checkpoint: 0.9)", "optimizer.beta2=0.9 (checkpoint: 0.95)",
                    "optimizer.weight_decay=0.05 (checkpoint: 0.1)",
                    "lr_scheduler.min_lr_factor=0.5 (checkpoint: 0.1)"):
        assert changed in err, err
    recs = [json.loads(x) for x in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["lr"]) for r in recs] == [(5, 1e-4 * lam(4)), (6, 1e-4 * lam(5))]


def test_resuming_on_data_whose_bytes_changed_names_it(tmp_path, capsys):
    """A file of data.path edited in place (same names and sizes) resumed with no word: the
    checkpoint recorded the files' names and sizes only. Its bytes are recorded too, and the
    resume's warning names data.content."""
    data = tmp_path / "data"
    data.mkdir()
    for i in range(8):
        (data / f"f{i}.py").write_text("".join(chr(97 + (i * j) % 26) for j in range(400)))
    opts = [f"--data.path={data}", "--data.max_files=0", "--training.steps=2"]
    assert _train(tmp_path, "a", *opts) == 0
    (data / "f3.py").write_text((data / "f3.py").read_text()[::-1])  # same size, other bytes
    capsys.readouterr()
    assert _train(tmp_path, "b", *opts[:-1], "--training.steps=3") == 0
    err = capsys.readouterr().err
    assert "with settings that differ from the run that saved it" in err and "data.content='" in err, err
    assert "data.corpus=" not in err  # the names and sizes are the same


def test_resuming_in_another_precision_is_an_error_naming_both_unless_allowed(tmp_path, capsys):
    mx = ["--model.converters=mx", "--mx.mxfp8_dim1_cast_kernel_choice=torch"]
    assert _train(tmp_path, "mx", "--training.steps=2", *mx) == 0
    step2 = tmp_path / "ckpt" / "step-00000002"
    saved = json.loads((step2 / MANIFEST).read_text())["precision"]
    assert saved["model.converters"] == ["mx"] and saved["mx.recipe_name"] == "mxfp8_rceil"
    for other, named in (
        (["--model.converters="], ["model.converters: checkpoint ['mx'], this run []",
                                   "mx.recipe_name: checkpoint 'mxfp8_rceil', this run unset"]),
        ([*mx, "--mx.recipe_name=mxfp8"], ["mx.recipe_name: checkpoint 'mxfp8_rceil', this run 'mxfp8'",
                                           "mx.scaling_mode: checkpoint 'rceil', this run 'floor'"]),
        ([*mx, "--training.mixed_precision=fp32"],
         ["training.mixed_precision: checkpoint 'bf16', this run 'fp32'"]),
    ):
        capsys.readouterr()
        assert _train(tmp_path, "other", "--training.steps=4", *other) == 1
        err = capsys.readouterr().err
        assert f"checkpoint {step2} was trained in another precision" in err and "Traceback" not in err, err
        assert all(n in err for n in named), err
        assert "--checkpoint.allow_precision_change=true" in err
    assert _entries(tmp_path / "ckpt") == ["step-00000002"]  # nothing trained or saved
    # the explicit opt-in: continued in this run's precision, with a warning naming the change
    assert _train(tmp_path, "floor", "--training.steps=3", *mx, "--mx.recipe_name=mxfp8",
                  "--checkpoint.allow_precision_change=true") == 0
    assert "mx.recipe_name: checkpoint 'mxfp8_rceil', this run 'mxfp8'" in capsys.readouterr().err
    assert sorted(losses(tmp_path / "floor")) == [3]


def test_a_trainer_state_missing_a_key_is_an_error_naming_it(tmp_path, capsys, four_steps):
    step4 = tmp_path / "ckpt" / "step-00000004"
    state = json.loads((step4 / "trainer_state.json").read_text())
    del state["sampler"]
    (step4 / "trainer_state.json").write_text(json.dumps(state))
    _rehash(step4)
    capsys.readouterr()
    assert _train(tmp_path, "resumed", "--training.steps=6") == 1
    err = capsys.readouterr().err
    assert f"checkpoint file {step4 / 'trainer_state.json'}: sampler=None: expected the data position" in err
    assert "Traceback" not in err, err


@pytest.mark.parametrize("saved_step", [3, 999])
def test_a_trainer_state_of_another_step_than_its_folder_is_refused(tmp_path, capsys, four_steps, saved_step):
    """step-00000004/trainer_state.json saying step 3 resumed at step 3 with the sampler of step 4
    (the data one batch off), and step 999 trained nothing; both are refused naming the file."""
    step4 = tmp_path / "ckpt" / "step-00000004"
    state = json.loads((step4 / "trainer_state.json").read_text())
    state["step"] = saved_step
    (step4 / "trainer_state.json").write_text(json.dumps(state))
    _rehash(step4)
    capsys.readouterr()
    assert _train(tmp_path, "resumed", "--training.steps=6") == 1
    err = capsys.readouterr().err
    want = f"{step4 / 'trainer_state.json'}: step={saved_step}: expected 4, the step its folder"
    assert want in err and "Traceback" not in err, err
    assert not (tmp_path / "resumed" / "metrics.jsonl").exists()  # nothing trained


def test_nonfinite_loss_stops_the_run_and_saves_nothing(tmp_path, capsys):
    # lr 1e30 (finite, so accepted) blows the weights up: the gradient norm is NaN at step 2
    args = ["--optimizer.lr=1e30", "--lr_scheduler.warmup_steps=0", "--training.steps=4"]
    args += ["--checkpoint.interval=1"]
    assert _train(tmp_path, "run", *args) == 1
    err = capsys.readouterr().err
    assert "step 2: non-finite" in err and "nothing saved" in err and "Traceback" not in err, err
    # step 1's checkpoint holds the weights step 2 diverged from: set aside, not resumed
    assert "moved aside as step-00000001.diverged; no other checkpoint in" in err, err
    assert _entries(tmp_path / "ckpt") == ["step-00000001.diverged"]


def test_the_checkpoint_a_divergence_started_from_is_set_aside_and_the_one_before_resumed(tmp_path, capsys):
    """A checkpoint of the step before a non-finite loss holds the weights that gave it: resumed,
    with any new lr, it repeats the failure (it once did, the error naming it as the last
    checkpoint). It is moved aside as step-N.diverged (kept), the error names the checkpoint before
    it, and the next run resumes that one and trains on."""
    common = ["--lr_scheduler.warmup_steps=0", "--checkpoint.interval=1", "--checkpoint.keep_latest_k=0"]
    assert _train(tmp_path, "good", *common, "--training.steps=2") == 0
    # resumed at step 2 with lr 1e30: step 3's update blows the weights up, checkpoint 3 is written
    # from them, step 4's gradient norm is NaN
    assert _train(tmp_path, "bad", *common, "--training.steps=6", "--optimizer.lr=1e30") == 1
    err = capsys.readouterr().err
    assert "step 4: non-finite" in err and "moved aside as step-00000003.diverged" in err, err
    assert f"the last checkpoint is {tmp_path}/ckpt/step-00000002. Lower optimizer.lr" in err, err
    assert _entries(tmp_path / "ckpt") == ["step-00000001", "step-00000002", "step-00000003.diverged"]
    assert _train(tmp_path, "again", *common, "--training.steps=4") == 0  # resumes step 2
    assert sorted(losses(tmp_path / "again")) == [3, 4]
    assert "step-00000003.diverged" in _entries(tmp_path / "ckpt")  # kept, not resumed or pruned


@pytest.mark.parametrize(
    "change, message",
    [
        ("--training.local_batch_size=4", "global_batch: checkpoint 2, this run 4"),
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


# -- 1. nothing in a checkpoint runs code on load ------------------------------------------------
def test_a_metadata_file_that_runs_code_is_refused(tmp_path, capsys, four_steps):
    step4 = tmp_path / "ckpt" / "step-00000004"
    marker = tmp_path / "pwned"
    with open(step4 / ".metadata", "rb") as fh:
        md = pickle.load(fh)  # our own file, read to be altered
    md.storage_meta = _MakeDirs(marker)
    with open(step4 / ".metadata", "wb") as fh:
        pickle.dump(md, fh)
    _rehash(step4)  # the checksums match again: a checksum is no signature
    capsys.readouterr()
    assert _train(tmp_path, "resumed", "--training.steps=6") == 1
    err = capsys.readouterr().err
    assert f"{step4 / '.metadata'} is refused" in err and "makedirs" in err and "Traceback" not in err, err
    assert not marker.exists()
    # the refusal is a verification failure: --checkpoint.fallback takes the previous checkpoint
    assert _train(tmp_path, "resumed", "--training.steps=4", "--checkpoint.fallback=true") == 0
    assert not marker.exists()
    assert sorted(losses(tmp_path / "resumed")) == [3, 4]
    assert losses(tmp_path / "resumed")[4] == four_steps[4]


def _linear_checkpoint(folder: Path):
    ck = Checkpointer(str(folder), keep_latest=0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    return ck, model, opt, ck.save(1, model, opt, {"step": 1, "sampler": {"epoch": 0, "pos": 3}})


@pytest.mark.parametrize("item", ["optim.param_groups.0.lr", "extra.blob"])
def test_byte_items_we_did_not_write_are_refused(tmp_path, item):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    ck, model, opt, path = _linear_checkpoint(tmp_path / "ckpt")
    marker = tmp_path / "pwned"
    # the attacker rewrites the DCP files with one byte item whose unpickling runs code
    osd = get_optimizer_state_dict(model, opt)
    state = {"model": get_model_state_dict(model), "optim": osd}
    if item == "extra.blob":
        state["extra"] = {"blob": _MakeDirs(marker)}
    else:
        osd["param_groups"][0]["lr"] = _MakeDirs(marker)
    dcp.save(state, checkpoint_id=str(path))
    _rehash(path)
    with pytest.raises(CheckpointError, match=f"{item}.*refused|refused.*{item}"):
        ck.load(path, model, opt, {})
    assert not marker.exists()
    if item == "extra.blob":  # a byte item outside the optimizer's is refused by verification too
        with pytest.raises(CheckpointError, match="byte item 'extra.blob'"):
            ck.verify(path)


@pytest.mark.parametrize("dtype", [torch.float64, torch.int64])
def test_a_tensor_of_another_dtype_is_refused_not_cast(tmp_path, dtype):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    ck, model, opt, path = _linear_checkpoint(tmp_path / "ckpt")
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    state["model"]["weight"] = torch.full((4, 4), 7).to(dtype)  # once loaded as 7.0 into the fp32 weight
    dcp.save(state, checkpoint_id=str(path))
    _rehash(path)
    ck.verify(path)  # checksums and contents in order: the dtype is what is wrong
    before = model.weight.detach().clone()
    with pytest.raises(CheckpointError, match=rf"'model.weight' is {dtype} in the checkpoint, torch.float32 "
                       "in this run: refused, a checkpoint's tensors are never cast"):
        ck.load(path, model, opt, {})
    assert torch.equal(model.weight.detach(), before)


def test_the_trainer_state_is_json_and_reloads(tmp_path, four_steps):
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from mxmoe.train.checkpoint import TRAIN_STATE, read_metadata

    step4 = tmp_path / "ckpt" / "step-00000004"
    state = json.loads((step4 / TRAIN_STATE).read_text())
    assert state["step"] == 4 and state["scheduler"]["last_epoch"] == 4
    assert state["sampler"]["step"] == 4 and state["sampler"]["seed"] == 0
    md = read_metadata(step4 / ".metadata")
    byte_items = [k for k, v in md.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)]
    assert byte_items and all(k.startswith("optim.param_groups.") for k in byte_items), byte_items
    assert "rng_rank0.cpu" in md.state_dict_metadata  # a uint8 tensor, no pickle


# -- 2. the manifest lists exactly the files present ---------------------------------------------
@pytest.mark.parametrize("damage", ["empty_files", "extra_file", "files_list", "lost_rank"])
def test_the_manifest_must_list_exactly_the_files_present(tmp_path, capsys, four_steps, damage):
    step4 = tmp_path / "ckpt" / "step-00000004"
    shard = _shard(step4)
    manifest = json.loads((step4 / MANIFEST).read_text())
    if damage == "empty_files":  # an emptied list of files and flipped bytes in the shard
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
        manifest["files"] = {}
        message = "is not listed in manifest.json"
    elif damage == "extra_file":
        (step4 / "notes.txt").write_text("x")
        message = f"{step4 / 'notes.txt'} is not listed in manifest.json"
    elif damage == "files_list":
        manifest["files"] = sorted(manifest["files"])
        message = '"files" must map each file name to its size and sha256, got list'
    else:  # saved by 2 ranks, rank 1's shard gone from the folder and the manifest
        manifest["world"] = 2
        message = "names no shard of rank(s) [1] (__1_0.distcp)"
    (step4 / MANIFEST).write_text(json.dumps(manifest))
    capsys.readouterr()
    assert _train(tmp_path, "resumed", "--training.steps=6") == 1
    err = capsys.readouterr().err
    assert message in err and "--checkpoint.fallback=true" in err and "Traceback" not in err, err
    assert not (tmp_path / "resumed" / "metrics.jsonl").exists()
    assert _train(tmp_path, "resumed", "--training.steps=4", "--checkpoint.fallback=true") == 0
    assert losses(tmp_path / "resumed") == {3: four_steps[3], 4: four_steps[4]}


def test_an_incomplete_step_folder_is_an_error_not_a_skip(tmp_path, capsys, four_steps):
    # a step folder with a shard but neither .metadata nor manifest (copied by hand, say)
    step6 = tmp_path / "ckpt" / "step-00000006"
    step6.mkdir()
    (step6 / "__0_0.distcp").write_bytes(_shard(tmp_path / "ckpt" / "step-00000004").read_bytes())
    capsys.readouterr()
    assert _train(tmp_path, "resumed", "--training.steps=8") == 1
    err = capsys.readouterr().err
    assert f"checkpoint {step6} is incomplete" in err and "step-00000004 instead" in err, err
    assert not (tmp_path / "resumed" / "metrics.jsonl").exists()


# -- 3. DCP's own failures are the trainer's checkpoint errors -----------------------------------
def test_a_dcp_load_failure_is_a_checkpoint_error_naming_step_and_file(tmp_path):
    ck, model, opt, path = _linear_checkpoint(tmp_path / "ckpt")
    _shard(path).unlink()
    # DCP raises CheckpointException, a BaseException that `except Exception` never sees
    with pytest.raises(CheckpointError, match=r"checkpoint step 1 .*__0_0\.distcp"):
        ck.load(path, model, opt, {})


def test_a_failed_save_is_a_checkpoint_error_naming_step_and_file(tmp_path, capsys, monkeypatch):
    from torch.distributed.checkpoint.filesystem import FileSystem

    real = FileSystem.create_stream

    def no_space(self, path, mode):
        if "wb" in mode and str(path).endswith(".distcp"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real(self, path, mode)

    monkeypatch.setattr(FileSystem, "create_stream", no_space)
    assert _train(tmp_path, "run", "--training.steps=2", "--checkpoint.interval=2") == 1
    err = capsys.readouterr().err
    assert "saving checkpoint step 2 in" in err and "No space left on device" in err, err
    assert "__0_0.distcp" in err and "Traceback" not in err, err
    assert _entries(tmp_path / "ckpt") == ["step-00000002.tmp"]  # never under a final name


# -- 4. one live run per checkpoint folder --------------------------------------------------------
def test_a_live_run_holds_the_checkpoint_folder_and_a_stale_lock_is_taken_over(tmp_path, capsys):
    from mxmoe.train.metrics import RunLock

    live = RunLock(tmp_path / "ckpt", "live-run-id", "checkpoint.folder")
    try:
        assert _train(tmp_path, "b", "--training.steps=1") == 2
        err = capsys.readouterr().err
        assert "checkpoint.folder=" in err and "in use by a live run (run live-run-id" in err, err
        assert not (tmp_path / "b" / "metrics.jsonl").exists()
    finally:
        live.release()
    # a run killed while holding it leaves its name in the lock file: taken over, with a message
    (tmp_path / "ckpt" / ".lock").write_text("run killed-run-id, pid 1 on somewhere")
    assert _train(tmp_path, "c", "--training.steps=1") == 0
    err = capsys.readouterr().err
    assert "taking over the lock of run killed-run-id" in err, err
    assert (tmp_path / "ckpt" / ".lock").read_text() == ""  # released at the end


# -- 6. the smaller ones --------------------------------------------------------------------------
@pytest.mark.parametrize("link", ["metrics/config.json", "ckpt/.lock"])
def test_symlinks_in_the_run_folders_are_refused(tmp_path, capsys, link):
    target = tmp_path / "precious.txt"
    target.write_text("keep me")
    (tmp_path / link).parent.mkdir(parents=True)
    (tmp_path / link).symlink_to(target)
    assert _train(tmp_path, "metrics", "--training.steps=1") == 2
    err = capsys.readouterr().err
    assert "holds symbolic links" in err and Path(link).name in err and "Traceback" not in err, err
    assert target.read_text() == "keep me"


def test_a_checkpoint_folder_that_cannot_be_written_fails_at_start(tmp_path, capsys):
    (tmp_path / "file").write_text("not a folder")
    argv = TINY + [f"--job.dump_folder={tmp_path}/run", f"--checkpoint.folder={tmp_path}/file/ckpt"]
    assert trainer.main(argv + ["--training.steps=2"]) == 2
    err = capsys.readouterr().err
    assert f"checkpoint.folder='{tmp_path}/file/ckpt'" in err and "Traceback" not in err, err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # stopped before the first step


def test_resume_false_in_a_used_folder_does_not_leave_the_old_run_to_resume(tmp_path, capsys):
    assert _train(tmp_path, "a", "--training.steps=4") == 0  # run A: step-00000004
    assert _train(tmp_path, "b", "--training.steps=2", "--checkpoint.resume=false") == 0
    err = capsys.readouterr().err
    (aside,) = (tmp_path / "ckpt").glob("superseded-*")
    assert _entries(aside) == ["step-00000004"] and aside.name in err
    assert _entries(tmp_path / "ckpt") == ["step-00000002", aside.name]
    # a plain run later continues run B (from its step 2), not run A's step 4
    assert _train(tmp_path, "c", "--training.steps=3") == 0
    assert sorted(losses(tmp_path / "c")) == [3]
    assert "resumed from " + str(tmp_path / "ckpt" / "step-00000002") in capsys.readouterr().out


def test_stale_tmp_and_empty_step_folders_are_cleaned(tmp_path, capsys):
    assert _train(tmp_path, "a", "--training.steps=2") == 0
    ck = tmp_path / "ckpt"
    (ck / "step-00000003.tmp").mkdir()  # a save killed before its rename
    (ck / "step-00000003.tmp" / "__0_0.distcp").write_bytes(b"half")
    (ck / "step-00000001").mkdir()  # an interrupted prune (older code deleted in place)
    (ck / "step-00000000.pruned").mkdir()
    capsys.readouterr()
    assert _train(tmp_path, "b", "--training.steps=3") == 0
    out, err = capsys.readouterr()
    assert "removed step-00000003.tmp" in out and "removed the empty folder step-00000001" in err
    assert _entries(ck) == ["step-00000002", "step-00000003"]
    assert sorted(losses(tmp_path / "b")) == [3]


@pytest.mark.parametrize("name", ["step-00000004", "step-00000002.tmp"])
def test_a_file_under_a_checkpoint_name_is_refused_at_start(tmp_path, capsys, name):
    # once ignored at start, then the save at that step failed (steps lost, a .tmp left behind)
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / name).write_text("not a checkpoint")
    assert _train(tmp_path, "run", "--training.steps=4", "--checkpoint.interval=2") == 2
    err = capsys.readouterr().err
    assert f"holds ['{name}'], not folders, under the names checkpoints are saved as" in err, err
    assert "Traceback" not in err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # refused before the first step
    assert _entries(tmp_path / "ckpt") == [name]


def test_a_folder_of_another_trainers_checkpoints_is_refused_unless_resume_false(tmp_path, capsys):
    """torchtitan's `step-100/` (a DCP checkpoint mxmoe does not read) was passed over without a word:
    a run meant to resume it trained from step 1 beside it."""
    other = tmp_path / "ckpt" / "step-100"
    other.mkdir(parents=True)
    (other / ".metadata").write_bytes(b"x")
    assert _train(tmp_path, "run", "--training.steps=2") == 2
    err = capsys.readouterr().err
    assert f"checkpoint.folder='{tmp_path}/ckpt' holds ['step-100'], not a checkpoint of mxmoe train" in err
    assert "--checkpoint.resume=false to start afresh" in err and "Traceback" not in err, err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # refused before the first step
    assert _train(tmp_path, "run", "--training.steps=2", "--checkpoint.resume=false") == 0
    assert _train(tmp_path, "run2", "--training.steps=3") == 0  # mxmoe's own checkpoint resumes beside it
    assert sorted(losses(tmp_path / "run2")) == [3]
    assert _entries(tmp_path / "ckpt") == ["step-00000002", "step-00000003", "step-100"]


def test_a_resumed_run_with_another_config_keeps_the_first_config_json(tmp_path):
    assert _train(tmp_path, "run", "--training.steps=2") == 0
    first = json.loads((tmp_path / "run" / "config.json").read_text())
    assert _train(tmp_path, "run", "--training.steps=3") == 0
    assert json.loads((tmp_path / "run" / "config.json").read_text()) == first
    (later,) = (tmp_path / "run").glob("config.*.json")
    conf = json.loads(later.read_text())
    assert later.name == f"config.{conf['run_id']}.json" and conf["run_id"] != first["run_id"]
    assert first["training"]["steps"] == 2 and conf["training"]["steps"] == 3
    assert not list((tmp_path / "run").glob(".*.tmp"))  # written by rename, nothing left behind


def _save_to_own_folder(rank: int, world: int, port: int, out: str) -> None:
    """A rank saving into a folder of its own (another --checkpoint.folder, or a disk not shared)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 4)
        opt = torch.optim.AdamW(model.parameters())
        try:
            Checkpointer(f"{out}/ckpt{rank}").save(1, model, opt, {"step": 1})
            Path(out, f"result{rank}").write_text("saved")
        except CheckpointError as e:
            Path(out, f"result{rank}").write_text(str(e))
    finally:
        dist.destroy_process_group()


def test_a_save_missing_a_ranks_shard_fails_on_every_rank(tmp_path):
    from conftest import spawn_ranks

    spawn_ranks(_save_to_own_folder, 2, str(tmp_path))
    for r in range(2):
        msg = (tmp_path / f"result{r}").read_text()
        assert msg.startswith("saving checkpoint step 1 in") and "no shard of rank(s) [1]" in msg, msg
    assert not (tmp_path / "ckpt0" / "step-00000001").exists()  # never under a final name


# -- 4. a save writes a file a thread; a writer thread's failure is the save's --------------------
def test_a_save_in_threads_writes_a_file_each_and_resumes_the_same_bits(tmp_path, four_steps):
    """`--checkpoint.threads=3`: rank 0 writes __0_0 .. __0_2 (DCP's FileSystemWriter, a file per
    thread), all in the manifest; resuming it continues with the losses of the run that never
    stopped (four_steps saved with the default threads)."""
    run = tmp_path / "threads"
    common = [f"--checkpoint.folder={tmp_path}/ckpt3", "--checkpoint.threads=3"]
    assert trainer.main(TINY + [f"--job.dump_folder={run}", "--training.steps=2", "--checkpoint.interval=2",
                                *common]) == 0
    step = tmp_path / "ckpt3" / "step-00000002"
    shards = sorted(p.name for p in step.glob("*.distcp"))
    assert shards == ["__0_0.distcp", "__0_1.distcp", "__0_2.distcp"]
    assert set(shards) <= set(json.loads((step / MANIFEST).read_text())["files"])
    assert trainer.main(TINY + [f"--job.dump_folder={run}", "--training.steps=4", *common]) == 0
    assert losses(run)[3] == four_steps[3] and losses(run)[4] == four_steps[4]


def test_a_writer_threads_failure_fails_the_save(tmp_path, monkeypatch):
    """DCP joins its writer threads without looking at how they ended: a file one of them could not
    write would be missing from a checkpoint declared whole. The save is a CheckpointError naming
    the file, nothing is printed as an unhandled thread exception, no step folder is made."""
    import threading
    import time

    from torch.distributed.checkpoint.filesystem import FileSystem

    real = FileSystem.create_stream

    def helper_threads_fail(self, path, mode):
        if "wb" in mode and str(path).endswith(".distcp"):
            if threading.current_thread() is threading.main_thread():
                time.sleep(0.3)  # the helper threads take their files first
            else:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real(self, path, mode)

    monkeypatch.setattr(FileSystem, "create_stream", helper_threads_fail)
    ck = Checkpointer(str(tmp_path / "ckpt"), keep_latest=0, threads=4)
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(4)])
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    hooked = threading.excepthook
    with pytest.raises(CheckpointError, match=r"saving checkpoint step 1 in .*__0_\d\.distcp.*No space left"):
        ck.save(1, model, opt, {"step": 1})
    assert threading.excepthook is hooked
    assert _entries(tmp_path / "ckpt") == ["step-00000001.tmp"]


def test_io_threads_share_the_cpus_among_the_hosts_ranks(monkeypatch):
    from mxmoe.train.checkpoint.common import io_threads

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert io_threads() == 8
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert io_threads() == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "32")
    assert io_threads() == 1
