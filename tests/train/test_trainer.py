"""End-to-end trainer runs on CPU: resume exactness, SIGTERM, TP refusal, 2-process FSDP2 + EP with MX."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import spawn_ranks, trainer_rank

from mxmoe.train import trainer
from mxmoe.train.checkpoint import Checkpointer, CheckpointError

REPO = Path(__file__).parents[2]
TINY = [
    "--model.dim=32",
    "--model.n_heads=2",
    "--model.n_layers=1",
    "--model.num_experts=4",
    "--model.top_k=2",
    "--model.moe_hidden_dim=32",
    "--training.seq_len=32",
    "--training.local_batch_size=2",
    "--lr_scheduler.warmup_steps=2",
    "--validation.freq=0",
    "--metrics.progress_bar=false",
    "--metrics.log_freq=1",
    "--metrics.enable_tensorboard=false",
    "--data.max_files=6",
    "--training.cpu_threads=1",
    "--training.device=cpu",  # CPU tests, also on a GPU host (the GPU's are in test_gpu.py)
]
MX = ["--model.converters=mx", "--mx.mxfp8_dim1_cast_kernel_choice=torch"]


def two_step_checkpoint(tmp: Path) -> Path:
    """The checkpoint folder of a TINY 2-step run in `tmp` (step 2 saved)."""
    argv = TINY + ["--training.steps=2", f"--job.dump_folder={tmp}/run", f"--checkpoint.folder={tmp}/ckpt"]
    assert trainer.main(argv) == 0
    return tmp / "ckpt"


def losses(folder) -> dict[int, float]:
    lines = (Path(folder) / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines)}


def test_resume_reproduces_losses_exactly(tmp_path):
    common = TINY + MX + ["--model.load_balance=bias", "--training.steps=6", "--checkpoint.keep_latest_k=0"]
    full = tmp_path / "full"
    assert (
        trainer.main(
            common
            + [f"--job.dump_folder={full}", f"--checkpoint.folder={full}/ckpt", "--checkpoint.interval=3"]
        )
        == 0
    )
    ref = losses(full)
    assert sorted(ref) == list(range(1, 7))
    # the logged lr is the one the step used: lr_lambda(steps taken before it) x optimizer.lr
    lam = trainer.lr_lambda(trainer.parse_args(common))
    recs = [json.loads(x) for x in (full / "metrics.jsonl").read_text().splitlines()]
    assert [r["lr"] for r in recs] == pytest.approx([3e-3 * lam(r["step"] - 1) for r in recs], rel=1e-12)
    assert recs[0]["lr"] == pytest.approx(1.5e-3)  # warmup_steps=2: half the peak on step 1
    assert (full / "ckpt" / "step-00000003").is_dir() and (full / "ckpt" / "step-00000006").is_dir()
    # a run interrupted after step 3: its folder holds only the step-3 checkpoint
    part = tmp_path / "part"
    (part / "ckpt").mkdir(parents=True)
    shutil.copytree(full / "ckpt" / "step-00000003", part / "ckpt" / "step-00000003")
    assert trainer.main(common + [f"--job.dump_folder={part}", f"--checkpoint.folder={part}/ckpt"]) == 0
    got = losses(part)
    assert sorted(got) == [4, 5, 6]
    assert all(got[s] == ref[s] for s in (4, 5, 6)), (got, ref)


def test_an_interrupted_save_is_ignored_and_an_incomplete_step_folder_is_an_error(tmp_path):
    ck = tmp_path / "ckpt"
    (ck / "step-00000004").mkdir(parents=True)
    (ck / "step-00000004" / ".metadata").write_bytes(b"x")
    (ck / "step-00000008.tmp").mkdir()  # interrupted save: not a checkpoint
    (ck / "step-00000008.tmp" / ".metadata").write_bytes(b"x")
    assert Checkpointer(str(ck)).latest() == ck / "step-00000004"
    (ck / "step-00000009").mkdir()  # a final name without its files: reported, never skipped
    assert Checkpointer(str(ck)).latest() == ck / "step-00000009"
    with pytest.raises(CheckpointError, match="step-00000009 is incomplete: it has no manifest.json"):
        Checkpointer(str(ck)).resume_path()


def signal_after_three_steps(
    run: Path, interval: int, sig: int, extra: tuple = (), ready=None
) -> tuple[int, str]:
    """`mxmoe train` (TINY, checkpoints every `interval` steps under run/ckpt, then `extra`) in a
    subprocess, sent `sig` once it has logged 3 steps (or once `ready()`): (its exit status, its stderr)."""
    argv = TINY + [
        f"--job.dump_folder={run}",
        f"--checkpoint.folder={run}/ckpt",
        f"--checkpoint.interval={interval}",
        "--training.steps=100000",
        *extra,
    ]
    metrics = run / "metrics.jsonl"
    ready = ready or (lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 3)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen(
        [sys.executable, "-m", "mxmoe", "train", *argv], cwd=REPO, env=env, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 120
        while not ready():
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, "training did not log 3 steps in 120 s"
            time.sleep(0.2)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, err


def test_sigterm_stops_cleanly_with_loadable_checkpoint(tmp_path):
    run = tmp_path / "run"
    rc, err = signal_after_three_steps(run, 2, signal.SIGTERM)
    assert rc == 0, err
    assert "SIGTERM: stopped after step" in err
    last = max(losses(run))
    ck = Checkpointer(str(run / "ckpt"))
    assert ck.latest() == run / "ckpt" / f"step-{last:08d}"
    assert not list((run / "ckpt").glob("*.tmp"))
    # loadable: a resumed run continues from exactly that step
    assert (
        trainer.main(
            TINY
            + [
                f"--job.dump_folder={run}/resumed",
                f"--checkpoint.folder={run}/ckpt",
                f"--training.steps={last + 1}",
            ]
        )
        == 0
    )
    assert sorted(losses(run / "resumed")) == [last + 1]


def test_a_stop_records_the_losses_of_the_steps_since_the_last_record(tmp_path):
    """SIGTERM between two records (metrics.log_freq=1000): the steps since the last record are the
    checkpoint's, so their mean loss is recorded at the step the run stopped after (it was dropped:
    metrics.jsonl lacked those steps, and the resumed run's records began after them)."""
    run = tmp_path / "run"
    saved = lambda: any((run / "ckpt").glob("step-0*"))  # noqa: E731
    rc, err = signal_after_three_steps(run, 3, signal.SIGTERM, ("--metrics.log_freq=1000",), saved)
    assert rc == 0, err
    last = Checkpointer(str(run / "ckpt")).latest()
    step = int(last.name.split("-")[1])
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss_steps"]) for r in recs] == [(step, step)], recs
    argv = TINY + [f"--job.dump_folder={run}", f"--checkpoint.folder={run}/ckpt", "--metrics.log_freq=1000"]
    assert trainer.main(argv + [f"--training.steps={step + 2}"]) == 0
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss_steps"]) for r in recs] == [(step, step), (step + 2, 2)], recs


def test_tensor_parallel_with_mx_is_refused_by_the_converter(tmp_path, capsys):
    rc = trainer.main(TINY + MX + ["--parallelism.tensor_parallel_degree=2", f"--job.dump_folder={tmp_path}"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "tensor parallelism with MX is not supported" in err and "tp=2" in err
    assert not (tmp_path / "metrics.jsonl").exists()




def test_two_process_fsdp_ep_mx_matches_one_process(tmp_path):
    """ep=2 over 2 gloo ranks (batch 2 each) vs one process (batch 4): same data, same losses."""
    common = TINY + MX + ["--training.steps=2", "--parallelism.timeout_s=60"]
    dist_run, one_run = tmp_path / "ep2", tmp_path / "one"
    argv = common + [
        "--parallelism.expert_parallel_degree=2",
        f"--job.dump_folder={dist_run}",
        f"--checkpoint.folder={dist_run}/ckpt",
    ]
    spawn_ranks(trainer_rank, 2, argv, str(tmp_path))
    assert [(tmp_path / f"rc{r}").read_text() for r in range(2)] == ["0", "0"]
    assert trainer.main(common + ["--training.local_batch_size=4", f"--job.dump_folder={one_run}"]) == 0
    d, o = losses(dist_run), losses(one_run)
    assert sorted(d) == sorted(o) == [1, 2]
    assert d[1] == pytest.approx(o[1], rel=1e-5) and d[2] == pytest.approx(o[2], rel=1e-4)
    assert o[2] != o[1]
    # experts were sharded (2 of 4 per rank) and are saved whole
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(dist_run / "ckpt" / "step-00000002")).read_metadata().state_dict_metadata
    assert tuple(meta["model.layers.0.moe.experts.w1"].size) == (4, 32, 32)
    # the EP-sharded checkpoint loads into one process and continues
    shutil.copytree(dist_run / "ckpt", one_run / "ckpt")
    assert (
        trainer.main(
            common
            + [
                "--training.local_batch_size=4",
                "--training.steps=3",
                f"--job.dump_folder={one_run}/resumed",
                f"--checkpoint.folder={one_run}/ckpt",
            ]
        )
        == 0
    )
    assert sorted(losses(one_run / "resumed")) == [3]


def test_two_process_ep_exchange_only_matches_one_process(tmp_path):
    """--mx.expert_gemm=bf16 --mx.convert_linears=false (the exchange only: bf16 GEMMs everywhere,
    MXFP8 dispatch and combine gradient) at ep=2 against one process, where the experts round their
    rows and output gradient as the exchange does: the same losses."""
    common = TINY + MX + ["--mx.expert_gemm=bf16", "--mx.convert_linears=false", "--training.steps=2",
                          "--parallelism.timeout_s=60"]
    dist_run, one_run = tmp_path / "ep2", tmp_path / "one"
    argv = common + ["--parallelism.expert_parallel_degree=2", f"--job.dump_folder={dist_run}"]
    spawn_ranks(trainer_rank, 2, argv, str(tmp_path))
    assert [(tmp_path / f"rc{r}").read_text() for r in range(2)] == ["0", "0"]
    said = [x for x in (tmp_path / "stdout0").read_text().splitlines() if "expert parallelism over" in x]
    assert len(said) == 1 and "over 2 ranks, transport 'auto': the dispatch and the combine's gradient " \
        "send MXFP8 rows (e4m3 elements + e8m0 scales per 32, RCEIL)" in said[0], said
    assert trainer.main(common + ["--training.local_batch_size=4", f"--job.dump_folder={one_run}"]) == 0
    d, o = losses(dist_run), losses(one_run)
    assert sorted(d) == sorted(o) == [1, 2] and o[2] != o[1]
    assert d[1] == pytest.approx(o[1], rel=1e-5) and d[2] == pytest.approx(o[2], rel=1e-4)


def test_two_process_ep_bf16_exchange_resumes_from_one_process_checkpoint(tmp_path):
    """High-precision experts (a2a_unquantized exchange): a one-process checkpoint loads into ep=2 and
    the resumed step's loss matches the uninterrupted one-process run."""
    common = TINY + ["--training.steps=2", "--parallelism.timeout_s=60", "--checkpoint.keep_latest_k=0"]
    one_run, ep_run = tmp_path / "one", tmp_path / "ep2"
    assert (
        trainer.main(
            common
            + [
                "--training.local_batch_size=4",
                f"--job.dump_folder={one_run}",
                f"--checkpoint.folder={one_run}/ckpt",
            ]
            + ["--checkpoint.interval=1"]
        )
        == 0
    )
    (ep_run / "ckpt").mkdir(parents=True)
    shutil.copytree(one_run / "ckpt" / "step-00000001", ep_run / "ckpt" / "step-00000001")
    argv = common + [
        "--parallelism.expert_parallel_degree=2",
        f"--job.dump_folder={ep_run}",
        f"--checkpoint.folder={ep_run}/ckpt",
    ]
    spawn_ranks(trainer_rank, 2, argv, str(tmp_path))
    assert [(tmp_path / f"rc{r}").read_text() for r in range(2)] == ["0", "0"]
    o, d = losses(one_run), losses(ep_run)
    assert sorted(d) == [2]
    assert d[2] == pytest.approx(o[2], rel=1e-4)


def test_profiling_writes_a_trace_and_an_operator_table(tmp_path):
    run = tmp_path / "run"
    args = TINY + MX + ["--training.steps=5", f"--job.dump_folder={run}", "--profiling.enable_profiling"]
    assert trainer.main(args + ["--profiling.profile_freq=3", "--profiling.profiler_active=2"]) == 0
    # steps 1..3 form one cycle: step 1 warms up, steps 2-3 are recorded; profile_repeat=1 stops there
    traces = sorted(p.name for p in (run / "profile_traces").iterdir())
    assert traces == ["rank0_step00000003.json", "rank0_step00000003.txt"]
    trace = json.loads((run / "profile_traces" / traces[0]).read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    # the profiler counts steps from 0: our steps 2 and 3 are its #1 and #2
    assert "mxmoe::qdq" in names and "ProfilerStep#1" in names and "ProfilerStep#2" in names
    assert "ProfilerStep#0" not in names
    table = (run / "profile_traces" / traces[1]).read_text()
    assert "aten::mm" in table and "Self CPU" in table


@pytest.mark.parametrize(
    "opt, message",
    [
        ("--profiling.profiler_active=10", r"profiling.profiler_active=10: expected 1 .. profile_freq - 1"),
        ("--profiling.profile_freq=1", r"profiling.profile_freq=1: expected >= 2"),
        ("--profiling.profile_repeat=-1", r"profiling.profile_repeat=-1: expected >= 0"),
    ],
)
def test_profiling_settings_are_checked(tmp_path, capsys, opt, message):
    args = TINY + ["--training.steps=1", f"--job.dump_folder={tmp_path}", "--profiling.enable_profiling", opt]
    assert trainer.main(args) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("converters", [[], MX], ids=["hp", "mx"])
def test_compiled_training_matches_eager(tmp_path, converters):
    """`--compile.enable` (per block; at EP=1 each MoE layer, routed experts included, is one
    graph) and `--compile.whole_model` (the whole model, one graph), high precision and with the
    MX converter, train like eager: same losses and gradient norms, validation (eval, no_grad)
    included (on torch 2.11 a compiled MX op once gave every input a zero gradient).

    Inductor compiles the MX model per block (the trainer's usual mode, whose graphs the FSDP test
    finds in Inductor's cache); the other runs use `aot_eager_decomp_partition`: the same graph
    capture, autograd, decompositions and partition, run by eager kernels instead of Inductor's
    generated C++, whose compiles take most of a compiled CPU run's time (the GPU tests compile with
    Inductor throughout, and the ops' tests compile each MX op with Inductor on CPU too)."""
    common = TINY + converters + ["--training.steps=3", "--validation.freq=3"]
    common += ["--validation.steps=1"]
    decomp = "--compile.backend=aot_eager_decomp_partition"
    runs = {}
    for name, flags in (
        ("eager", []),
        ("compiled", ["--compile.enable=true"] + ([] if converters else [decomp])),
        ("compiled_full", ["--compile.enable", "--compile.whole_model", decomp]),
    ):
        assert trainer.main(common + flags + [f"--job.dump_folder={tmp_path / name}"]) == 0
        recs = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        runs[name] = [(r["loss"], r["grad_norm"]) for r in recs if "grad_norm" in r]
        runs[name + "_val"] = [r["val_loss"] for r in recs if "val_loss" in r]
    for name in ("compiled", "compiled_full"):
        assert all(g > 0 for _, g in runs[name]) and len(runs[name]) == 3
        torch.testing.assert_close(torch.tensor(runs[name]), torch.tensor(runs["eager"]), rtol=1e-4, atol=0)
        assert len(runs[name + "_val"]) == 1
        torch.testing.assert_close(runs[name + "_val"], runs["eager_val"], rtol=1e-4, atol=0)


def test_two_process_fsdp_compiled_mx_matches_one_process_eager(tmp_path):
    """`--compile.enable` under FSDP without expert parallelism (2 gloo ranks, batch 2 each): the
    MoE layers, MX experts included, compile whole inside the FSDP blocks and train like one eager
    process with batch 4: same losses, gradient norms and validation loss."""
    common = TINY + MX + ["--training.steps=2", "--validation.freq=2", "--validation.steps=1"]
    fsdp_run, one_run = tmp_path / "fsdp", tmp_path / "one"
    argv = common + ["--parallelism.timeout_s=60", "--compile.enable=true", f"--job.dump_folder={fsdp_run}"]
    spawn_ranks(trainer_rank, 2, argv, str(tmp_path))
    assert [(tmp_path / f"rc{r}").read_text() for r in range(2)] == ["0", "0"]
    assert trainer.main(common + ["--training.local_batch_size=4", f"--job.dump_folder={one_run}"]) == 0
    runs = []
    for folder in (fsdp_run, one_run):
        recs = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
        runs.append([(r["loss"], r["grad_norm"], r.get("val_loss", 0.0)) for r in recs])
    assert len(runs[0]) == 2 and "val_loss" in recs[-1]
    torch.testing.assert_close(torch.tensor(runs[0]), torch.tensor(runs[1]), rtol=1e-4, atol=0)


def test_whole_model_compile_needs_compile_enable(tmp_path, capsys):
    """compile.whole_model says how compile.enable compiles: without it, a clear error, not eager."""
    args = TINY + ["--training.steps=1", f"--job.dump_folder={tmp_path}", "--compile.whole_model"]
    assert trainer.main(args) == 2
    assert "compile.whole_model=true compiles the whole model in one graph: it needs compile.enable=true" in (
        capsys.readouterr().err
    )


def test_ep_training_continues_past_a_periodic_checkpoint_and_resumes_exactly(tmp_path):
    """EP=2 over 2 gloo ranks: training goes on after a periodic save (the checkpointer once wrapped
    the live optimizer state in DTensors: `aten.lerp_` mixed Tensor and DTensor on the next step),
    and a run resumed from that save logs the uninterrupted run's losses."""
    common = TINY + ["--training.steps=4", "--parallelism.timeout_s=60", "--checkpoint.keep_latest_k=0"]
    common += ["--parallelism.expert_parallel_degree=2"]
    common += ["--validation.freq=2", "--validation.steps=1"]
    full, part = tmp_path / "full", tmp_path / "part"
    argv = common + [f"--job.dump_folder={full}", f"--checkpoint.folder={full}/ckpt"]
    argv += ["--checkpoint.interval=2"]
    spawn_ranks(trainer_rank, 2, argv, str(tmp_path))
    assert [(tmp_path / f"rc{r}").read_text() for r in range(2)] == ["0", "0"]
    ref = losses(full)
    assert sorted(ref) == [1, 2, 3, 4]
    (part / "ckpt").mkdir(parents=True)
    shutil.copytree(full / "ckpt" / "step-00000002", part / "ckpt" / "step-00000002")
    argv = common + [f"--job.dump_folder={part}", f"--checkpoint.folder={part}/ckpt"]
    spawn_ranks(trainer_rank, 2, argv, str(tmp_path))
    assert [(tmp_path / f"rc{r}").read_text() for r in range(2)] == ["0", "0"]
    got = losses(part)
    assert sorted(got) == [3, 4]
    assert got[3] == ref[3] and got[4] == ref[4], (got, ref)
    (val,) = [json.loads(x)["val_loss"] for x in (part / "metrics.jsonl").read_text().splitlines()[1:]]
    ref_val = [json.loads(x).get("val_loss") for x in (full / "metrics.jsonl").read_text().splitlines()]
    assert val == ref_val[3] and ref_val[1] > ref_val[3] > 0
