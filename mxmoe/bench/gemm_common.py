"""What `mxmoe bench linear` and `mxmoe bench grouped_mm` share: recipes, shape parsing, the result
row and the command line."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence

import torch

from mxmoe.bench.timing import bf16_gemm_tflops, environment, print_table, require_cuda, write_json
from mxmoe.cli import comma_list

RECIPES = {"mxfp8": "floor", "mxfp8_rceil": "rceil"}


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


def main(
    argv: list[str],
    *,
    name: str,
    doc: str,
    pattern: str,
    example: str,
    shapes: Sequence[tuple[int, ...]],
    run_shape: Callable[..., list[dict]],
) -> int:
    """The command line of a GEMM bench: `run_shape(*shape, recipes, kernel, iters)` per shape."""
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
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--json", metavar="PATH", help="also write the rows and the environment as JSON")
    args = p.parse_args(argv)
    require_cuda(f"mxmoe bench {name}")
    ceiling = bf16_gemm_tflops()
    rows = []
    for shape in args.shape or shapes:
        rows += run_shape(*shape, args.recipes or list(RECIPES), args.kernel, args.iters)
        torch.cuda.empty_cache()
    title = f"{name} fwd+bwd (3 GEMMs); bf16 GEMM ceiling 8192^3: {ceiling:.0f} TFLOP/s"
    print_table(rows, title=title)
    if args.json:
        write_json(args.json, {"env": environment(), "bf16_gemm_tflops": ceiling, "rows": rows})
    return 0
