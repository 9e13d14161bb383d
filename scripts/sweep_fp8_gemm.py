"""Tile sweep of the fp8 MX GEMM (mxmoe/ops/fp8_gemm.py) on one GPU: forward TFLOP/s per config at
the issue's shapes, beside bf16 torch.mm / torch._grouped_mm measured in the same run.

    python scripts/sweep_fp8_gemm.py [--json PATH] [--iters N] [--configs 0 1 ...] [--warm P]

--warm P only compiles every (config, kind) in P processes at once, on small operands with the same
Triton specialization (sizes and strides multiples of 16, whole tiles), into Triton's cache; a later
run without it then times without compiling.

Prints one line per (shape, config) as it goes: ms, TFLOP/s, ratio to bf16, and whether the output
equals the first config's bit for bit (every config sums the same 32-blocks in the same order).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from mxmoe.bench.timing import bench, environment
from mxmoe.ops.fp8_gemm import Fp8GemmConfig, launch
from mxmoe.quant.mx_tensor import to_mx

C = Fp8GemmConfig
CONFIGS = [  # (bm, bn, bk, group_m, num_warps, num_stages, tma); 0 is DEFAULT_CONFIG
    C(128, 64, 128, 8, 4, 3),
    C(128, 128, 128, 8, 8, 3),
    C(128, 128, 64, 8, 8, 4),
    C(128, 128, 32, 8, 8, 6),
    C(64, 128, 128, 8, 4, 3),
    C(64, 128, 64, 8, 4, 4),
    C(128, 128, 128, 8, 8, 3, tma=True),
    C(128, 128, 64, 8, 8, 4, tma=True),
    C(64, 128, 64, 8, 4, 4, tma=True),
    C(64, 128, 32, 8, 4, 8),
    C(128, 64, 64, 8, 4, 4, tma=True),  # not yet measured: the two best ideas of the first sweep combined
    C(256, 64, 128, 8, 8, 3),
]
# (name, M or T, K, N, E): E = 0 dense; "wgrad" = 2D x 2D grouped over K (M x N per group).
SHAPES = [
    ("grouped", 65536, 7168, 2048, 8),
    ("grouped", 32768, 4096, 14336, 8),
    ("dense", 8192, 8192, 8192, 0),
    ("wgrad", 2048, 65536, 7168, 8),
]


def operands(kind: str, M: int, K: int, N: int, E: int):
    if kind == "wgrad":  # dW (N... here M x N) = dyᵀ x over each group's K tokens
        a = to_mx(torch.randn(M, K, device="cuda", dtype=torch.bfloat16), axis=-1, kernel="triton")
        b = to_mx(torch.randn(N, K, device="cuda", dtype=torch.bfloat16), axis=-1, kernel="triton")
        offs = torch.arange(1, E + 1, device="cuda", dtype=torch.int32) * (K // E)
        bf16 = (torch.randn(M, K, device="cuda", dtype=torch.bfloat16),
                torch.randn(K, N, device="cuda", dtype=torch.bfloat16))
        return a, b, offs, lambda: torch._grouped_mm(bf16[0], bf16[1], offs=offs)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    a = to_mx(x, axis=-1, kernel="triton")
    if E == 0:
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
        b = to_mx(w, axis=-1, kernel="triton")
        return a, b, None, lambda: x @ w.t()
    w = torch.randn(E, N, K, device="cuda", dtype=torch.bfloat16)
    b = to_mx(w, axis=-1, kernel="triton")
    offs = torch.arange(1, E + 1, device="cuda", dtype=torch.int32) * (M // E)
    return a, b, offs, lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)


def _compile_one(job: tuple[int, str]) -> str:
    ci, kind = job
    cfg = CONFIGS[ci]
    t0 = time.time()
    try:
        a, b, offs, _ = operands(kind, *SMALL[kind])
        launch(a.qdata_blocked, a.scale_blocked, b.qdata_blocked, b.scale_blocked, offs, torch.bfloat16, cfg)
        torch.cuda.synchronize()
        return f"compiled {kind} {cfg} in {time.time() - t0:.1f} s"
    except Exception as e:  # noqa: BLE001 - reported; the timing pass reports it again
        return f"FAILED {kind} {cfg}: {type(e).__name__}: {str(e)[:300]}"


# operands with the specialization of SHAPES (multiples of 16, whole 256-tiles, K % 128 == 0)
SMALL = {"grouped": (512, 512, 512, 8), "dense": (512, 512, 512, 0), "wgrad": (512, 1024, 512, 8)}


def warm(processes: int, configs: list[int], kinds: set[str]) -> None:
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    jobs = [(ci, kind) for kind in sorted(kinds) for ci in configs]
    t0 = time.time()
    with ProcessPoolExecutor(processes, mp_context=mp.get_context("spawn")) as pool:
        for line in pool.map(_compile_one, jobs):
            print(line, flush=True)
    print(f"warm: {len(jobs)} compiles in {time.time() - t0:.1f} s", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--json")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--configs", type=int, nargs="+", default=list(range(len(CONFIGS))))
    p.add_argument("--shapes", type=int, nargs="+", default=list(range(len(SHAPES))))
    p.add_argument("--warm", type=int, default=0, metavar="P", help="only compile, in P processes")
    args = p.parse_args()
    if args.warm:
        warm(args.warm, args.configs, {SHAPES[i][0] for i in args.shapes})
        return
    out = {"env": environment(), "rows": []}
    for si in args.shapes:
        kind, M, K, N, E = SHAPES[si]
        a, b, offs, bf16 = operands(kind, M, K, N, E)
        ops = (a.qdata_blocked, a.scale_blocked, b.qdata_blocked, b.scale_blocked)
        flops = 2 * M * K * N
        t_bf16 = bench(bf16, iters=args.iters).median_ms
        name = f"{kind} {M}x{K}->{N} E={E}"
        print(f"{name}: bf16 {t_bf16:.3f} ms {flops / t_bf16 / 1e9:.0f} TFLOP/s", flush=True)
        first = None
        for ci in args.configs:
            cfg = CONFIGS[ci]
            row = {"shape": name, "config": str(cfg), "bf16 ms": t_bf16}
            t0 = time.time()
            try:
                def fn(cfg=cfg, ops=ops, offs=offs):
                    return launch(*ops, offs, torch.bfloat16, cfg)
                y = fn()
                torch.cuda.synchronize()
                row["compile s"] = time.time() - t0
                if first is None:
                    first = y
                row["same as first config"] = bool(torch.equal(y, first))
                t = bench(fn, iters=args.iters).median_ms
                row.update({"ms": t, "TFLOP/s": flops / t / 1e9, "vs bf16": t_bf16 / t})
                del y
            except Exception as e:  # noqa: BLE001 - a config that does not compile is a result too
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            print(json.dumps(row), flush=True)
            out["rows"].append(row)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(out, f, indent=1)
        del a, b, ops, first
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
