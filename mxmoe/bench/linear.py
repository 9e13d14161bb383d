"""`mxmoe bench linear`: forward+backward of a linear layer, bf16 vs MX (each recipe), with the
time split into casts alone and GEMMs alone, and the bf16 GEMM ceiling measured in the same run."""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from mxmoe.bench.timing import bench, bf16_gemm_tflops, environment, print_table, require_cuda, write_json

RECIPES = {"mxfp8": "floor", "mxfp8_rceil": "rceil"}
# (M tokens, K in, N out): DeepSeek-V3 expert-sized and Llama4 expert-sized projections.
SHAPES = [(131072, 7168, 2048), (131072, 2048, 7168), (131072, 5120, 8192), (131072, 8192, 5120)]


def _parse_shape(s: str) -> tuple[int, int, int]:
    try:
        m, k, n = (int(v) for v in s.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"shape {s!r}: expected MxKxN, e.g. 131072x7168x2048") from None
    return m, k, n


def run_shape(M: int, K: int, N: int, recipes: list[str], kernel: str, iters: int) -> list[dict]:
    from mxmoe.ops import MXOpConfig, mx_gemm, mx_mm
    from mxmoe.ops.linear import cast_both, transpose_2d
    from mxmoe.quant.mx_tensor import to_mx

    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * K**-0.5).requires_grad_()
    dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    flops = 6 * M * K * N

    def bf16_step():
        F.linear(x, w).backward(dy)

    def bf16_gemms():
        xd, wd = x.detach(), w.detach()
        xd @ wd.t(), dy @ wd, dy.t() @ xd

    t_bf16 = bench(bf16_step, iters=iters).median_ms
    t_bf16_gemm = bench(bf16_gemms, iters=iters).median_ms
    rows = [
        {
            "shape": f"{M}x{K}->{N}",
            "recipe": "bf16",
            "fwd+bwd ms": t_bf16,
            "TFLOP/s": flops / t_bf16 / 1e9,
            "vs bf16": 1.0,
            "casts ms": 0.0,
            "gemms ms": t_bf16_gemm,
            "cast share": 0.0,
        }
    ]
    for recipe in recipes:
        cfg = MXOpConfig(scaling_mode=RECIPES[recipe], kernel=kernel, dim1_kernel=kernel)
        ck = cfg.cast_kwargs()

        def mx_step(cfg=cfg):
            mx_mm(x, w.t(), cfg).backward(dy)

        def casts(cfg=cfg, ck=ck):
            cast_both(x.detach(), cfg)  # forward: x both ways
            to_mx(w.detach().t(), axis=0, **ck)  # forward: W along K
            cast_both(dy, cfg)  # backward: dy both ways
            to_mx(w.detach(), axis=0, **cfg.cast_kwargs(dim1=True))  # backward: W along N

        x0, x1 = cast_both(x.detach(), cfg)
        w0 = to_mx(w.detach().t(), axis=0, **ck)
        dy0, dy1 = cast_both(dy, cfg)
        w1 = to_mx(w.detach(), axis=0, **cfg.cast_kwargs(dim1=True))

        def gemms(cfg=cfg, x0=x0, x1=x1, w0=w0, dy0=dy0, dy1=dy1, w1=w1):
            kw = {"kernel": cfg.kernel}
            mx_gemm(x0, w0, **kw), mx_gemm(dy0, w1, **kw), mx_gemm(transpose_2d(dy1), x1, **kw)

        t = bench(mx_step, iters=iters).median_ms
        tc = bench(casts, iters=iters).median_ms
        tg = bench(gemms, iters=iters).median_ms
        rows.append(
            {
                "shape": f"{M}x{K}->{N}",
                "recipe": recipe,
                "fwd+bwd ms": t,
                "TFLOP/s": flops / t / 1e9,
                "vs bf16": t_bf16 / t,
                "casts ms": tc,
                "gemms ms": tg,
                "cast share": tc / t,
            }
        )
        del x0, x1, w0, dy0, dy1, w1
    x.grad = w.grad = None
    return rows


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="mxmoe bench linear", description=__doc__)
    p.add_argument(
        "--shape", type=_parse_shape, action="append", help="MxKxN (repeatable); default: MoE shapes"
    )
    p.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    p.add_argument("--kernel", default="auto", help="cast kernel: auto | torch | triton | cuda")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--json", metavar="PATH", help="also write the rows and the environment as JSON")
    args = p.parse_args(argv)
    require_cuda("mxmoe bench linear")
    ceiling = bf16_gemm_tflops()
    rows = []
    for M, K, N in args.shape or SHAPES:
        rows += run_shape(M, K, N, args.recipes, args.kernel, args.iters)
        torch.cuda.empty_cache()
    print_table(rows, title=f"linear fwd+bwd (3 GEMMs); bf16 GEMM ceiling 8192^3: {ceiling:.0f} TFLOP/s")
    if args.json:
        write_json(args.json, {"env": environment(), "bf16_gemm_tflops": ceiling, "rows": rows})
    return 0
