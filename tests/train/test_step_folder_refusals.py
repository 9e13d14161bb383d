"""A checkpoint's step folder given where a checkpoint folder or an output file goes: `mxmoe train
--checkpoint.folder ckpt/step-N` started afresh and wrote its lock and its own checkpoints into
step-N (which resuming and exporting then refused: files its manifest does not list); `mxmoe export
ckpt ckpt/step-N/model.pt` spoiled the checkpoint it exported. Both are refused before any work,
naming the option and the folder."""

from pathlib import Path

import pytest
from test_trainer import TINY, two_step_checkpoint

from mxmoe.cli import main as cli
from mxmoe.train import trainer


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return two_step_checkpoint(tmp_path_factory.mktemp("stepfolder"))


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


@pytest.mark.parametrize("sub", ["", "/nested"])
def test_train_refuses_a_step_folder_as_checkpoint_folder(ckpt, tmp_path, capsys, sub):
    step = ckpt / "step-00000002"
    before = _files(step)
    folder = f"--checkpoint.folder={step}{sub}"
    argv = TINY + ["--training.steps=3", f"--job.dump_folder={tmp_path}/run", folder]
    assert trainer.main(argv) == 2
    err = capsys.readouterr().err
    assert f"checkpoint.folder='{step}{sub}'" in err and "a checkpoint's step folder" in err, err
    assert f"give --checkpoint.folder='{ckpt}' to resume its newest checkpoint" in err, err
    assert "Traceback" not in err
    assert _files(step) == before  # nothing written into the checkpoint
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # refused before the first step
    # the checkpoint still resumes
    argv = TINY + ["--training.steps=3", f"--job.dump_folder={tmp_path}/run2", f"--checkpoint.folder={ckpt}"]
    assert trainer.main(argv) == 0
    assert (ckpt / "step-00000003" / "manifest.json").is_file()


def test_export_refuses_an_output_inside_a_step_folder(ckpt, tmp_path, capsys):
    step = max(ckpt.glob("step-*"))
    before = _files(step)
    out = step / "model.pt"
    assert cli(["export", str(ckpt), str(out)]) == 2
    err = capsys.readouterr().err
    assert f"output='{out}' lies in the checkpoint step folder '{step}'" in err, err
    assert _files(step) == before
    beside = ckpt / "model.pt"  # the checkpoint folder itself is fine: not a step folder
    assert cli(["export", str(ckpt), str(beside)]) == 0
    assert beside.is_file() and _files(step) == before


@pytest.mark.parametrize("sub", ["", "/run"])
def test_train_refuses_a_dump_folder_in_a_step_folder(ckpt, tmp_path, capsys, sub):
    """job.dump_folder inside a checkpoint's step folder wrote the run's lock (and metrics) there: the
    next resume refused that checkpoint for a file its manifest does not list."""
    step = max(ckpt.glob("step-*"))
    before = _files(step)
    argv = TINY + ["--training.steps=9", f"--job.dump_folder={step}{sub}", f"--checkpoint.folder={ckpt}"]
    assert trainer.main(argv) == 2
    err = capsys.readouterr().err
    assert f"job.dump_folder='{step}{sub}' lies in the checkpoint step folder '{step}'" in err, err
    assert "Traceback" not in err
    assert _files(step) == before  # nothing written into the checkpoint
