"""`--debug.deterministic=true` on CPU: two runs of the same config and seed give the same loss
bits (high precision and MX, one process and expert parallel over 2 gloo ranks); the mode's
settings are made for the run and restored after it. The GPU versions (`pytest -m gpu`) are at the
end: each compile mode, bf16 and MX, and ep = 2 on 2 GPUs."""

import json
import os
import random
from pathlib import Path

import pytest
import torch
from conftest import spawn_ranks, trainer_rank

from mxmoe.train import determinism, trainer

REPO = Path(__file__).parents[2]
# debug_moe (MX converter) made tiny: a few seconds a run on one CPU thread
DEBUG = [
    "--config=debug_moe",
    "--model.dim=32",
    "--model.n_heads=2",
    "--model.n_layers=1",
    "--model.num_experts=4",
    "--model.moe_hidden_dim=32",
    "--training.steps=4",
    "--training.seq_len=32",
    "--training.local_batch_size=2",
    "--lr_scheduler.warmup_steps=2",
    "--validation.freq=4",
    "--validation.steps=1",
    "--training.device=cpu",
    "--training.cpu_threads=1",
    "--debug.deterministic=true",
    "--data.max_files=6",
    "--checkpoint.folder=",
    "--metrics.log_freq=1",
    "--metrics.progress_bar=false",
    "--mx.mxfp8_dim1_cast_kernel_choice=torch",
]
KEYS = ("loss", "aux_loss", "grad_norm", "val_loss")


def records(folder) -> list[dict]:
    return [json.loads(x) for x in (Path(folder) / "metrics.jsonl").read_text().splitlines()]


def bits(folder) -> list[tuple]:
    """Per logged step: the step and the exact bits (float.hex) of its losses and gradient norm."""
    return [(r["step"], *(float(r[k]).hex() for k in KEYS if k in r)) for r in records(folder)]


@pytest.mark.parametrize("converters", ["", "mx"])
def test_two_runs_give_the_same_loss_bits(tmp_path, converters):
    argv = DEBUG + [f"--model.converters={converters}"]
    runs = [tmp_path / "a", tmp_path / "b", tmp_path / "seed1"]
    for run, seed in zip(runs, (0, 0, 1), strict=True):
        assert trainer.main(argv + [f"--job.dump_folder={run}", f"--debug.seed={seed}"]) == 0
        # the mode covered the run only
        assert not torch.are_deterministic_algorithms_enabled()
    a, b, other = (bits(r) for r in runs)
    assert [x[0] for x in a] == [1, 2, 3, 4] and len(a[-1]) == 1 + len(KEYS)  # val_loss at step 4
    assert a == b
    assert len({x[1] for x in a}) == 4  # the losses move: the comparison is not of constants
    assert all(x[1:] != y[1:] for x, y in zip(a, other, strict=True))  # and another seed changes every step
    assert json.loads((runs[0] / "config.json").read_text())["debug"]["deterministic"] is True


def test_deterministic_mode_sets_and_restores_torch(monkeypatch):
    import torch._inductor.config as inductor_config

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    cudnn = torch.backends.cudnn

    def state():
        fill = torch.utils.deterministic.fill_uninitialized_memory
        return cudnn.deterministic, cudnn.benchmark, inductor_config.deterministic, fill

    before = state()
    assert not torch.are_deterministic_algorithms_enabled()
    with determinism.deterministic_mode():
        assert torch.are_deterministic_algorithms_enabled()
        assert not torch.is_deterministic_algorithms_warn_only_enabled()
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
        assert inductor_config.deterministic
        # no NaN fill of every new buffer: a write pass and a launch per allocation, which the
        # casts' outputs do not need (every element written)
        assert not torch.utils.deterministic.fill_uninitialized_memory
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert not torch.are_deterministic_algorithms_enabled()
    assert state() == before
    # a value the user set is kept; the mode is also undone when the run raises
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    with pytest.raises(RuntimeError, match="boom"), determinism.deterministic_mode():
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
        raise RuntimeError("boom")
    assert not torch.are_deterministic_algorithms_enabled()
    with determinism.deterministic_mode(False):
        assert not torch.are_deterministic_algorithms_enabled()


def test_seed_everything_seeds_python_numpy_and_torch():
    np = pytest.importorskip("numpy")

    def draw():
        return random.random(), float(np.random.rand()), torch.rand(3).tolist()

    determinism.seed_everything(7)
    first = draw()
    determinism.seed_everything(7)
    assert draw() == first
    determinism.seed_everything(8)
    assert draw() != first




def test_two_expert_parallel_runs_give_the_same_loss_bits(tmp_path):
    """ep=2 over 2 gloo ranks, MX experts (MXFP8 all-to-all), twice: the same bits."""
    runs = [tmp_path / "a", tmp_path / "b"]
    for run in runs:
        run.mkdir()
        argv = DEBUG + [
            "--parallelism.expert_parallel_degree=2",
            "--parallelism.timeout_s=60",
            "--training.steps=3",
            "--validation.freq=3",
            f"--job.dump_folder={run}",
        ]
        spawn_ranks(trainer_rank, 2, argv, str(run))
        assert [(run / f"rc{r}").read_text() for r in range(2)] == ["0", "0"]
    a, b = bits(runs[0]), bits(runs[1])
    assert [x[0] for x in a] == [1, 2, 3] and len(a[-1]) == 1 + len(KEYS)
    assert a == b


# On a GPU (`pytest -m gpu tests/train/test_determinism.py`): each run in its own process, as a
# user would start them, so nothing (autotuning results, compiled kernels in memory) is shared
# but what torch and Triton cache on disk.
TINY_GPU = [
    "--model.dim=128",
    "--model.n_heads=4",
    "--model.n_layers=2",
    "--model.num_experts=8",
    "--model.top_k=2",
    "--model.moe_hidden_dim=128",
    "--training.seq_len=128",
    "--training.local_batch_size=4",
    "--training.steps=6",
    "--validation.freq=6",
    "--validation.steps=2",
    "--debug.deterministic=true",
    "--training.device=cuda",
    "--data.max_files=20",
    "--metrics.log_freq=1",
    "--metrics.progress_bar=false",
]


def _run_process(argv: list[str], nproc: int = 1) -> None:
    import subprocess
    import sys

    launch = [sys.executable, "-m", "mxmoe", "train"]
    if nproc > 1:
        launch = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        launch += [f"--nproc_per_node={nproc}", "-m", "mxmoe", "train"]
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(launch + argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "mode",
    [[], ["--compile.enable"], ["--compile.enable", "--compile.whole_model", "--training.cuda_graph"]],
    ids=["eager", "compile", "compile_full+graph"],
)
@pytest.mark.parametrize("mx", [[], ["--model.converters=mx"]], ids=["bf16", "mx"])
def test_gpu_two_runs_give_the_same_loss_bits(tmp_path, mx, mode):
    runs = [tmp_path / "a", tmp_path / "b"]
    for run in runs:
        _run_process(TINY_GPU + mx + mode + [f"--job.dump_folder={run}"])
    a, b = bits(runs[0]), bits(runs[1])
    assert [x[0] for x in a] == list(range(1, 7)) and len(a[-1]) == 1 + len(KEYS)
    assert a == b


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("mx", [[], ["--model.converters=mx"]], ids=["bf16", "mx"])
def test_gpu_two_expert_parallel_runs_give_the_same_loss_bits(tmp_path, mx):
    runs = [tmp_path / "a", tmp_path / "b"]
    for run in runs:
        argv = TINY_GPU + mx + ["--parallelism.expert_parallel_degree=2", f"--job.dump_folder={run}"]
        _run_process(argv, nproc=2)
    a, b = bits(runs[0]), bits(runs[1])
    assert [x[0] for x in a] == list(range(1, 7)) and len(a[-1]) == 1 + len(KEYS)
    assert a == b
