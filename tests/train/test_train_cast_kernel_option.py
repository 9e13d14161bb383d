"""`mxmoe train --mx.mxfp8_dim0_cast_kernel_choice=cuda` on a CPU: the error, raised while the model
was converted, named the recipe's field ("recipe dim0_kernel='cuda' cannot run for a model on cpu"),
not the option given. It is checked once the device is known, before anything is built, naming
the option, its value and the device."""

import pytest
import torch
from test_trainer import MX, TINY

from mxmoe.train import trainer

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is of a CPU run")


@pytest.mark.parametrize("key", ["mxfp8_dim0_cast_kernel_choice", "mxfp8_dim1_cast_kernel_choice"])
def test_a_cuda_cast_kernel_on_cpu_is_refused_naming_the_option(tmp_path, capsys, key):
    argv = TINY + MX + [f"--mx.{key}=cuda", "--training.steps=1", f"--job.dump_folder={tmp_path}/run"]
    assert trainer.main(argv) == 2
    err = capsys.readouterr().err
    want = f"mxmoe train: error: mx.{key}='cuda' cannot run on cpu: kernel='cuda' needs a CUDA tensor"
    assert want in err, err
    assert "Traceback" not in err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_high_precision_run_does_not_check_the_kernels(tmp_path):
    # allow_unconverted: MX options given, nothing converted, so no cast kernel runs
    argv = TINY + [
        "--mx.mxfp8_dim0_cast_kernel_choice=cuda",
        "--mx.allow_unconverted=true",
        "--training.steps=1",
        f"--job.dump_folder={tmp_path}/run",
    ]
    assert trainer.main(argv) == 0
    assert (tmp_path / "run" / "metrics.jsonl").is_file()
