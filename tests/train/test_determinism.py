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
VAR = "CUBLAS_WORKSPACE_CONFIG"


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


def test_settle_cublas_config_removes_only_its_own_value_on_sm90(monkeypatch):
    """On sm90 torch's default cuBLAS workspace is the size :4096:8 sets, so once torch's check has
    seen the variable (one GEMM) the mode removes the value it set: no GEMM parses it again. The
    GEMM and the GPU are stood in for here; the bits with and without it are the GPU test's."""
    seen = []
    monkeypatch.setattr(determinism, "_first_cublas_gemm", lambda d: seen.append((d, os.environ.get(VAR))))
    capability = [(9, 0)]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability[0])
    monkeypatch.setattr(torch.version, "hip", None)
    cuda = torch.device("cuda", 0)
    monkeypatch.delenv(VAR, raising=False)
    assert not determinism.settle_cublas_config(cuda)  # outside the mode: nothing to settle
    with determinism.deterministic_mode():
        assert not determinism.settle_cublas_config(torch.device("cpu"))
        assert os.environ[VAR] == ":4096:8" and seen == []
        assert determinism.settle_cublas_config(cuda)
        assert seen == [(cuda, ":4096:8")] and VAR not in os.environ  # checked with it, then removed
        assert not determinism.settle_cublas_config(cuda)  # once
        assert torch.are_deterministic_algorithms_enabled()
    assert VAR not in os.environ and not torch.are_deterministic_algorithms_enabled()
    # another GPU (another default workspace size), a value the user set, ROCm: the variable stays
    capability[0] = (8, 0)
    with determinism.deterministic_mode():
        assert not determinism.settle_cublas_config(cuda) and os.environ[VAR] == ":4096:8"
    capability[0] = (9, 0)
    for value in (":4096:8", ":16:8"):
        monkeypatch.setenv(VAR, value)
        with determinism.deterministic_mode():
            assert not determinism.settle_cublas_config(cuda) and os.environ[VAR] == value
    monkeypatch.delenv(VAR)
    monkeypatch.setattr(torch.version, "hip", "6.2")
    with determinism.deterministic_mode():
        assert not determinism.settle_cublas_config(cuda) and os.environ[VAR] == ":4096:8"
    assert len(seen) == 1


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


def _run_process(argv: list[str], nproc: int = 1, cublas_config: str | None = None) -> str:
    """`mxmoe train ARGV` in a new process (torchrun for nproc > 1), CUBLAS_WORKSPACE_CONFIG unset
    or `cublas_config` (the user's value); returns its console output (stdout, then stderr)."""
    import subprocess
    import sys

    launch = [sys.executable, "-m", "mxmoe", "train"]
    if nproc > 1:
        launch = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        launch += [f"--nproc_per_node={nproc}", "-m", "mxmoe", "train"]
    env = {k: v for k, v in os.environ.items() if k != VAR}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")
    if cublas_config is not None:
        env[VAR] = cublas_config
    proc = subprocess.run(launch + argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout + proc.stderr


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
@pytest.mark.parametrize("mx", [[], ["--model.converters=mx"]], ids=["bf16", "mx"])
def test_gpu_same_bits_with_cublas_config_kept_or_removed(tmp_path, mx):
    """The mode removes its CUBLAS_WORKSPACE_CONFIG after torch's check on sm90 (torch's default
    workspace has the same size); the user's :4096:8 stays, and torch parses it at every GEMM. The
    two give the same bits (per-block compile: its GEMMs are aten's, through cuBLAS)."""
    runs = {"removed": tmp_path / "removed", "kept": tmp_path / "kept"}
    said = {}
    for name, run in runs.items():
        argv = TINY_GPU + mx + ["--compile.enable", f"--job.dump_folder={run}"]
        console = _run_process(argv, cublas_config=":4096:8" if name == "kept" else None)
        said[name] = "passed torch's check and is removed" in console
    a, b = bits(runs["removed"]), bits(runs["kept"])
    assert [x[0] for x in a] == list(range(1, 7)) and len(a[-1]) == 1 + len(KEYS)
    assert a == b
    assert said == {"removed": torch.cuda.get_device_capability() == (9, 0), "kept": False}


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
