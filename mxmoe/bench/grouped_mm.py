"""`mxmoe bench grouped_mm`: forward+backward of an MoE grouped GEMM, bf16 torch._grouped_mm vs
mx_grouped_mm (each recipe), split into casts alone and GEMMs alone, bf16 GEMM ceiling measured in
the same run."""

from __future__ import annotations

import torch

from mxmoe.bench import gemm_common
from mxmoe.bench.gemm_common import forward_row, row, rowwise_fp8, timed_or_reason
from mxmoe.bench.timing import bench
from mxmoe.recipe import RECIPES as NAMED

# (T tokens, K in, N out, E experts): DeepSeek-V3 w1 (7168 -> 2048) and w2, Llama4 (5120 <-> 8192).
SHAPES = [(65536, 7168, 2048, 8), (65536, 2048, 7168, 8), (65536, 5120, 8192, 8), (65536, 8192, 5120, 8)]


def run_shape(
    T: int, K: int, N: int, E: int, recipes: list[str], kernel: str, iters: int,
    gemm_backend: str = "emulated",
) -> list[dict]:
    from mxmoe.ops import mx_grouped_mm
    from mxmoe.ops.gemm import hp_gemm
    from mxmoe.quant.qdq import qdq, qdq_dim0_dim1

    a = torch.randn(T, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(E, N, K, device="cuda", dtype=torch.bfloat16) * K**-0.5).requires_grad_()
    dy = torch.randn(T, N, device="cuda", dtype=torch.bfloat16)
    offs = torch.full((E,), T // E, device="cuda", dtype=torch.int32).cumsum(0, dtype=torch.int32)
    offs[-1] = T
    flops = 6 * T * K * N
    name = f"{T}x{K}->{N}, {E} groups"

    def bf16_step():
        torch._grouped_mm(a, w.transpose(-2, -1), offs=offs).backward(dy)

    def bf16_gemms():
        ad, wd = a.detach(), w.detach()
        torch._grouped_mm(ad, wd.transpose(-2, -1), offs=offs)
        torch._grouped_mm(dy, wd, offs=offs)
        torch._grouped_mm(dy.t(), ad, offs=offs)

    t_bf16 = bench(bf16_step, iters=iters).median_ms
    t_bf16_gemm = bench(bf16_gemms, iters=iters).median_ms
    rows = [row(name, "bf16", t_bf16, t_bf16, flops, 0.0, t_bf16_gemm)]
    bf = torch.bfloat16
    for recipe in recipes:
        cfg = NAMED[recipe].replace(dim0_kernel=kernel, dim1_kernel=kernel, gemm_backend=gemm_backend)

        def mx_step(cfg=cfg):
            mx_grouped_mm(a, w.transpose(-2, -1), offs, cfg).backward(dy)

        # the emulated GEMM's operand casts (fused quantize-dequantize), as mx_grouped_mm runs them
        def cast_all(cfg=cfg):  # a and dy: along K / N, and along M per group, one read each
            a0, a1 = qdq_dim0_dim1(a.detach(), recipe=cfg, out_dtype=bf, offs=offs)
            w0 = qdq(w.detach(), -1, recipe=cfg, out_dtype=bf)
            dy0, dy1 = qdq_dim0_dim1(dy, recipe=cfg, out_dtype=bf, offs=offs)
            w1 = qdq(w.detach(), -2, recipe=cfg, out_dtype=bf)
            return a0, a1, w0, dy0, dy1, w1

        a0, a1, w0, dy0, dy1, w1 = cast_all()

        def gemms(a0=a0, a1=a1, w0=w0, dy0=dy0, dy1=dy1, w1=w1):
            hp_gemm(a0, w0.transpose(-2, -1), offs, bf)
            hp_gemm(dy0, w1, offs, bf)
            hp_gemm(dy1.t(), a1, offs, bf)

        t = bench(mx_step, iters=iters).median_ms
        emulated = gemm_backend == "emulated"  # the split below is the emulated path's
        tc = bench(cast_all, iters=iters).median_ms if emulated else float("nan")
        tg = bench(gemms, iters=iters).median_ms if emulated else float("nan")
        rows.append(row(name, recipe, t, t_bf16, flops, tc, tg))
        del a0, a1, w0, dy0, dy1, w1
    a.grad = w.grad = None
    return rows


def run_forward(T: int, K: int, N: int, E: int, kernel: str, iters: int) -> list[dict]:
    """y = a Wₑᵀ per group alone: bf16 torch._grouped_mm, fp8 row-wise torch._scaled_grouped_mm,
    MX (rceil) on pre-cast operands; E equal groups."""
    from mxmoe.ops import mx_gemm
    from mxmoe.quant.mx_tensor import to_mx

    a = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(E, N, K, device="cuda", dtype=torch.bfloat16) * K**-0.5
    offs = torch.full((E,), T // E, device="cuda", dtype=torch.int32).cumsum(0, dtype=torch.int32)
    offs[-1] = T
    flops, name = 2 * T * K * N, f"{T}x{K}->{N}, {E} groups"
    t_bf16 = bench(lambda: torch._grouped_mm(a, w.transpose(-2, -1), offs=offs), iters=iters).median_ms
    rows = [forward_row(name, "bf16 torch._grouped_mm", t_bf16, t_bf16, flops)]
    aq, as_ = rowwise_fp8(a)
    wq, ws = rowwise_fp8(w)
    for fast in (True, False):
        t, why = timed_or_reason(
            lambda fast=fast: torch._scaled_grouped_mm(
                aq, wq.transpose(-2, -1), as_.squeeze(-1), ws.squeeze(-1), offs=offs,
                out_dtype=torch.bfloat16, use_fast_accum=fast,
            ),
            iters,
        )
        rows.append(
            forward_row(name, f"fp8 row-wise _scaled_grouped_mm fast_accum={fast}", t, t_bf16, flops, why)
        )
    a0 = to_mx(a, axis=-1, kernel=kernel)
    w0 = to_mx(w.transpose(-2, -1), axis=-2, kernel=kernel)
    for backend in ("emulated", "fp8"):
        r = NAMED["mxfp8_rceil"].replace(dim0_kernel=kernel, gemm_backend=backend)
        t, why = timed_or_reason(
            lambda r=r: mx_gemm(a0, w0, offs, recipe=r),
            iters,
        )
        rows.append(forward_row(name, f"mxfp8_rceil mx_gemm {backend}", t, t_bf16, flops, why))
    return rows


def main(argv: list[str]) -> int:
    return gemm_common.main(
        argv,
        name="grouped_mm",
        doc=__doc__,
        pattern="TxKxNxE",
        example="65536x7168x2048x8",
        shapes=SHAPES,
        run_shape=run_shape,
        run_forward=run_forward,
    )
