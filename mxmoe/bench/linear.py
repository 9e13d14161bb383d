"""`mxmoe bench linear`: forward+backward of a linear layer, bf16 vs MX (each recipe), with the
time split into casts alone and GEMMs alone, and the bf16 GEMM ceiling measured in the same run."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mxmoe.bench import gemm_common
from mxmoe.bench.gemm_common import forward_row, row, rowwise_fp8, timed_or_reason
from mxmoe.bench.timing import bench
from mxmoe.recipe import RECIPES as NAMED

# (M tokens, K in, N out): DeepSeek-V3 expert-sized and Llama4 expert-sized projections.
SHAPES = [(131072, 7168, 2048), (131072, 2048, 7168), (131072, 5120, 8192), (131072, 8192, 5120)]


def run_shape(
    M: int, K: int, N: int, recipes: list[str], kernel: str, iters: int,
    gemm_backend: str = "emulated",
) -> list[dict]:
    from mxmoe.ops import mx_mm
    from mxmoe.ops.gemm import hp_gemm
    from mxmoe.quant.qdq import qdq, qdq_dim0_dim1

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
    rows = [row(f"{M}x{K}->{N}", "bf16", t_bf16, t_bf16, flops, 0.0, t_bf16_gemm)]
    bf = torch.bfloat16
    for recipe in recipes:
        cfg = NAMED[recipe].replace(dim0_kernel=kernel, dim1_kernel=kernel, gemm_backend=gemm_backend)

        def mx_step(cfg=cfg):
            mx_mm(x, w.t(), cfg).backward(dy)

        # the emulated GEMM's operand casts (fused quantize-dequantize), as mx_mm runs them
        def casts(cfg=cfg):
            x0, x1 = qdq_dim0_dim1(x.detach(), recipe=cfg, out_dtype=bf)  # x both ways
            w0 = qdq(w.detach(), -1, recipe=cfg, out_dtype=bf)  # forward: W along K
            dy0, dy1 = qdq_dim0_dim1(dy, recipe=cfg, out_dtype=bf)  # dy both ways
            w1 = qdq(w.detach(), -2, recipe=cfg, out_dtype=bf)  # backward: W along N
            return x0, x1, w0, dy0, dy1, w1

        x0, x1, w0, dy0, dy1, w1 = casts()

        def gemms(x0=x0, x1=x1, w0=w0, dy0=dy0, dy1=dy1, w1=w1):
            hp_gemm(x0, w0.t(), None, bf), hp_gemm(dy0, w1, None, bf), hp_gemm(dy1.t(), x1, None, bf)

        t = bench(mx_step, iters=iters).median_ms
        emulated = gemm_backend == "emulated"  # the split below is the emulated path's
        tc = bench(casts, iters=iters).median_ms if emulated else float("nan")
        tg = bench(gemms, iters=iters).median_ms if emulated else float("nan")
        rows.append(row(f"{M}x{K}->{N}", recipe, t, t_bf16, flops, tc, tg))
        del x0, x1, w0, dy0, dy1, w1
    x.grad = w.grad = None
    return rows


def run_forward(M: int, K: int, N: int, kernel: str, iters: int) -> list[dict]:
    """y = x Wᵀ alone: bf16 torch.mm, fp8 row-wise torch._scaled_mm, MX (rceil) on pre-cast operands."""
    from mxmoe.ops import mx_gemm
    from mxmoe.quant.mx_tensor import to_mx

    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * K**-0.5
    flops, name = 2 * M * K * N, f"{M}x{K}->{N}"
    t_bf16 = bench(lambda: x @ w.t(), iters=iters).median_ms
    rows = [forward_row(name, "bf16 torch.mm", t_bf16, t_bf16, flops)]
    xq, xs = rowwise_fp8(x)
    wq, ws = rowwise_fp8(w)
    for fast in (True, False):
        t, why = timed_or_reason(
            lambda fast=fast: torch._scaled_mm(
                xq, wq.t(), xs, ws.t(), out_dtype=torch.bfloat16, use_fast_accum=fast
            ),
            iters,
        )
        rows.append(forward_row(name, f"fp8 row-wise _scaled_mm fast_accum={fast}", t, t_bf16, flops, why))
    x0 = to_mx(x, axis=-1, kernel=kernel)
    w0 = to_mx(w.t(), axis=0, kernel=kernel)
    for backend in ("emulated", "fp8"):
        r = NAMED["mxfp8_rceil"].replace(dim0_kernel=kernel, gemm_backend=backend)
        t, why = timed_or_reason(
            lambda r=r: mx_gemm(x0, w0, recipe=r),
            iters,
        )
        rows.append(forward_row(name, f"mxfp8_rceil mx_gemm {backend}", t, t_bf16, flops, why))
    return rows


def main(argv: list[str]) -> int:
    return gemm_common.main(
        argv,
        name="linear",
        doc=__doc__,
        pattern="MxKxN",
        example="131072x7168x2048",
        shapes=SHAPES,
        run_shape=run_shape,
        run_forward=run_forward,
    )
