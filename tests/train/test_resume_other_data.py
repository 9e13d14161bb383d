"""Resuming a checkpoint with other data options or another seed: the error named neither the
checkpoint nor the option ("checkpointed sampler (n=..., seed=...) does not match this data"); it
names the checkpoint, each differing option with both values, and the ways on."""

from pathlib import Path

import pytest
from test_trainer import TINY, two_step_checkpoint

from mxmoe.train import trainer


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return two_step_checkpoint(tmp_path_factory.mktemp("otherdata"))


@pytest.mark.parametrize(
    "options, named",
    [
        (["--data.max_files=5"], ["data.max_files: checkpoint 6, this run 5"]),
        (["--debug.seed=3"], ["debug.seed: checkpoint 0, this run 3"]),
        (
            ["--data.val_fraction=0.5", "--debug.seed=1"],
            ["data.val_fraction: checkpoint 0.05, this run 0.5", "debug.seed: checkpoint 0, this run 1"],
        ),
    ],
)
def test_resume_with_other_data_names_the_options(ckpt, tmp_path, capsys, options, named):
    argv = TINY + ["--training.steps=3", f"--job.dump_folder={tmp_path}/run", f"--checkpoint.folder={ckpt}"]
    assert trainer.main(argv + options) == 2
    err = capsys.readouterr().err
    assert f"checkpoint {ckpt}/step-00000002 was trained on other data or with another seed" in err, err
    for text in named:
        assert text in err, err
    assert "start a new --checkpoint.folder (or --checkpoint.resume=false)" in err
    assert "Traceback" not in err
    assert not (ckpt / "step-00000003").exists()


def test_resume_with_the_same_data_continues(ckpt, tmp_path):
    argv = TINY + ["--training.steps=3", f"--job.dump_folder={tmp_path}/run", f"--checkpoint.folder={ckpt}"]
    assert trainer.main(argv) == 0
    assert (ckpt / "step-00000003").is_dir()
