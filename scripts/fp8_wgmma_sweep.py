"""Speed of the fp8 backend's Gluon kernel (mxmoe/ops/fp8_wgmma.py, `_fp8_ws_kernel`) on an sm_90
GPU, per tile config, beside bf16 (torch.mm / torch._grouped_mm) and torch's fp8 row-wise GEMM
(_scaled_mm / _scaled_grouped_mm, fast accumulation) on the same shapes: 8192^3, the two MoE forward
shapes of issue 15 and one wgrad (grouped-K) shape. Operands are random pre-cast MX tensors; the MX
time is `fp8_gemm.launch` (scale decoding included); every config's result is compared bit for bit
with the first's (the default). About a minute on an H200.

    python scripts/fp8_wgmma_sweep.py [--iters 10]
"""

from __future__ import annotations

import argparse
import sys

import torch

from mxmoe.bench.gemm_common import rowwise_fp8, timed_or_reason
from mxmoe.bench.timing import bench, require_cuda
from mxmoe.ops import fp8_gemm, fp8_wgmma
from mxmoe.ops.fp8_wgmma import WgmmaConfig

CONFIGS = [
    fp8_wgmma.DEFAULT_CONFIG,  # 128x128x128, 4 stages, persistent: the fastest or within 2 %
    WgmmaConfig(stages=5),  # a deeper ring
    WgmmaConfig(bn=64, bk=256, stages=3),  # narrower tile, two TMA boxes per operand and stage
    WgmmaConfig(persistent=False),  # one CTA per tile
]
# M, K, N, groups, grouped over K (wgrad: (M, T=K) x (N, T) -> (E, M, N))
SHAPES = [(8192, 8192, 8192, 0, False), (65536, 7168, 2048, 8, False), (32768, 4096, 14336, 8, False),
          (2048, 65536, 7168, 8, True)]


def operands(M, K, N, E, over_k):
    g = torch.Generator(device="cuda").manual_seed(0)
    nb = N if over_k else max(E, 1) * N
    a = torch.randint(-100, 100, (M, K), device="cuda", generator=g).to(torch.float8_e4m3fn)
    b = torch.randint(-100, 100, (nb, K), device="cuda", generator=g).to(torch.float8_e4m3fn)
    sa = torch.randint(120, 130, (M, K // 32), device="cuda", generator=g).to(torch.uint8)
    sb = torch.randint(120, 130, (nb, K // 32), device="cuda", generator=g).to(torch.uint8)
    sa, sb = sa.view(torch.float8_e8m0fnu), sb.view(torch.float8_e8m0fnu)
    offs = None
    if over_k:
        offs = (torch.linspace(K / E, K, E, device="cuda") / 32).round().to(torch.int32) * 32
    elif E:
        b, sb = b.view(E, N, K), sb.view(E, N, K // 32)
        offs = torch.linspace(M / E, M, E, device="cuda").round().to(torch.int32)
    return a, sa, b, sb, offs


def references(M, K, N, E, over_k, offs, iters):
    """(bf16 ms, fp8 row-wise ms or None) on bf16 / row-wise fp8 operands of the same shape."""
    if over_k:  # wgrad: (M, T) x (T, N) grouped over T, in the layouts of `mxmoe bench grouped_mm`
        x = torch.randn(K, M, device="cuda", dtype=torch.bfloat16).t()
        w = torch.randn(K, N, device="cuda", dtype=torch.bfloat16)
        return bench(lambda: torch._grouped_mm(x, w, offs=offs), iters=iters).median_ms, None
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(max(E, 1), N, K, device="cuda", dtype=torch.bfloat16)
    xq, xs = rowwise_fp8(x)
    wq, ws = rowwise_fp8(w)
    if E:
        t_bf16 = bench(lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs), iters=iters).median_ms
        t_fp8, _ = timed_or_reason(lambda: torch._scaled_grouped_mm(
            xq, wq.transpose(-2, -1), xs.squeeze(-1), ws.squeeze(-1), offs=offs,
            out_dtype=torch.bfloat16, use_fast_accum=True), iters)
    else:
        t_bf16 = bench(lambda: x @ w[0].t(), iters=iters).median_ms
        t_fp8, _ = timed_or_reason(lambda: torch._scaled_mm(
            xq, wq[0].t(), xs, ws[0].t(), out_dtype=torch.bfloat16, use_fast_accum=True), iters)
    return t_bf16, t_fp8


def sweep(M: int, K: int, N: int, E: int, over_k: bool, iters: int) -> None:
    flops = 2 * M * K * N
    a, sa, b, sb, offs = operands(M, K, N, E, over_k)
    t_bf16, t_fp8 = references(M, K, N, E, over_k, offs, iters)
    kind = "grouped over K (wgrad)" if over_k else (f"{E} groups" if E else "dense")
    line = f"{M}x{K}->{N} {kind}: bf16 {flops / t_bf16 / 1e9:.0f} TFLOP/s"
    if t_fp8:
        line += f", fp8 row-wise {flops / t_fp8 / 1e9:.0f} TFLOP/s = {t_bf16 / t_fp8:.2f}x bf16"
    print(line, flush=True)
    torch.cuda.empty_cache()
    ref = fp8_gemm.launch(a, sa, b, sb, offs, torch.float32, CONFIGS[0])
    for cfg in CONFIGS:  # (grouped K runs one CTA per tile and group whatever `persistent` says)
        try:
            same = torch.equal(fp8_gemm.launch(a, sa, b, sb, offs, torch.float32, cfg), ref)
            t = bench(lambda cfg=cfg: fp8_gemm.launch(a, sa, b, sb, offs, torch.bfloat16, cfg),
                      iters=iters).median_ms
            print(f"  MX fp8 {cfg}: {flops / t / 1e9:.0f} TFLOP/s = {t_bf16 / t:.2f}x bf16, "
                  f"same bits as the default: {same}", flush=True)
        except Exception as e:  # a config that fails to compile or launch: report, keep sweeping
            print(f"  MX fp8 {cfg}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--iters", type=int, default=10)
    args = p.parse_args(argv)
    require_cuda("fp8_wgmma_sweep")
    for shape in SHAPES:
        sweep(*shape, iters=args.iters)
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
