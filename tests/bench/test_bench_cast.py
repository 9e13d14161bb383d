"""`mxmoe bench cast`: argument checking and the clear refusal without a GPU (CPU); graph timing (GPU)."""

from __future__ import annotations

import pytest
import torch

from mxmoe.bench import cast, timing
from mxmoe.cli import main as cli_main


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--mode", "dim2"], "--mode"),
        (["--scaling", "round"], "--scaling"),
        (["--kernel", "cutlass"], "--kernel"),
        (["--shape", "16384"], "not RxC"),
        (["--shape", "0x64"], "not RxC"),
        (["--shape", "100x64"], "multiples of 32"),
        (["--iters", "0"], "positive integer"),
        # a shape the mode does not take: its default shapes were timed instead, silently
        (["--mode", "dim0", "--shape", "8x2048x7168"], "--shape 8x2048x7168: --mode dim0 takes RxC shapes"),
        (["--mode", "3d", "--shape", "8x64x64,1024x1024"], "--shape 1024x1024: --mode 3d takes ExNxK shapes"),
    ],
)
def test_bad_arguments_are_rejected(argv, needle, capsys):
    with pytest.raises(SystemExit) as exc:
        cast.main(argv)
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err


def test_cases_cover_defaults():
    args = cast.build_parser().parse_args(["--kernel", "triton"])
    cases = cast._cases(args)
    shapes = {c.shape for c in cases}
    assert shapes == set(cast.DEFAULT_SHAPES_2D) | set(cast.DEFAULT_SHAPES_3D)
    assert {c.kernel for c in cases} == {"triton"}
    assert {c.mode for c in cases} == set(cast.MODES)
    assert {c.scaling for c in cases if c.mode != "dequant"} == {"floor", "rceil"}
    # 3D shapes only feed the 3d mode, 2D shapes the others
    assert all((len(c.shape) == 3) == (c.mode == "3d") for c in cases)


def test_bytes_counted():
    n = 64 * 128
    assert cast._bytes("dim0", (64, 128), 2) == 2 * n + n + n // 32
    assert cast._bytes("dim0_dim1", (64, 128), 2) == 2 * n + 2 * (n + n // 32)
    assert cast._bytes("dequant", (64, 128), 2) == n + n // 32 + 2 * n
    assert cast._bytes("qdq dim1 rows", (64, 128), 2) == 2 * n + 2 * n
    assert cast._bytes("qdq dim1 rows 3d E=16", (64, 128), 2) == 2 * n + 2 * n
    assert cast._bytes("qdq dim0+dim1 rows E=8", (64, 128), 2) == 2 * n + 4 * n
    for label in cast.SWIGLU_LABELS:  # g and u read, two bf16 outputs written
        assert cast._bytes(label, (64, 128), 2) == 4 * n + 4 * n
    assert len(cast.SWIGLU_BWD_LABELS) == 2 and set(cast.SWIGLU_BWD_LABELS).isdisjoint(cast.SWIGLU_LABELS)
    for label in cast.SWIGLU_BWD_LABELS:  # dh, g and u read, four bf16 outputs written
        assert cast._bytes(label, (64, 128), 2) == 6 * n + 8 * n


def test_qdq_mode_runs_the_triton_and_cuda_kernels():
    """qdq rows: the Triton rows kernel and the CUDA dim0 qdq (no torch row)."""
    args = cast.build_parser().parse_args(["--mode", "qdq", "--kernel", "torch,triton,cuda"])
    assert {c.kernel for c in cast._cases(args)} == {"triton", "cuda"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_refuses_without_gpu():
    with pytest.raises(SystemExit) as exc:
        cli_main(["bench", "cast", "--mode", "dim0"])
    assert "needs a CUDA GPU" in str(exc.value.code)


@pytest.mark.gpu
def test_qdq_rows_run_and_the_swiglu_rows_take_g_and_u():
    """Every qdq row runs on the CUDA kernels at a small shape (no error row); the two SwiGLU rows
    time the fused and unfused cast of the same (g, u) and agree bit for bit, and so do the two
    SwiGLU backward rows on the same (dh, g, u)."""
    args = cast.build_parser().parse_args(["--mode", "qdq", "--kernel", "cuda", "--shape", "512x256",
                                           "--scaling", "rceil", "--iters", "2", "--warmup", "1"])
    (case,) = cast._cases(args)
    rows = cast._run_case(case, args, copy_tbs=1.0, elem=torch.float8_e4m3fn)
    assert [r["mode"] for r in rows] == list(cast.QDQ_LABELS)
    assert all(r["note"] == "" and r["us"] > 0 for r in rows), rows
    fns = cast._make_fns(case, torch.float8_e4m3fn)
    g, u = cast._inputs(cast.SWIGLU_LABELS[0], case.shape, torch.float8_e4m3fn, 1)[0]
    unfused, fused = (fns[label](g, u) for label in cast.SWIGLU_LABELS)
    for a, b in zip(unfused, fused, strict=True):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    # the backward rows: the fused and unfused casts of dg and du from the same (dh, g, u)
    dh, g, u = cast._inputs(cast.SWIGLU_BWD_LABELS[0], case.shape, torch.float8_e4m3fn, 1)[0]
    unfused, fused = (fns[label](dh, g, u) for label in cast.SWIGLU_BWD_LABELS)
    assert len(unfused) == len(fused) == 4
    for a, b in zip(unfused, fused, strict=True):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.gpu
def test_graph_timing_replays_the_captured_call():
    """graph=True: the warm-up runs eagerly, the capture records without running, each timed iteration
    replays the call once."""
    x = torch.zeros(1 << 20, device="cuda")
    t = timing.bench(lambda y: y.add_(1), [(x,)], warmup=2, iters=5, graph=True)
    assert t.iters == 5 and 0 < t.min_ms <= t.median_ms <= t.max_ms
    assert float(x[0]) == 7.0 and bool((x == 7).all())
