"""`mxmoe bench linear`: a linear layer's forward+backward, bf16 vs MX (each recipe).

The time split into casts alone and GEMMs alone, with the bf16 GEMM ceiling measured in the same
run."""

from __future__ import annotations

import torch

from mxmoe.bench import gemm_common
from mxmoe.bench.gemm_common import forward_rows, fwd_bwd_rows, rowwise_fp8

# (M tokens, K in, N out): DeepSeek-V3 expert-sized and Llama4 expert-sized projections.
SHAPES = [(131072, 7168, 2048), (131072, 2048, 7168), (131072, 5120, 8192), (131072, 8192, 5120)]


def run_shape(
    M: int, K: int, N: int, recipes: list[str], kernel: str, iters: int,
    gemm_backend: str = "emulated",
) -> list[dict]:
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * K**-0.5).requires_grad_()
    dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    return fwd_bwd_rows(f"{M}x{K}->{N}", x, w, dy, None, recipes, kernel, iters, gemm_backend)


def run_forward(M: int, K: int, N: int, kernel: str, iters: int) -> list[dict]:
    """y = x Wᵀ alone: bf16 torch.mm, fp8 row-wise torch._scaled_mm, MX (rceil) on pre-cast operands."""
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * K**-0.5
    xq, xs = rowwise_fp8(x)
    wq, ws = rowwise_fp8(w)

    def scaled(fast: bool):
        return torch._scaled_mm(xq, wq.t(), xs, ws.t(), out_dtype=torch.bfloat16, use_fast_accum=fast)

    return forward_rows(f"{M}x{K}->{N}", x, w, None, kernel, iters, scaled)


_CLI = {"name": "linear", "doc": __doc__, "pattern": "MxKxN", "example": "131072x7168x2048"}


def build_parser():
    return gemm_common.build_parser(**_CLI, forward=True)


def main(argv: list[str]) -> int:
    return gemm_common.main(argv, **_CLI, shapes=SHAPES, run_shape=run_shape, run_forward=run_forward)
