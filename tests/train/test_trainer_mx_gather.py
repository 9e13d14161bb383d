"""The trainer with `--mx.fsdp_mxfp8_all_gather` (2 gloo ranks): the same losses, bit for bit, as
without it, and checkpoints that resume across the option both ways."""

import shutil

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


def test_mxfp8_all_gather_compiled_equals_eager_bit_for_bit(tmp_path):
    """Compiled blocks (inductor, and aot_eager) with the MXFP8 gather: the losses of the same runs
    without the option, bit for bit (aot_eager's: the eager runs'). The compiled backward reads the
    backward's gather (blocks along N) from the buffers the forward's filled: a graph that read them
    in the forward (a partitioner's choice, which inductor's made before the read took the gradient
    as a dependency) gives other gradients from step 2 on."""
    common = TINY + MX + ["--training.steps=3", "--parallelism.timeout_s=60"]
    on = ["--mx.fsdp_mxfp8_all_gather=true"]
    inductor = ["--compile.enable=true"]
    aot_eager = ["--compile.enable=true", "--compile.backend=aot_eager"]
    runs = {}
    for name, extra in (("eager", []), ("eager_mx", on), ("inductor", inductor),
                        ("inductor_mx", on + inductor), ("aot_eager_mx", on + aot_eager)):
        spawn_ranks(trainer_rank, 2, common + extra + [f"--job.dump_folder={tmp_path / name}"], str(tmp_path))
        assert [(tmp_path / f"rc{r}").read_text() for r in range(2)] == ["0", "0"], name
        if name.endswith("_mx"):
            assert "gather in the compute dtype" not in (tmp_path / "stdout0").read_text()  # all MXFP8
        runs[name] = losses(tmp_path / name)
    assert sorted(runs["eager"]) == [1, 2, 3]
    # with the option as without it: eager, aot_eager and inductor (whose own fusions may round the
    # model's other ops in another order than eager: torch 2.11's do in the last bit, 2.13's not)
    assert runs["inductor_mx"] == runs["inductor"], runs
    assert all(runs[k] == runs["eager"] for k in ("eager_mx", "aot_eager_mx")), runs


def test_mxfp8_all_gather_in_one_process_says_it_gathers_nothing(tmp_path, capsys):
    """One process has no FSDP: the option is accepted and the log says it gathers nothing."""
    from mxmoe.train import trainer

    argv = TINY + MX + ["--training.steps=1", "--mx.fsdp_mxfp8_all_gather=true"]
    argv.append(f"--job.dump_folder={tmp_path}")
    assert trainer.main(argv) == 0
    out = capsys.readouterr()
    assert "one process, no FSDP: no weight is all-gathered" in out.out + out.err



def test_mxfp8_all_gather_without_an_mx_converter_is_warned_of(tmp_path, capsys):
    """The option with no MX converter (model.converters=) gathers nothing as MXFP8: said, not
    ignored silently."""
    from mxmoe.train import trainer

    argv = TINY + ["--model.converters=", "--training.steps=1", "--mx.fsdp_mxfp8_all_gather=true"]
    argv.append(f"--job.dump_folder={tmp_path}")
    assert trainer.main(argv) == 0
    out = capsys.readouterr()
    assert "mx.fsdp_mxfp8_all_gather=true, but model.converters=[] names no MX converter" in out.out + out.err
