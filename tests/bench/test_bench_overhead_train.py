"""`mxmoe bench overhead` and `mxmoe bench train` run end to end on CPU (tiny shapes, few calls/steps)
and write their JSON; bad arguments are refused clearly."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

from mxmoe.cli import main as cli_main

TINY_TRAIN = [
    "--config",
    "debug_moe",
    "--training.device=cpu",
    "--training.local_batch_size=2",
    "--training.seq_len=32",
    "--model.n_layers=1",
    "--mx.mxfp8_dim1_cast_kernel_choice=torch",
]


def test_overhead_runs_on_cpu_and_writes_json(tmp_path, capsys):
    out = tmp_path / "o.json"
    argv = ["bench", "overhead", "--shape", "128x128", "--kernel", "torch", "--iters", "2", "--warmup", "1"]
    assert cli_main([*argv, "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    rows = {(r["op"], r["impl"]): r for r in data["rows"]}
    for key in [
        ("copy_", "native"),
        ("x.to(float8_e4m3fn)", "native"),
        ("torch.mm fwd+bwd", "native"),
        ("to_mx dim0", "torch"),
        ("to_mx dim1", "torch"),
        ("to_mx_dim0_dim1", "torch"),
        ("to_mx 3D along K", "torch"),
        ("to_mx 3D along N", "torch"),
        ("dequantize", "torch"),
        ("qdq dim0", "torch"),
        ("qdq dim1", "torch"),
        ("qdq 3D along N", "torch"),
        ("qdq_dim0_dim1", "torch"),
        ("qdq dim1, groups", "torch"),
        ("mx_mm fwd", "auto"),
        ("mx_mm fwd+bwd", "auto"),
        ("mx_grouped_mm fwd", "auto"),
        ("mx_grouped_mm fwd+bwd", "auto"),
        ("a2a_unquantized, 1 rank", "native"),
        ("to_mxfp8_a2a_dequant, 1 rank", "auto"),
    ]:
        assert rows[key]["error"] == "" and rows[key]["host_us"] > 0, (key, rows[key])
    assert rows[("x.to(float8_e4m3fn)", "native")]["x_to_fp8"] == 1.0
    assert "host cost per call, 128x128" in capsys.readouterr().out


def test_overhead_a_kernel_given_twice_is_timed_once():
    """`--kernel torch --kernel torch` timed (and printed) every torch row twice."""
    from mxmoe.bench import overhead

    args = overhead.build_parser().parse_args(["--shape", "128x128", "--kernel", "torch", "--kernel=torch"])
    rows = [(op, impl) for op, impl, _, _ in overhead._cases(args, torch.device("cpu"))]
    assert len(rows) == len(set(rows)) and ("to_mx dim0", "torch") in rows


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--shape", "100x128"], "multiples of 128"),
        (["--iters", "0"], "positive"),
        (["--json", "/"], "--json '/': is a folder, expected a file path, e.g. result.json"),
        (["--device", "cpu", "--kernel", "cuda"], "--kernel cuda cannot run on the cpu: kernel='cuda' needs"),
    ],
)
def test_overhead_rejects_bad_arguments(argv, needle, capsys):
    with pytest.raises(SystemExit) as exc:
        cli_main(["bench", "overhead", *argv])
    assert exc.value.code == 2 and needle in capsys.readouterr().err


def test_train_bench_rows_in_children_and_in_the_deterministic_mode(tmp_path, capsys):
    """--debug.deterministic=true: the rows run in the trainer's deterministic mode, with the same
    losses as without it on CPU; by default each row runs alone in a child process of its own, which
    enters the mode too and gives the same row as this process."""
    rows = {}
    for det in (False, True):
        out = tmp_path / f"t{det}.json"
        argv = ["bench", "train", *TINY_TRAIN, "--modes", "eager", "--steps", "1", "--warmup-steps", "1",
                f"--debug.deterministic={str(det).lower()}", "--json", str(out), "--same-process"]
        assert cli_main(argv) == 0
        rows[det] = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    for variant in ("bf16", "mx"):
        assert rows[False][variant]["deterministic"] is False and rows[True][variant]["deterministic"] is True
        assert rows[False][variant]["loss"] == rows[True][variant]["loss"]
    capsys.readouterr()
    out = tmp_path / "children.json"
    argv = ["bench", "train", *TINY_TRAIN, "--modes", "eager", "--steps", "1", "--warmup-steps", "1",
            "--debug.deterministic=true", "--json", str(out)]
    assert cli_main(argv) == 0
    data = json.loads(out.read_text())
    children = {(r["variant"], r["mode"]): r for r in data["rows"]}
    assert set(children) == {("bf16", "eager"), ("mx", "eager")}
    for (variant, _), r in children.items():
        assert r["tokens_per_s"] > 0 and r["step_ms"] > 0 and r["peak_mem_gib"] > 0 and r["loss"] > 0
        assert 0 < r["host_ms"] < 10 * r["step_ms"]  # on CPU the step runs in its Python: about step_ms
        assert r["deterministic"] is True and r["loss"] == rows[True][variant]["loss"]
    assert children[("bf16", "eager")]["vs_bf16"] == 1.0
    assert children[("mx", "eager")]["converted"].startswith("mxmoe.convert: MXFP8 recipe mxfp8")
    # what ran: the package, and what "auto" chose for the MX row (on CPU the torch casts, emulated GEMMs)
    import mxmoe

    for r in children.values():
        assert r["mxmoe"] == os.path.dirname(os.path.abspath(mxmoe.__file__))
    kernels = children[("mx", "eager")]["kernels"]
    assert kernels["gemm"] == "emulated" and set(kernels) >= {"dim0", "dim1", "qdq_dim0", "qdq_dim1"}
    assert children[("bf16", "eager")]["kernels"] == {}
    assert data["config"]["model"]["name"] == "debug_moe"
    text = capsys.readouterr().out
    assert "training steps, model debug_moe, 2x32 tokens/step" in text


def test_train_bench_counts_compiled_graphs(tmp_path):
    """The per-block compile of the bf16 and the MX model: graphs compiled in warm-up, none in the
    timed steps (no recompiles), no graph breaks; eager compiles nothing."""
    out = tmp_path / "t.json"
    argv = ["bench", "train", *TINY_TRAIN, "--modes", "eager,compile", "--steps", "2", "--warmup-steps", "2",
            "--compile.backend=aot_eager", "--json", str(out), "--same-process"]
    assert cli_main(argv) == 0
    for r in json.loads(out.read_text())["rows"]:
        if r["mode"] == "eager":
            assert (r["graphs"], r["graph_breaks"], r["graphs_timed"]) == (0, 0, 0), r
        else:
            assert r["graphs"] > 0 and r["graph_breaks"] == 0 and r["graphs_timed"] == 0, r


def test_train_bench_profile_writes_the_operator_tables(tmp_path):
    """--profile: per variant and mode a file with the operator table and the same grouped by input
    shapes (the MX ops' shapes included)."""
    argv = ["bench", "train", *TINY_TRAIN, "--modes", "eager", "--variants", "mx", "--steps", "1",
            "--warmup-steps", "1", "--profile", str(tmp_path), "--profile-steps", "1", "--same-process"]
    assert cli_main(argv) == 0
    text = (tmp_path / "mx_eager.txt").read_text()
    assert text.startswith("mx, eager: 1 steps recorded")
    head, by_shape = text.split("The same, by input shapes (1 steps):")
    assert "Input Shapes" not in head and "Input Shapes" in by_shape
    assert re.search(r"aten::mm\s.*\[\[\d+, \d+\], \[\d+, \d+\]", by_shape), by_shape[:2000]


def test_train_bench_refuses_a_mode_the_device_cannot_run(capsys):
    argv = [
        "bench",
        "train",
        *TINY_TRAIN,
        "--modes",
        "graph",
        "--variants",
        "mx",
        "--steps",
        "1",
        "--warmup-steps",
        "1",
    ]
    import torch

    if torch.cuda.is_available():
        pytest.skip("graphs run on a GPU")
    # refused before any row (each row failed in its own process, exit 1 after all of them)
    with pytest.raises(SystemExit) as exc:
        cli_main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert "--modes=graph: graph replay CUDA graphs, which need a CUDA device; this run's is cpu" in err, err


def test_train_bench_refuses_mx_options_without_an_mx_row(capsys):
    """--variants bf16 with an mx.* option: the option was ignored without a word (each row's own
    process, --same_process, still takes the parent's options with its one variant)."""
    argv = ["bench", "train", *TINY_TRAIN, "--modes", "eager", "--variants", "bf16", "--mx.recipe_name=mxfp8"]
    with pytest.raises(SystemExit) as exc:
        cli_main(argv)
    assert exc.value.code == 2
    assert "mx.recipe_name='mxfp8' given, but --variants=bf16 has no mx row" in capsys.readouterr().err


def test_train_bench_rejects_bad_arguments(capsys):
    with pytest.raises(SystemExit) as exc:
        cli_main(["bench", "train", "--modes", "eager,fast"])
    assert exc.value.code == 2 and "--modes" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        cli_main(["bench", "train", "--training.nope=1"])
    assert exc.value.code == 2 and "nope" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:  # checked where a mode compiles
        cli_main(["bench", "train", "--modes", "eager,compile", "--compile.backend=aot"])
    assert exc.value.code == 2 and "compile.backend='aot'" in capsys.readouterr().err
    # the trainer's value checks and an unwritable --json, before any row runs
    for argv, needle in [
        (["--training.local_batch_size=0"], "training.local_batch_size=0: expected >= 1"),
        (["--training.seq_len=-1"], "training.seq_len=-1: expected >= 1"),
        (["--json", "/proc/no/x.json"], "--json '/proc/no/x.json': cannot write in"),
        (["--profile", "/proc/no/prof"], "--profile '/proc/no/prof': cannot write in"),
        (["--mx.mxfp8_dim1_cast_kernel_choice=cuda"], "_dim1_cast_kernel_choice='cuda' cannot run on cpu"),
    ] + ([] if torch.cuda.is_available() else [(["--training.device=cuda"], "no CUDA GPU is available")]):
        with pytest.raises(SystemExit) as exc:
            cli_main(["bench", "train", *TINY_TRAIN, "--modes", "eager", *argv])
        assert exc.value.code == 2 and needle in capsys.readouterr().err


def test_train_bench_row_process_that_dies_is_an_error_row(monkeypatch, capsys):
    """A row's process that exits without writing its row (a crash) gives an error row naming its
    exit code; the other rows still run."""
    import shutil
    import sys

    monkeypatch.setattr(sys, "executable", shutil.which("false"))
    argv = ["bench", "train", *TINY_TRAIN, "--modes", "eager", "--steps", "1", "--warmup-steps", "1"]
    assert cli_main(argv) == 1
    out = capsys.readouterr().out
    assert out.count("the row's process exited with code 1, no row") == 2, out


def test_overhead_without_triton_runs_on_cpu_or_refuses_in_one_line(tmp_path):
    """Without the triton package: `mxmoe bench overhead` runs its CPU rows, and `--kernel triton`
    is one line naming the fix, not a traceback (issue 57)."""
    from conftest import run_without

    bench = ["-m", "mxmoe", "bench", "overhead", "--device", "cpu", "--shape", "128x128", "--iters", "1"]
    done = run_without(["triton"], [*bench, "--warmup", "1", "--kernel", "triton"], tmp_path)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        "mxmoe bench overhead: --kernel triton: needs the triton package, which is not installed: pip "
        "install 'mxmoe[triton]'"
    ]
    done = run_without(["triton"], [*bench, "--warmup", "1", "--json", "o.json"], tmp_path)
    assert done.returncode == 0, done.stderr
    rows = json.loads((tmp_path / "o.json").read_text())["rows"]
    assert {r["impl"] for r in rows} == {"native", "auto", "torch"}
    assert all(r["error"] == "" for r in rows), [r for r in rows if r["error"]]
