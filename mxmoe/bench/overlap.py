"""`mxmoe bench overlap`: how much of an MX cast a GEMM running at the same time hides.

The case for casting on a side stream: in a linear layer's backward the wgrad's cast of dy along M
(`qdq` dim1) does not wait for the dgrad GEMM dx = dy0 W, so the two could run at once, the
memory-bound cast beside the compute-bound GEMM. For each M×K→N (bf16 operands, recipe
mxfp8_rceil, the cast kernels `auto`: the title and the JSON name the one it chose), with CUDA
events around each whole pattern:

  gemm      dx = dy0 @ W ((M, N) @ (N, K)) alone
  cast      qdq of dy (M, N) along M alone
  serial    the cast, then the GEMM, on one stream
  overlap   the cast on a side stream while the GEMM runs on the current one, joined after both
  hidden    (serial - overlap) / cast: the share of the cast's time the GEMM hides (1 = all of it)

    mxmoe bench overlap --shapes 16384x1024x1024,16384x4096x4096 --json overlap.json
"""

from __future__ import annotations

import argparse

import torch

from mxmoe.cli import ArgumentParser, positive_int

RECIPE = "mxfp8_rceil"  # its cast kernels "auto": `cast_kernel` says which one ran
SHAPES = ["16384x1024x1024", "32768x1024x2048", "16384x2048x2048", "16384x4096x4096", "65536x7168x2048"]


def _shape(text: str) -> tuple[int, int, int]:
    try:
        m, k, n = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"shape {text!r}: expected MxKxN, e.g. 16384x1024x1024") from None
    if min(m, k, n) < 32 or k % 32 or n % 32:
        raise argparse.ArgumentTypeError(f"shape {text!r}: expected M >= 32 and K, N multiples of 32")
    return m, k, n


def _shapes(text: str) -> list[tuple[int, int, int]]:
    """An argparse `type`: "MxKxN,MxKxN" -> the shapes (ArgumentTypeError naming a bad one)."""
    shapes = [_shape(s.strip()) for s in text.split(",") if s.strip()]
    if not shapes:
        raise argparse.ArgumentTypeError(f"{text!r} holds no shape; expected MxKxN, e.g. 16384x1024x1024")
    return shapes


def measure(M: int, K: int, N: int, iters: int) -> dict:
    from mxmoe.bench import timing
    from mxmoe.quant.qdq import qdq
    from mxmoe.recipe import recipe

    r = recipe(RECIPE)
    sets = timing.rotation_count(2 * M * N)
    dys = [torch.randn(M, N, device="cuda", dtype=torch.bfloat16) for _ in range(sets)]
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * N**-0.5
    side = torch.cuda.Stream()
    args = [(dy,) for dy in dys]

    def gemm(dy):
        return dy @ w

    def cast(dy):
        return qdq(dy, -2, recipe=r)

    def serial(dy):
        cast(dy)
        return gemm(dy)

    def overlap(dy):
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            y1 = cast(dy)
        dx = gemm(dy)
        main.wait_stream(side)
        y1.record_stream(main)
        return dx, y1

    t = {name: timing.bench(fn, args, warmup=5, iters=iters).median_ms
         for name, fn in (("gemm", gemm), ("cast", cast), ("serial", serial), ("overlap", overlap))}
    return {
        "shape": f"{M}x{K}->{N}",
        **{f"{k}_ms": v for k, v in t.items()},
        "hidden": (t["serial"] - t["overlap"]) / t["cast"],
        "overlap_vs_gemm": t["overlap"] / t["gemm"],
    }


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="mxmoe bench overlap", description=__doc__.split("\n")[0])
    p.add_argument(
        "--shapes", type=_shapes, default=",".join(SHAPES), help=f"comma list of MxKxN (default {SHAPES})"
    )
    p.add_argument("--iters", type=positive_int, default=30, help="timed repeats per pattern (default 30)")
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    shapes = args.shapes
    from mxmoe.bench import timing

    timing.check_json(p, args.json)
    timing.require_cuda("mxmoe bench overlap")
    rows = [measure(*s, args.iters) for s in shapes]
    kernel = cast_kernel()
    env = ", ".join(f"{k} {v}" for k, v in timing.environment().items())
    timing.print_table(rows, title=f"a cast beside a GEMM (cast kernel {kernel}; {env})")
    if args.json:
        timing.write_json(
            args.json,
            {"bench": "overlap", "recipe": RECIPE, "cast_kernel": kernel, "iters": args.iters,
             "environment": timing.environment(), "rows": rows},
        )
    return 0


def cast_kernel() -> str:
    """The kernel the timed cast ran: what the recipe's "auto" chose on this GPU (the C++ operator
    where the extension builds, else Triton)."""
    from mxmoe.quant.backends import cast_kernel
    from mxmoe.recipe import recipe

    return cast_kernel(recipe(RECIPE), torch.device("cuda", torch.cuda.current_device()), "qdq_dim1")
