"""A/B of the emulated GEMM's operand path, same process, same inputs: the MX path (quantize to fp8,
write, read back, dequantize) vs the fused quantize-dequantize path (mxmoe.quant.qdq), the latter
also inside `cache_weight_casts()` (weight casts reused; here 2 micro-batches per scope), for
mx_mm and mx_grouped_mm forward+backward. Results are checked bit-identical first.

    python scripts/qdq_gemm_ab.py                # CPU: host µs per call at small shapes
    python scripts/qdq_gemm_ab.py --device cuda  # GPU: small shapes (host cost) and GPU-bound
                                                 # shapes (wall time with a device sync)

Prints one table (op, shape, best time per fwd+bwd of each path, ratios to the MX path). The MX
path is selected by emptying `mxmoe.ops.gemm.QDQ_BACKENDS` for its runs (the path non-emulated backends take).
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch

import mxmoe.ops.gemm as gemm_mod
from mxmoe.ops import cache_weight_casts, mx_grouped_mm, mx_mm
from mxmoe.recipe import recipe


@contextlib.contextmanager
def mx_path(on: bool):
    saved = gemm_mod.QDQ_BACKENDS
    gemm_mod.QDQ_BACKENDS = frozenset() if on else saved
    try:
        yield
    finally:
        gemm_mod.QDQ_BACKENDS = saved


def make_linear(M, K, N, dev):
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(N, K, device=dev, dtype=torch.bfloat16) * K**-0.5)
    dy = torch.randn(M, N, device=dev, dtype=torch.bfloat16)
    return lambda cfg: (mx_mm(x, w.t(), cfg).backward(dy), (x, w))[1]


def make_grouped(T, K, N, E, dev):
    a = torch.randn(T, K, device=dev, dtype=torch.bfloat16, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(E, N, K, device=dev, dtype=torch.bfloat16) * K**-0.5)
    dy = torch.randn(T, N, device=dev, dtype=torch.bfloat16)
    counts = torch.full((E,), T // E, dtype=torch.int64)
    counts[-1] += T - int(counts.sum())
    offs = counts.cumsum(0).to(torch.int32).to(dev)
    return lambda cfg: (mx_grouped_mm(a, w.transpose(-2, -1), offs, cfg).backward(dy), (a, w))[1]


def timed(step, cfg, dev, iters, cached):
    """Best time per fwd+bwd (µs) over `iters` scopes (the minimum: robust to other load on the
    machine), wall time with a device sync; with `cached`, each scope of cache_weight_casts() runs
    2 steps (2 micro-batches), otherwise 2 steps as well."""
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    times = []
    for i in range(iters + 3):
        scope = cache_weight_casts() if cached else contextlib.nullcontext()
        with scope:
            sync()
            t0 = time.perf_counter()
            for _ in range(2):
                step(cfg)
            sync()
        if i >= 3:
            times.append((time.perf_counter() - t0) / 2 * 1e6)
    return min(times)


def grads(step, cfg):
    ts = step(cfg)
    out = [t.grad.clone() for t in ts]
    for t in ts:
        t.grad = None
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--iters", type=int, default=50)
    args = p.parse_args()
    dev = args.device
    if dev == "cpu":
        torch.set_num_threads(1)  # host cost, not CPU GEMM threading
    cfg = recipe("mxfp8_rceil")  # emulated GEMM in bf16 on CUDA, fp32 on CPU
    cases = [("mx_mm", "64x128->128", make_linear(64, 128, 128, dev)),
             ("mx_grouped_mm", "64x128->128, 4 groups", make_grouped(64, 128, 128, 4, dev))]
    if dev == "cuda":
        cases += [("mx_mm", "16384x4096->4096", make_linear(16384, 4096, 4096, dev)),
                  ("mx_grouped_mm", "65536x7168->2048, 8 groups", make_grouped(65536, 7168, 2048, 8, dev))]
    print(f"{'op':<15}{'shape':<30}{'MX path µs':>12}{'qdq µs':>10}{'qdq+cache µs':>14}{'qdq/MX':>8}"
          f"{'cache/MX':>10}")
    for op, shape, step in cases:
        with mx_path(True):
            ref = grads(step, cfg)
        for g, r in zip(grads(step, cfg), ref, strict=True):
            assert torch.equal(g, r), f"{op} {shape}: qdq path differs from the MX path"
        with mx_path(True):
            t_mx = timed(step, cfg, dev, args.iters, cached=False)
        t_q = timed(step, cfg, dev, args.iters, cached=False)
        t_c = timed(step, cfg, dev, args.iters, cached=True)
        ratios = f"{t_q / t_mx:>8.2f}{t_c / t_mx:>10.2f}"
        print(f"{op:<15}{shape:<30}{t_mx:>12.0f}{t_q:>10.0f}{t_c:>14.0f}{ratios}")


if __name__ == "__main__":
    main()
