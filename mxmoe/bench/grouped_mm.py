"""`mxmoe bench grouped_mm`: an MoE grouped GEMM's forward+backward, bf16 vs MX (each recipe).

bf16 torch._grouped_mm vs mx_grouped_mm, the time split into casts alone and GEMMs alone, with the
bf16 GEMM ceiling measured in the same run."""

from __future__ import annotations

import torch

from mxmoe.bench import gemm_common
from mxmoe.bench.gemm_common import forward_rows, fwd_bwd_rows, rowwise_fp8

# (T tokens, K in, N out, E experts): DeepSeek-V3 w1 (7168 -> 2048) and w2, Llama4 (5120 <-> 8192).
SHAPES = [(65536, 7168, 2048, 8), (65536, 2048, 7168, 8), (65536, 5120, 8192, 8), (65536, 8192, 5120, 8)]


def _offs(T: int, E: int) -> torch.Tensor:
    """(E,) int32 ends of E equal groups of T rows (the last one takes the remainder)."""
    offs = torch.full((E,), T // E, device="cuda", dtype=torch.int32).cumsum(0, dtype=torch.int32)
    offs[-1] = T
    return offs


def run_shape(
    T: int, K: int, N: int, E: int, recipes: list[str], kernel: str, iters: int,
    gemm_backend: str = "emulated",
) -> list[dict]:
    a = torch.randn(T, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(E, N, K, device="cuda", dtype=torch.bfloat16) * K**-0.5).requires_grad_()
    dy = torch.randn(T, N, device="cuda", dtype=torch.bfloat16)
    name = f"{T}x{K}->{N}, {E} groups"
    return fwd_bwd_rows(name, a, w, dy, _offs(T, E), recipes, kernel, iters, gemm_backend)


def run_forward(T: int, K: int, N: int, E: int, kernel: str, iters: int) -> list[dict]:
    """y = a Wₑᵀ per group alone: bf16 torch._grouped_mm, fp8 row-wise torch._scaled_grouped_mm,
    MX (rceil) on pre-cast operands; E equal groups."""
    a = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(E, N, K, device="cuda", dtype=torch.bfloat16) * K**-0.5
    offs = _offs(T, E)
    aq, as_ = rowwise_fp8(a)
    wq, ws = rowwise_fp8(w)

    def scaled(fast: bool):
        return torch._scaled_grouped_mm(
            aq, wq.transpose(-2, -1), as_.squeeze(-1), ws.squeeze(-1), offs=offs,
            out_dtype=torch.bfloat16, use_fast_accum=fast,
        )

    return forward_rows(f"{T}x{K}->{N}, {E} groups", a, w, offs, kernel, iters, scaled)


_CLI = {"name": "grouped_mm", "doc": __doc__, "pattern": "TxKxNxE", "example": "65536x7168x2048x8"}


def build_parser():
    return gemm_common.build_parser(**_CLI, forward=True)


def main(argv: list[str]) -> int:
    return gemm_common.main(argv, **_CLI, shapes=SHAPES, run_shape=run_shape, run_forward=run_forward)
