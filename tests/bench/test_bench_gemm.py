"""CPU checks of the GEMM benchmarks' command lines (the timing itself needs a GPU)."""

import json

import pytest
import torch

from mxmoe.bench import grouped_mm, linear
from mxmoe.bench.gemm_common import row, shape_parser


@pytest.mark.parametrize("module,bad", [(linear, "1x2"), (grouped_mm, "2x3x4"), (linear, "0x2x3")])
def test_bad_shape_is_rejected(module, bad, capsys):
    with pytest.raises(SystemExit) as e:
        module.main(["--shape", bad])
    assert e.value.code == 2
    assert "expected" in capsys.readouterr().err


@pytest.mark.parametrize("module", [linear, grouped_mm])
def test_gemm_backend_option(module, capsys):
    """--gemm_backend takes the recipe's GEMM backends; the removed fp8 one is refused (before any
    GPU is needed) with the reason and where it is recorded."""
    with pytest.raises(SystemExit) as e:
        module.main(["--gemm-backend", "fp8"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--gemm_backend='fp8': the Hopper fp8 GEMM backend was removed" in err
    assert "the training-ops page of mxmoe's documentation" in err
    assert "expected one of ['auto', 'emulated', 'native']" in err
    with pytest.raises(SystemExit) as e:
        module.main(["--help"])
    assert e.value.code == 0 and "emulated" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
@pytest.mark.parametrize("module", [linear, grouped_mm])
def test_refuses_without_gpu(module):
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        module.main(["--iters", "1"])


def test_shape_parser_and_row():
    assert shape_parser("MxKxN", "1x32x32")("4x32x64") == (4, 32, 64)
    r = row("s", "mxfp8", t=2.0, t_bf16=1.0, flops=4e9, tc=0.5, tg=1.0)
    assert r["vs bf16"] == 0.5 and r["TFLOP/s"] == 2.0 and r["cast share"] == 0.25


def test_bf16_baseline_row():
    """The bf16 row both GEMM benches print: ratio 1, no cast time."""
    r = row("s", "bf16", t=2.0, t_bf16=2.0, flops=4e9, tc=0.0, tg=1.5)
    assert r == {"shape": "s", "recipe": "bf16", "fwd+bwd ms": 2.0, "TFLOP/s": 2.0, "vs bf16": 1.0,
                 "casts ms": 0.0, "gemms ms": 1.5, "cast share": 0.0}


@pytest.mark.parametrize("kw", [{"iters": 0}, {"warmup": -1}, {"args": ()}])
def test_bench_rejects_bad_counts(kw):
    from mxmoe.bench.timing import bench

    with pytest.raises(ValueError, match="bench needs"):
        bench(lambda: None, **kw)


def test_forward_row_and_flag():
    from mxmoe.bench.gemm_common import forward_row, rowwise_fp8

    r = forward_row("s", "fp8", t=2.0, t_bf16=3.0, flops=4e9)
    assert r["TFLOP/s"] == 2.0 and r["vs bf16"] == 1.5 and r["note"] == ""
    r = forward_row("s", "fp8", t=None, t_bf16=3.0, flops=4e9, note="no such op")
    assert r["TFLOP/s"] is None and r["vs bf16"] is None and r["note"] == "no such op"
    x = torch.tensor([[1.0, -448.0], [0.5, 0.25]])
    q, s = rowwise_fp8(x)
    assert torch.equal(q.float() * s, x)
    if not torch.cuda.is_available():
        for module in (linear, grouped_mm):
            with pytest.raises(SystemExit, match="needs a CUDA GPU"):
                module.main(["--forward", "--iters", "1"])


@pytest.mark.parametrize("bench", ["cast", "linear", "grouped_mm", "overlap", "a2a"])
def test_unwritable_json_is_refused_before_measuring(bench, capsys):
    from mxmoe.cli import main as cli_main

    with pytest.raises(SystemExit) as e:
        cli_main(["bench", bench, "--json", "/proc/no/x.json"])
    assert e.value.code == 2 and "--json '/proc/no/x.json': cannot write in" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--shapes", "10x10x10"], "argument --shapes: shape '10x10x10': expected M >= 32"),
        (["--shapes", "1024x1024"], "argument --shapes: shape '1024x1024': expected MxKxN"),
        (["--shapes", ","], "argument --shapes: ',' holds no shape"),
        (["--iters", "0"], "argument --iters: '0' is not a positive integer"),
    ],
)
def test_overlap_bad_arguments_are_usage_errors(argv, needle, capsys):
    from mxmoe.cli import main as cli_main

    with pytest.raises(SystemExit) as e:
        cli_main(["bench", "overlap", *argv])
    assert e.value.code == 2 and needle in capsys.readouterr().err


@pytest.mark.parametrize(
    "bench, argv, needle",
    [
        ("a2a", ["--seq", "0"], "argument --seq: '0' is not a positive integer"),
        ("a2a", ["--batches", "4,-1"], "argument --batches: '-1' is not a positive integer"),
        ("a2a", ["--dims", "5120,100"], "--dims=100: expected multiples of 32"),
        ("a2a", ["--warmup", "-1"], "argument --warmup: '-1' is not an integer >= 0"),
        ("a2a", ["--timeout", "0"], "argument --timeout: '0' is not a positive number of seconds"),
        ("linear", ["--iters", "0"], "argument --iters: '0' is not a positive integer"),
        ("grouped_mm", ["--kernel", "cutlass"], "argument --kernel: invalid choice: 'cutlass'"),
        # K, N not whole MX blocks: a ValueError traceback on the GPU after the bf16 rows ran
        ("linear", ["--shape", "64x100x64"], "shape '64x100x64': K=100: expected K and N multiples of 32"),
        ("grouped_mm", ["--shape", "64x64x48x4"], "shape '64x64x48x4': N=48: expected K and N multiples"),
    ],
)
def test_gpu_bench_bad_counts_are_usage_errors_before_the_gpu_check(bench, argv, needle, capsys):
    from mxmoe.cli import main as cli_main

    with pytest.raises(SystemExit) as e:
        cli_main(["bench", bench, *argv])
    assert e.value.code == 2 and needle in capsys.readouterr().err


@pytest.mark.parametrize("forward", [False, True])
def test_json_records_what_the_rows_were_measured_with(tmp_path, monkeypatch, forward):
    """The JSON held the rows and the environment only: runs of `--gemm_backend native` and
    `emulated` (or of two cast kernels) could not be told apart."""
    from mxmoe.bench import gemm_common

    monkeypatch.setattr(gemm_common, "require_cuda", lambda what: None)
    monkeypatch.setattr(gemm_common, "bf16_gemm_tflops", lambda: 900.0)
    seen = []

    def run_shape(*a, gemm_backend):
        seen.append((a, gemm_backend))
        return [{"shape": "x"}]

    def run_forward(*a):
        seen.append(a)
        return [{"shape": "x"}]

    out = tmp_path / "r.json"
    argv = ["--shape", "64x64x64", "--kernel", "triton", "--gemm_backend", "native", "--iters", "3",
            "--json", str(out), *(["--forward"] if forward else [])]
    assert gemm_common.main(argv, name="linear", doc="", pattern="MxKxN", example="1x2x3", shapes=[],
                            run_shape=run_shape, run_forward=run_forward) == 0
    doc = json.loads(out.read_text())
    assert (doc["kernel"], doc["iters"], doc["forward"]) == ("triton", 3, forward)
    assert doc.get("gemm_backend") == (None if forward else "native")  # --forward times every backend
    assert seen and doc["rows"] == [{"shape": "x"}]


def test_overlap_records_the_cast_kernel_auto_chose(tmp_path, monkeypatch, capsys):
    """The overlap JSON and table did not say which kernel the timed cast ran: its recipe's "auto" takes
    the C++ operator where the extension builds and Triton where it does not, unrecorded."""
    from mxmoe.bench import overlap, timing
    from mxmoe.quant.backends import cast_kernel
    from mxmoe.recipe import recipe

    monkeypatch.setattr(timing, "require_cuda", lambda what: None)
    monkeypatch.setattr(overlap, "measure", lambda M, K, N, iters: {"shape": f"{M}x{K}->{N}", "hidden": 0.5})
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    out = tmp_path / "o.json"
    assert overlap.main(["--shapes", "64x64x64", "--iters", "3", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    want = cast_kernel(recipe("mxfp8_rceil"), torch.device("cuda", 0), "qdq_dim1")
    assert want in ("cuda", "triton") and doc["cast_kernel"] == want
    assert (doc["recipe"], doc["iters"]) == ("mxfp8_rceil", 3)
    assert doc["rows"] == [{"shape": "64x64->64", "hidden": 0.5}]
    assert f"cast kernel {want};" in capsys.readouterr().out


def test_a2a_rows_record_the_transport_auto_chose(monkeypatch):
    """A row of `--transport auto` did not say which transport ran: symm where symmetric memory can
    run (and no --chunks asks for the NCCL pipeline), NCCL elsewhere. Each row names it (`ran`); here,
    off CUDA, NCCL."""
    from mxmoe.bench import a2a

    monkeypatch.setattr(a2a, "_time_op", lambda op, xs, gs, timed: dict(forward=2.0, backward=3.0, both=4.0))
    monkeypatch.setattr(a2a, "bench", lambda *a, **k: type("T", (), {"median_ms": 1.0})())
    monkeypatch.setattr(a2a, "_breakdown", lambda *a: {})
    args = a2a.parse_args(["--transport", "auto,nccl", "--chunks", "auto,2"])
    xs = [torch.randn(64, 64, dtype=torch.bfloat16)]
    rows: list = []
    a2a._bench_shape(xs, xs, [32, 32], "1x64x64", 2, args, rows, [])
    got = {(r["transport"], r["chunks"], r["ran"]) for r in rows}
    assert got == {(t, c, "nccl") for t in ("auto", "nccl") for c in ("auto", 2)}


@pytest.mark.parametrize("bench", ["cast", "linear", "grouped_mm", "overlap", "overhead", "trace"])
def test_empty_json_path_is_refused(bench, capsys):
    """`--json ''` passed the check and then wrote nothing (every write was `if args.json:`)."""
    from mxmoe.cli import main as cli_main

    with pytest.raises(SystemExit) as e:
        cli_main(["bench", bench, "--json", "", *(["x.json"] if bench == "trace" else [])])
    assert e.value.code == 2 and "--json '' is empty; expected a file path" in capsys.readouterr().err
