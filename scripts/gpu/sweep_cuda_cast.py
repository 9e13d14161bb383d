"""Bench every CUDA cast kernel variant (mxmoe/quant/csrc/mx_cast.h) on one GPU.

Usage: PYTHONPATH=. python scripts/gpu/sweep_cuda_cast.py --json OUT.json
Prints one table (variant, cast, shape, mode, us, TB/s, % of copy) and writes it as JSON.
Bytes counted: input read + fp8 written + scales written (dequant: fp8 + scales read, bf16 written).
"""

from __future__ import annotations

import argparse
import sys

import torch

from mxmoe.bench.timing import bench, copy_bandwidth_tbs, environment, print_table, require_cuda, write_json
from mxmoe.formats import make_spec
from mxmoe.quant import cuda_cast


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--iters", type=int, default=30)
    args = ap.parse_args(argv)
    require_cuda("sweep_cuda_cast")
    cuda_cast.load_extension()
    copy = copy_bandwidth_tbs()
    print(f"device copy bandwidth: {copy:.3f} TB/s", flush=True)
    rows: list[dict] = []

    def run(cast: str, shape: str, mode: str, variant: int, fn, nbytes: int) -> None:
        t = bench(fn, warmup=5, iters=args.iters)
        tbs = nbytes / (t.median_ms * 1e-3) / 1e12
        rows.append(
            {
                "variant": variant,
                "cast": cast,
                "shape": shape,
                "mode": mode,
                "us": t.median_ms * 1e3,
                "TB/s": tbs,
                "% of copy": 100 * tbs / copy,
            }
        )

    def sweep(mode: str, only: dict[str, int] | None) -> None:
        spec = make_spec(32, mode, torch.float8_e4m3fn)

        def variants(cast: str) -> list[int]:
            return [only[cast]] if only else list(range(cuda_cast.NUM_VARIANTS[cast]))

        for shape in [(131072, 7168), (16384, 16384)]:
            x = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
            n = x.numel()
            cast_bytes = 2 * n + n + n // 32
            name = "x".join(map(str, shape))
            for v in variants("dim0"):
                run(
                    "dim0",
                    name,
                    mode,
                    v,
                    lambda v=v, x=x: cuda_cast.quantize_dim0(x, spec, variant=v),
                    cast_bytes,
                )
            for v in variants("dim1"):
                x3 = x.unsqueeze(0)
                run(
                    "dim1",
                    name,
                    mode,
                    v,
                    lambda v=v, x3=x3: cuda_cast.quantize_dim1(x3, spec, variant=v),
                    cast_bytes,
                )
            for v in variants("dim0_dim1"):
                run(
                    "dim0_dim1",
                    name,
                    mode,
                    v,
                    lambda v=v, x=x: cuda_cast.quantize_dim0_dim1(x, spec, variant=v),
                    2 * n + 2 * (n + n // 32),
                )
            q, s = cuda_cast.quantize_dim0(x, spec, variant=0)
            del x
            for v in variants("dequant"):
                run(
                    "dequant",
                    name,
                    mode,
                    v,
                    lambda v=v, q=q, s=s: cuda_cast.dequantize(q, s, 32, torch.bfloat16, variant=v),
                    cast_bytes,
                )
            del q, s
            torch.cuda.empty_cache()
        w = torch.randn((8, 2048, 7168), dtype=torch.bfloat16, device="cuda")
        n = w.numel()
        w2 = w.reshape(-1, 7168)
        for v in variants("dim0"):
            run(
                "3d axis=-1",
                "8x2048x7168",
                mode,
                v,
                lambda v=v, w2=w2: cuda_cast.quantize_dim0(w2, spec, variant=v),
                3 * n + n // 32,
            )
        for v in variants("dim1"):
            run(
                "3d axis=-2",
                "8x2048x7168",
                mode,
                v,
                lambda v=v, w=w: cuda_cast.quantize_dim1(w, spec, variant=v),
                3 * n + n // 32,
            )
        del w, w2
        torch.cuda.empty_cache()

    sweep("rceil", None)
    # floor for the best rceil variant of each cast (by mean % of copy over shapes)
    best: dict[str, int] = {}
    for cast in cuda_cast.NUM_VARIANTS:
        score: dict[int, list[float]] = {}
        for r in rows:
            if (
                r["cast"] == cast
                or (cast == "dim0" and r["cast"] == "3d axis=-1")
                or (cast == "dim1" and r["cast"] == "3d axis=-2")
            ):
                score.setdefault(r["variant"], []).append(r["% of copy"])
        best[cast] = max(score, key=lambda v: sum(score[v]) / len(score[v]))
    sweep("floor", best)
    rows.sort(key=lambda r: (r["cast"], r["shape"], r["mode"], r["variant"]))
    print_table(rows, title=f"CUDA cast variants (e4m3, block 32, bf16), copy {copy:.3f} TB/s")
    print(f"best variant per cast (mean % of copy, rceil): {best}")
    print(f"current DEFAULT_VARIANTS: {cuda_cast.DEFAULT_VARIANTS}")
    if args.json:
        write_json(args.json, {"env": environment(), "copy_tbs": copy, "best": best, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
