"""What `mxmoe bench linear` and `mxmoe bench grouped_mm` share: recipes, shape parsing, the result
row and the command line."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from mxmoe.bench.timing import bench, bf16_gemm_tflops, environment, print_table, require_cuda, write_json
from mxmoe.cli import comma_list
from mxmoe.recipe import GEMM_BACKENDS, RECIPES, check_gemm_backend  # RECIPES: the recipes timed


def shape_parser(pattern: str, example: str) -> Callable[[str], tuple[int, ...]]:
    """argparse type for shapes like `pattern` ("MxKxN"): a tuple of len(pattern.split('x')) ints."""
    n = len(pattern.split("x"))

    def parse(s: str) -> tuple[int, ...]:
        try:
            dims = tuple(int(v) for v in s.lower().split("x"))
        except ValueError:
            dims = ()
        if len(dims) != n or min(dims) <= 0:
            raise argparse.ArgumentTypeError(f"shape {s!r}: expected {pattern}, e.g. {example}")
        return dims

    return parse


def row(shape: str, recipe: str, t: float, t_bf16: float, flops: float, tc: float, tg: float) -> dict:
    """One result row: fwd+bwd time t (ms), its TFLOP/s, ratio to bf16, casts and GEMMs alone (ms)."""
    return {
        "shape": shape,
        "recipe": recipe,
        "fwd+bwd ms": t,
        "TFLOP/s": flops / t / 1e9,
        "vs bf16": t_bf16 / t,
        "casts ms": tc,
        "gemms ms": tg,
        "cast share": tc / t,
    }


def forward_row(shape: str, gemm: str, t: float | None, t_bf16: float, flops: float, note: str = "") -> dict:
    """One forward-GEMM row: time t (ms; None: could not run, `note` says why), TFLOP/s, ratio to bf16."""
    return {
        "shape": shape,
        "forward GEMM": gemm,
        "ms": t,
        "TFLOP/s": None if t is None else flops / t / 1e9,
        "vs bf16": None if t is None else t_bf16 / t,
        "note": note,
    }


def rowwise_fp8(x: Tensor) -> tuple[Tensor, Tensor]:
    """x (..., K) -> (e4m3 (..., K), fp32 scale (..., 1)) with x ~ q * scale: torch's row-wise fp8."""
    scale = x.abs().amax(-1, keepdim=True).float().clamp(min=1e-12) / 448.0
    return (x.float() / scale).to(torch.float8_e4m3fn), scale


def timed_or_reason(fn: Callable[[], object], iters: int) -> tuple[float | None, str]:
    """(median ms, "") of fn, or (None, the error) when fn cannot run here (e.g. an op torch lacks)."""
    try:
        return bench(fn, iters=iters).median_ms, ""
    except (RuntimeError, NotImplementedError, TypeError, ValueError, AttributeError) as e:
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"


def main(
    argv: list[str],
    *,
    name: str,
    doc: str,
    pattern: str,
    example: str,
    shapes: Sequence[tuple[int, ...]],
    run_shape: Callable[..., list[dict]],
    run_forward: Callable[..., list[dict]] | None = None,
) -> int:
    """The command line of a GEMM bench: `run_shape(*shape, recipes, kernel, iters, gemm_backend=)` per shape;
    with --forward, `run_forward(*shape, kernel, iters)` instead: the forward GEMM alone, bf16 vs fp8
    row-wise (torch) vs the MX backends on pre-cast operands."""
    p = argparse.ArgumentParser(prog=f"mxmoe bench {name}", description=doc)
    p.add_argument(
        "--shape",
        type=comma_list(shape_parser(pattern, example)),
        action="extend",
        help=f"{pattern}, comma list; default: MoE shapes",
    )
    p.add_argument(
        "--recipes", type=comma_list(choices=list(RECIPES)), action="extend", help="comma list; default: all"
    )
    p.add_argument("--kernel", default="auto", help="cast kernel: auto | torch | triton | cuda")
    p.add_argument(
        "--gemm-backend", default="emulated", help=f"MX GEMM backend of fwd+bwd: {' | '.join(GEMM_BACKENDS)}"
    )
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--json", metavar="PATH", help="also write the rows and the environment as JSON")
    if run_forward is not None:
        p.add_argument(
            "--forward",
            action="store_true",
            help="the forward GEMM alone: bf16, torch fp8 row-wise, each MX GEMM backend",
        )
    args = p.parse_args(argv)
    try:  # argparse's choices= would not say why a removed backend is gone
        check_gemm_backend(args.gemm_backend, "--gemm-backend")
    except ValueError as e:
        p.error(str(e))
    require_cuda(f"mxmoe bench {name}")
    ceiling = bf16_gemm_tflops()
    if run_forward is not None and args.forward:
        rows = []
        for shape in args.shape or shapes:
            rows += run_forward(*shape, args.kernel, args.iters)
            torch.cuda.empty_cache()
        print_table(rows, title=f"{name} forward GEMM; bf16 GEMM ceiling 8192^3: {ceiling:.0f} TFLOP/s")
        if args.json:
            write_json(args.json, {"env": environment(), "bf16_gemm_tflops": ceiling, "rows": rows})
        return 0
    rows = []
    for shape in args.shape or shapes:
        rows += run_shape(
            *shape, args.recipes or list(RECIPES), args.kernel, args.iters, gemm_backend=args.gemm_backend
        )
        torch.cuda.empty_cache()
    title = (
        f"{name} fwd+bwd (3 GEMMs), MX GEMM backend {args.gemm_backend}; bf16 GEMM ceiling 8192^3: "
        f"{ceiling:.0f} TFLOP/s"
    )
    print_table(rows, title=title)
    if args.json:
        write_json(args.json, {"env": environment(), "bf16_gemm_tflops": ceiling, "rows": rows})
    return 0
