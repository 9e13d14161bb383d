"""GPU smoke runs of the trainer (run on the H200 with `pytest -m gpu tests/train`)."""

import json
import shutil
from pathlib import Path

import pytest

from mxmoe.train import trainer

pytestmark = pytest.mark.gpu

TINY_GPU = [
    "--model.dim=128",
    "--model.n_heads=4",
    "--model.n_layers=2",
    "--model.num_experts=8",
    "--model.top_k=2",
    "--model.moe_hidden_dim=128",
    "--training.seq_len=128",
    "--training.local_batch_size=4",
    "--validation.freq=3",
    "--validation.steps=1",
    "--metrics.progress_bar=false",
    "--metrics.log_freq=1",
    "--data.max_files=20",
    "--training.steps=6",
    "--training.device=cuda",
]


@pytest.mark.parametrize(
    "mode",
    [[], ["--compile.enable"], ["--compile.enable", "--compile.whole_model", "--training.cuda_graph"]],
    ids=["eager", "compile", "compile_full+graph"],
)
@pytest.mark.parametrize(
    "mx", [[], ["--model.converters=mx", "--mx.recipe_name=mxfp8_rceil"]], ids=["bf16", "mx"]
)
def test_gpu_train_runs_and_learns(tmp_path, mx, mode):
    argv = TINY_GPU + mx + mode + [f"--job.dump_folder={tmp_path}"]
    assert trainer.main(argv) == 0
    recs = [json.loads(x) for x in (Path(tmp_path) / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == list(range(1, 7))
    assert recs[-1]["loss"] < recs[0]["loss"] and recs[-1]["memory_gib"] > 0
    assert "val_loss" in recs[2] and "val_loss" in recs[5]


def test_gpu_periodic_checkpoint_resume_and_validation_sample(tmp_path):
    """On CUDA: training goes on after a periodic save (manifest hashed), a resume from it verifies
    and continues (close to the uninterrupted run: index_add atomics make GPU runs inexact), and the
    validation records carry the sample's token count."""
    full, part = tmp_path / "full", tmp_path / "part"
    common = TINY_GPU + ["--model.converters=mx", "--checkpoint.keep_latest_k=0"]
    assert trainer.main(common + [f"--job.dump_folder={full}", f"--checkpoint.folder={full}/ckpt",
                                  "--checkpoint.interval=3"]) == 0
    (part / "ckpt").mkdir(parents=True)
    shutil.copytree(full / "ckpt" / "step-00000003", part / "ckpt" / "step-00000003")
    assert trainer.main(common + [f"--job.dump_folder={part}", f"--checkpoint.folder={part}/ckpt"]) == 0
    ref = [json.loads(x) for x in (full / "metrics.jsonl").read_text().splitlines()]
    got = [json.loads(x) for x in (part / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in got] == [4, 5, 6]
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in ref[3:]], rel=1e-2)
    assert ref[2]["val_tokens"] == 4 * 128 and got[-1]["val_tokens"] == 4 * 128
