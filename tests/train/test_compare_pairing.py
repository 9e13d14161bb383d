"""`mxmoe compare --config`: a variant whose options change what paired runs must share (training
steps, sequence length, batch, data) ran every run and then failed with "runs of different setups
cannot be paired"; it is refused before any run, naming the variant, the option and both values."""

from pathlib import Path

import pytest

from mxmoe.train import compare
from mxmoe.train.compare.launcher import check_paired_setup
from mxmoe.train.config import parse_args

REPO = Path(__file__).parents[2]


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--variant", "a", "--variant", "b=--training.steps=3"],
            "--variant b: training.steps=3, the baseline a's is 500: runs of different setups cannot be "
            "paired",
        ),
        (
            ["--variant", "a=--training.seq_len=64", "--variant", "b", "--baseline", "b"],
            "--variant a: training.seq_len=64, the baseline b's is 128",
        ),
        (
            ["--variant", "a", "--variant", "b=--training.local_batch_size=4"],
            "--variant b: training.local_batch_size=4, the baseline a's is 8",
        ),
        (
            ["--variant", "a", "--variant", "b=--data.max_files=3 --model.converters="],
            "--variant b: data.max_files=3, the baseline a's is 0",
        ),
    ],
)
def test_a_variant_of_another_setup_is_refused_before_any_run(tmp_path, capsys, monkeypatch, argv, message):
    monkeypatch.chdir(REPO)
    out = tmp_path / "o"
    assert compare.main(["--config", "debug_moe", "--out", str(out), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert "Traceback" not in err
    assert not (out / "runs").exists()  # nothing ran


def test_variants_that_share_the_setup_pass():
    base = parse_args(["--config=debug_moe", "--training.steps=3"])
    other = parse_args(["--config=debug_moe", "--training.steps=3", "--model.converters=", "--debug.seed=1"])
    check_paired_setup({"mx": base, "bf16": other}, "mx")  # precision and seed may differ: no error
    with pytest.raises(ValueError, match=r"--variant bf16: training.steps=4, the baseline mx's is 3"):
        longer = parse_args(["--config=debug_moe", "--training.steps=4"])
        check_paired_setup({"mx": base, "bf16": longer}, "mx")
