"""`mxmoe train` refuses, at start and naming the option, the rank or the file, what used to run
silently wrong or fail late: ranks resolving the checkpoint folder or reading file contents apart, a
key given twice, sizes no memory holds, the native MX GEMM where it cannot run, a trace folder that
cannot be written; one data file is never both splits; Ctrl-C saves and stops as SIGTERM does; the
divergence error says when nothing was saved yet."""

import os
import signal
from pathlib import Path

import pytest
import torch
from conftest import spawn_ranks
from test_config import _rank_in_its_folder, _rank_with_extra
from test_trainer import TINY, losses, signal_after_three_steps

from mxmoe.train import trainer
from mxmoe.train.checkpoint import Checkpointer
from mxmoe.train.config import parse_args
from mxmoe.train.data import file_hash, load_corpus

REPO = Path(__file__).parents[2]


def test_ranks_resolving_the_checkpoint_folder_apart_stop_at_start(tmp_path):
    """A relative checkpoint.folder from two working folders: both ranks stop before training,
    naming the folder each resolved (the only save once failed at the end of the run)."""
    for r in range(2):
        (tmp_path / f"cwd{r}").mkdir()
    argv = TINY + ["--training.steps=2", "--checkpoint.folder=ck", f"--job.dump_folder={tmp_path}/run"]
    spawn_ranks(_rank_in_its_folder, 2, argv, str(tmp_path))
    for r in range(2):
        assert (tmp_path / f"rc{r}").read_text() == "2"
        err = (tmp_path / f"err{r}").read_text()
        assert "the ranks resolve checkpoint.folder='ck' to different folders" in err, err
        assert f"rank 0: {tmp_path / 'cwd0' / 'ck'}; rank 1: {tmp_path / 'cwd1' / 'ck'}" in err, err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_ranks_reading_files_of_other_contents_stop_naming_them(tmp_path):
    """The same file names and sizes on both ranks, other bytes: both stop at start (the corpus
    identity was names and sizes only)."""
    for r in range(2):
        data = tmp_path / f"cwd{r}" / "data"
        data.mkdir(parents=True)
        for i in range(6):
            (data / f"m{i}.py").write_text(f"# file {i}\n" + ("a = 1\n" if r == 0 else "b = 2\n") * 40)
    argv = TINY + ["--training.steps=2", "--data.path=data", f"--job.dump_folder={tmp_path}/run"]
    spawn_ranks(_rank_in_its_folder, 2, argv, str(tmp_path))
    for r in range(2):
        assert (tmp_path / f"rc{r}").read_text() == "2"
        err = (tmp_path / f"err{r}").read_text()
        assert "the ranks read different data for data.path='data' (files of the same names and sizes, " \
            "other contents)" in err, err
        assert ", contents " in err, err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_ranks_with_the_same_files_still_train(tmp_path):
    """The content check passes ranks that read the same bytes (an absolute data.path)."""
    data = tmp_path / "data"
    data.mkdir()
    for i in range(6):
        (data / f"m{i}.py").write_text(f"# file {i}\n" + "a = 1\n" * 40)
    argv = TINY + ["--training.steps=1", f"--data.path={data}", f"--job.dump_folder={tmp_path}/run"]
    spawn_ranks(_rank_with_extra, 2, argv, [], str(tmp_path))
    assert [(tmp_path / f"rc{r}").read_text() for r in range(2)] == ["0", "0"]


@pytest.mark.parametrize(
    "argv, shown, last",
    [
        (["--training.steps=3", "--training.steps=4"], "('--training.steps=3' and '--training.steps=4')", 4),
        (["--training.steps", "5", "--training.steps=6"], "('--training.steps 5' and "
         "'--training.steps=6')", 6),
    ],
)
def test_a_key_given_twice_is_said_naming_both(argv, shown, last, capsys):
    """A repeated key takes the last value, as before (a base list of options with overrides after
    it is common), but no longer silently: a warning names both arguments."""
    assert parse_args(argv).training.steps == last
    err = capsys.readouterr().err
    assert f"mxmoe WARNING: --training.steps is given twice {shown}: the last applies" in err, err
    assert parse_args(argv[:-1]) is not None
    assert "given twice" not in capsys.readouterr().err  # once: nothing said


@pytest.mark.parametrize(
    "opts, message",
    [
        (["--training.seq_len=99999999999999999999"], "training.seq_len=99999999999999999999 needs at least"),
        (["--model.dim=1000000", "--model.n_heads=1"], "model debug_moe (dim 1000000, "),
    ],
)
def test_sizes_no_memory_holds_are_refused_before_building(tmp_path, capsys, opts, message):
    assert trainer.main(TINY + [f"--job.dump_folder={tmp_path}/run", *opts]) == 2
    err = capsys.readouterr().err
    assert message in err and "GiB per rank" in err and "of cpu" in err and "Traceback" not in err, err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_batch_beyond_the_available_memory_is_refused_before_building(tmp_path, capsys, monkeypatch):
    """The memory floor is held against the memory available now (a 100000-sequence batch, whose
    floor was below the host's physical memory, filled 18 GB before it was killed); here the host
    is said to have 1 GiB available, so the test allocates nothing big."""
    from mxmoe.train import build

    monkeypatch.setattr(build, "available_memory_bytes", lambda device: 2**30)
    argv = TINY + ["--training.local_batch_size=50000", f"--job.dump_folder={tmp_path}/run"]
    assert trainer.main(argv) == 2
    err = capsys.readouterr().err
    assert "training.local_batch_size=50000 and training.seq_len=32 needs at least 3.1 GiB" in err, err
    assert "log-softmax 2 x 50000 x 32 x 256 x 4 bytes), more than the 1.0 GiB available of cpu's" in err, err
    assert "Traceback" not in err, err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    cpu = torch.device("cpu")
    monkeypatch.undo()
    assert 0 < build.available_memory_bytes(cpu) <= build.device_memory_bytes(cpu)


@pytest.mark.parametrize("threads", [-1, 2**31])
def test_cpu_threads_out_of_range_is_refused(tmp_path, capsys, threads):
    """2**31 failed in torch.set_num_threads as "Overflow when unpacking long", naming no option."""
    argv = TINY + [f"--training.cpu_threads={threads}", f"--job.dump_folder={tmp_path}/run"]
    assert trainer.main(argv) == 2
    err = capsys.readouterr().err
    assert f"training.cpu_threads={threads}: expected >= 0 (0 = torch's default) and < 2**31" in err, err


def test_more_cpu_threads_than_cpus_is_said(tmp_path, capsys):
    """training.cpu_threads above os.cpu_count() ran silently, its threads taking turns on the CPUs."""
    cpus = os.cpu_count()
    threads = torch.get_num_threads()
    argv = TINY + ["--training.steps=1", f"--training.cpu_threads={cpus + 1}"]
    argv += [f"--job.dump_folder={tmp_path}/run"]
    assert trainer.main(argv) == 0
    err = capsys.readouterr().err
    said = f"mxmoe WARNING: training.cpu_threads={cpus + 1} is more than the {cpus} CPUs of this host"
    assert said in err, err
    assert torch.get_num_threads() == threads  # restored after the run
    assert trainer.main(TINY + ["--training.steps=1", f"--job.dump_folder={tmp_path}/run2"]) == 0
    assert "cpu_threads" not in capsys.readouterr().err  # TINY's 1 thread: nothing said


def test_more_checkpoint_threads_than_cpus_is_said(tmp_path, capsys, monkeypatch):
    """checkpoint.threads=100000 on 2 CPUs saved 100,000 files (most empty) in 48 s where 0 took
    0.1 s, without a word; above the CPUs this process may run on, a warning says so."""
    monkeypatch.setattr(trainer, "process_cpus", lambda: 1)
    argv = TINY + [f"--job.dump_folder={tmp_path}/run", f"--checkpoint.folder={tmp_path}/ck"]
    assert trainer.main(argv + ["--checkpoint.threads=2", "--training.steps=1"]) == 0
    err = capsys.readouterr().err
    assert "mxmoe WARNING: checkpoint.threads=2 is more than the 1 CPUs this process may run on" in err, err
    assert trainer.main(argv + ["--checkpoint.threads=1", "--training.steps=2"]) == 0
    assert "more than the 1 CPUs" not in capsys.readouterr().err


@pytest.mark.parametrize("folder", ["", " "])
def test_an_empty_dump_folder_is_refused(tmp_path, capsys, monkeypatch, folder):
    """job.dump_folder='' ran in the working folder (its lock, config.json and metrics.jsonl there),
    without a word: an empty checkpoint.folder means none, an empty dump folder did not."""
    monkeypatch.chdir(tmp_path)
    assert trainer.main(TINY + ["--training.steps=1", f"--job.dump_folder={folder}"]) == 2
    err = capsys.readouterr().err
    assert f"job.dump_folder={folder!r}: expected the run's folder" in err, err
    assert "--job.dump_folder=. for the working folder" in err, err
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("which", ["job.dump_folder", "checkpoint.folder"])
def test_a_file_given_as_a_folder_is_named(tmp_path, capsys, which):
    """A file where a folder goes was "job.dump_folder=...: cannot lock it for this run: [Errno 17]
    File exists", naming the dump folder even when the checkpoint folder was the file."""
    f = tmp_path / "a_file"
    f.write_text("not a folder")
    folders = {"job.dump_folder": f"{tmp_path}/run", "checkpoint.folder": f"{tmp_path}/ckpt", which: str(f)}
    argv = TINY + ["--training.steps=1"] + [f"--{k}={v}" for k, v in folders.items()]
    assert trainer.main(argv) == 2
    err = capsys.readouterr().err
    assert f"{which}='{f}' is a file, not a folder" in err, err
    assert f.read_text() == "not a folder" and "Traceback" not in err


def test_native_gemm_on_a_cpu_is_refused_at_start(tmp_path, capsys):
    argv = TINY + ["--model.converters=mx", "--mx.gemm_backend=native", f"--job.dump_folder={tmp_path}/run"]
    assert trainer.main(argv) == 2
    err = capsys.readouterr().err
    assert "mx.gemm_backend='native' needs a CUDA device of compute capability 10.x" in err, err
    assert "got a cpu device; use 'auto' or 'emulated'" in err, err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_the_symmetric_memory_exchange_on_cpu_is_refused_at_start(tmp_path):
    """2 gloo ranks, ep = 2, mx.a2a_transport='symm' on CPU: each rank stops before building, naming
    the option and the fix (it failed at the first exchange as a broken connection: 'check the
    network', its message naming NCCL passed for a process-group failure)."""
    argv = TINY + ["--model.converters=mx", "--parallelism.expert_parallel_degree=2"]
    argv += ["--mx.a2a_transport=symm", f"--job.dump_folder={tmp_path}/run"]
    spawn_ranks(_rank_with_extra, 2, argv, [], str(tmp_path), timeout_s=120)
    for r in range(2):
        err = (tmp_path / f"err{r}").read_text()
        assert (tmp_path / f"rc{r}").read_text() == "2", err
        assert "mx.a2a_transport='symm'" in err and "training.device='cpu'" in err, err
        assert "use 'auto' or 'nccl'" in err and "collective" not in err, err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_an_error_naming_nccl_is_no_collective_failure():
    from mxmoe.train import parallel

    refusal = RuntimeError("transport='symm' needs CUDA tensors, an NCCL process group of GPUs on one host")
    assert not parallel.is_collective_failure(refusal)
    assert parallel.is_collective_failure(RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled"))


def test_an_unwritable_trace_folder_is_refused_at_start(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    argv = TINY + [
        f"--job.dump_folder={tmp_path}/run",
        "--profiling.enable_profiling",
        f"--profiling.save_traces_folder={tmp_path}/file/traces",
    ]
    assert trainer.main(argv) == 2
    err = capsys.readouterr().err
    assert f"profiling.save_traces_folder='{tmp_path}/file/traces': cannot write traces" in err, err
    assert "Traceback" not in err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def _one_split_corpus(folder: Path) -> Path:
    """Files whose names all hash at or above 0.05: with data.val_fraction=0.05 no file is held out."""
    folder.mkdir()
    names = [n for n in (f"m{i}.py" for i in range(100)) if file_hash(n) >= 0.05][:6]
    for i, n in enumerate(names):
        (folder / n).write_text(f"# file {i}\n" + "x = 1\n" * (30 + i))
    return folder


@pytest.mark.parametrize("max_files", [1, 2])
def test_max_files_leaving_one_file_splits_it_by_bytes(tmp_path, max_files):
    """data.max_files=1 (or 2) once validated on the training file itself: now its last
    val_fraction of bytes is validation, as for a one-file corpus."""
    data = _one_split_corpus(tmp_path / "data")
    c = load_corpus(str(data), 0.05, max_files, [".py"])
    assert c.identity["files"] == 1
    sizes = sorted(p.stat().st_size for p in data.iterdir())
    total = c.train.numel() + c.val.numel()
    assert total - 1 in sizes  # one file and its EOS, split: no byte in both
    assert c.val.numel() == total - int(total * 0.95) > 0


def test_the_divergence_error_says_no_checkpoint_was_saved_yet(tmp_path, capsys):
    args = ["--optimizer.lr=1e30", "--lr_scheduler.warmup_steps=0", "--training.steps=4"]
    argv = TINY + [f"--job.dump_folder={tmp_path}/run", f"--checkpoint.folder={tmp_path}/ckpt", *args]
    assert trainer.main(argv) == 1
    err = capsys.readouterr().err
    assert "step 2: non-finite" in err and f"no checkpoint in {tmp_path}/ckpt yet" in err, err
    assert "None" not in err and "Lower optimizer.lr or training.max_norm" in err


def test_a_router_bias_that_overflows_stops_the_run_before_it_is_saved(tmp_path, capsys):
    """load_balance=bias moves expert_bias outside the optimizer: at a rate of 2e38 it reaches inf
    at the 2nd update, past the loss and gradient checks; the run once finished "done" and saved
    inf biases. It stops at that step, before the save, naming the option."""
    # 8 experts, top 2: experts left out twice running get +2e38 twice (+inf)
    args = ["--model.num_experts=8", "--model.load_balance=bias", "--model.bias_update_rate=2e38"]
    args += ["--training.steps=4"]
    args += [f"--job.dump_folder={tmp_path}/run", f"--checkpoint.folder={tmp_path}/ckpt"]
    assert trainer.main(TINY + args + ["--checkpoint.interval=1"]) == 1
    err = capsys.readouterr().err
    want = "step 2: a router's expert_bias is not finite after the bias update (model.bias_update_rate=2e+38)"
    assert want in err and "Traceback" not in err, err
    assert f"the last checkpoint is {tmp_path}/ckpt/step-00000001. Lower model.bias_update_rate" in err
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("step-*")) == ["step-00000001"]
    # checked where the loop syncs anyway (a record) or must (before a save), not after every step:
    # saves every 4 steps, records every 3 -> checked at step 3, which names the steps since the last
    ckpt = tmp_path / "ckpt4"
    args = args[:3] + ["--training.steps=8", f"--job.dump_folder={tmp_path}/run4"]
    args += [f"--checkpoint.folder={ckpt}", "--checkpoint.interval=4", "--metrics.log_freq=3"]
    assert trainer.main(TINY + args) == 1
    err = capsys.readouterr().err
    assert "step 3: a router's expert_bias is not finite after the bias update of one of steps 1-3" in err
    assert not list(ckpt.glob("step-*"))


def test_the_divergence_error_without_clipping_does_not_say_lower_max_norm(tmp_path, capsys):
    """training.max_norm=0 (no clipping): the advice was "lower training.max_norm", below 0."""
    args = ["--optimizer.lr=1e30", "--lr_scheduler.warmup_steps=0", "--training.steps=4"]
    args += ["--training.max_norm=0"]
    assert trainer.main(TINY + [f"--job.dump_folder={tmp_path}/run", *args]) == 1
    err = capsys.readouterr().err
    assert "Lower optimizer.lr or turn clipping on (training.max_norm=0 is off)" in err, err


def test_the_divergence_error_of_a_huge_aux_loss_coef_names_it(tmp_path, capsys):
    """model.aux_loss_coef=1e38: the gradients overflow at step 1; the error says to lower the
    coefficient, whose term outweighs the LM loss (it advised only optimizer.lr and max_norm)."""
    argv = TINY + ["--training.steps=2", "--model.aux_loss_coef=1e38", f"--job.dump_folder={tmp_path}/run"]
    assert trainer.main(argv) == 1
    err = capsys.readouterr().err
    assert "step 1: non-finite" in err and "Lower model.aux_loss_coef (1e+38: its term, " in err, err
    assert "outweighs the LM loss" in err and "else lower optimizer.lr or training.max_norm" in err, err


def test_ctrl_c_saves_and_stops_with_one_line(tmp_path):
    """SIGINT (Ctrl-C) finishes the step, saves it and exits 130 with one warning line, no
    traceback (a KeyboardInterrupt traceback once lost the steps since the last checkpoint)."""
    run = tmp_path / "run"
    rc, err = signal_after_three_steps(run, 1000, signal.SIGINT)
    assert rc == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert err.strip().splitlines()[-1].startswith("mxmoe WARNING: Ctrl-C: stopped after step"), err
    last = max(losses(run))
    assert Checkpointer(str(run / "ckpt")).latest() == run / "ckpt" / f"step-{last:08d}"
