"""The trainer with `--mx.fsdp_mxfp8_all_gather` (2 gloo ranks): the same losses, bit for bit, as
without it, and checkpoints that resume across the option both ways."""

import shutil
from pathlib import Path

from conftest import spawn_ranks, trainer_rank
from test_trainer import MX, TINY, losses


def test_mxfp8_all_gather_trains_bit_for_bit_and_resumes_across_the_option(tmp_path):
    common = TINY + MX + ["--training.steps=3", "--parallelism.timeout_s=60", "--checkpoint.keep_latest_k=0"]
    common += ["--checkpoint.interval=2"]
    on = ["--mx.fsdp_mxfp8_all_gather=true"]
    runs = {}
    for name, extra in (("mx", on), ("hp", [])):
        folder = tmp_path / name
        spawn_ranks(trainer_rank, 2, common + extra + [f"--job.dump_folder={folder}",
                                                        f"--checkpoint.folder={folder}/ckpt"], str(tmp_path))
        assert [(tmp_path / f"rc{r}").read_text() for r in range(2)] == ["0", "0"]
        runs[name] = losses(folder)
        if name == "mx":  # the conversion log names what gathers MXFP8 (the experts: 4 over 2 ranks)
            out = (tmp_path / "stdout0").read_text()
            assert "fsdp_mxfp8_all_gather: 3 weights gather MXFP8" in out, out
    assert sorted(runs["mx"]) == [1, 2, 3] and runs["mx"] == runs["hp"], runs
    # a checkpoint written with the option resumes without it, and the other way round
    for src, extra in (("mx", []), ("hp", on)):
        part = tmp_path / f"from_{src}"
        (part / "ckpt").mkdir(parents=True)
        shutil.copytree(tmp_path / src / "ckpt" / "step-00000002", part / "ckpt" / "step-00000002")
        spawn_ranks(trainer_rank, 2, common + extra + [f"--job.dump_folder={part}",
                                                        f"--checkpoint.folder={part}/ckpt"], str(tmp_path))
        assert [(tmp_path / f"rc{r}").read_text() for r in range(2)] == ["0", "0"]
        got = losses(part)
        assert sorted(got) == [3] and got[3] == runs["hp"][3], (src, got, runs["hp"])


def stderr_trainer_rank(rank: int, world: int, port: int, argv: list[str], out: str) -> None:
    """`trainer_rank` with the rank's standard error in out/stderr{rank}."""
    import contextlib

    with open(Path(out, f"stderr{rank}"), "w") as f, contextlib.redirect_stderr(f):
        trainer_rank(rank, world, port, argv, out)


def test_mxfp8_all_gather_with_compile_is_refused(tmp_path):
    """torch.compile (fullgraph MoE blocks) cannot trace the gathered MX weight: refused up front,
    naming both options, on every rank (no collective hangs)."""
    argv = TINY + MX + ["--training.steps=1", "--parallelism.timeout_s=60", "--compile.enable=true",
                        "--mx.fsdp_mxfp8_all_gather=true", f"--job.dump_folder={tmp_path}/run"]
    spawn_ranks(stderr_trainer_rank, 2, argv, str(tmp_path))
    assert [(tmp_path / f"rc{r}").read_text() for r in range(2)] == ["2", "2"]
    for r in range(2):
        err = (tmp_path / f"stderr{r}").read_text()
        assert "mx.fsdp_mxfp8_all_gather=true runs eager" in err and "--compile.enable=false" in err, err
