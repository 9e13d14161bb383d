"""The weight-cast work of one training step with and without `--mx.fsdp_mxfp8_all_gather`, on one
device, for a trainer config's MX weights at a simulated FSDP degree N (issue 58, item 4).

    python scripts/fsdp_mx_gather_cast.py --config moe_1b --world 8            # one GPU
    python scripts/fsdp_mx_gather_cast.py --config debug_moe --world 2 --device cpu --iters 3

Per step every MX weight (MXLinear.weight, MX experts' w1/w2/w3) is read by the forward GEMM cast
along its last dim and by the dgrad cast along dim -2 (the wgrad does not read it):
  without the option: both casts of the whole weight, in bf16 (what FSDP2 gathers on CUDA), each
    rank: the calls the GEMMs make (`weight_qdq` on the emulated backend, `weight_mx` on native);
  with it: each rank casts its 1/N shard both ways (what `fsdp_pre_all_gather` sends: the forward's
    gather and the backward's) and the GEMMs take the gathered MX weight (`weight_qdq` dequantizes
    it on the emulated backend; the dgrad's layout of a 2D weight is transposed on use).
Weights whose shards do not hold whole blocks at N are cast as without the option (as training
does). Prints ms per step of each part (median of --iters; CUDA: mxmoe.bench.timing.bench) and the
MX weights' bytes a rank hands to a step's all-gathers: bf16 and MXFP8.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from mxmoe.nn.fsdp import MXShardedWeight, mx_weights, shard_blocks_ok
from mxmoe.ops.gemm_backend import op_kernels
from mxmoe.ops.linear import weight_mx, weight_qdq
from mxmoe.quant.gathered import MXGatheredWeight
from mxmoe.quant.mx_tensor import to_mx
from mxmoe.train import parallel
from mxmoe.train.build import build_model
from mxmoe.train.config import load_toml


def timed(fn, device: torch.device, iters: int) -> float:
    """Median ms of fn()."""
    if device.type == "cuda":
        from mxmoe.bench.timing import bench

        return bench(fn, warmup=3, iters=iters).median_ms
    fn()
    runs = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        runs.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(runs)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="moe_1b")
    ap.add_argument("--world", type=int, default=8, help="the simulated FSDP degree N")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args(argv)
    if args.world < 1:
        raise SystemExit(f"--world={args.world}: expected an int >= 1")
    device = torch.device(args.device)
    cfg = load_toml(args.config)
    cfg.model.converters = ["mx"]
    model = build_model(cfg, device, parallel.make_parallel_dims(1, 1, 1, 1), mx=True)
    whole, shards, gathered, rest = [], [], [], []
    n_mx = n_hp = 0
    bytes_bf16 = bytes_mx = 0
    for _, m, attr in mx_weights(model):
        w = getattr(m, attr).detach().to(torch.bfloat16)
        r, k = m.recipe, op_kernels(m.recipe, device)
        if k.qdq:
            def call(w, a, r=r, k=k):
                return weight_qdq(w, a, r, k)
        else:
            def call(w, a, r=r):
                return weight_mx(w, a, r)
        rows = w.shape[0] // args.world
        bytes_bf16 += 2 * 2 * rows * w[0].numel()  # the forward's and the backward's gathers
        if shard_blocks_ok(tuple(w.shape), args.world, r.block_size) is not None:
            whole.append((call, w))
            rest.append((call, w))
            n_hp += 1
            bytes_mx += 2 * 2 * rows * w[0].numel()
            continue
        n_mx += 1
        whole.append((call, w))
        shards.append(MXShardedWeight(w[:rows].clone(), r))
        d0, d1 = to_mx(w, -1, recipe=r), to_mx(w, -2, recipe=r)
        q1, s1 = d1.qdata_blocked, d1.scale_blocked
        if w.ndim == 2:  # as gathered: (N, K) elements, (N/32, K) scales
            q1, s1 = q1.t().contiguous(), s1.t().contiguous()
        g0 = MXGatheredWeight(w.shape, w.dtype, d0.qdata_blocked, d0.scale_blocked, "dim0", r.fmt.name)
        g1 = MXGatheredWeight(w.shape, w.dtype, q1, s1, "dim1", r.fmt.name)
        gathered.append((call, g0, g1))
        # elements, scales and the one-byte layout tag, in each of the two gathers
        bytes_mx += 2 * (rows * w[0].numel() + d0.scale_blocked.numel() // args.world + 1)

    def today():
        for call, w in whole:
            call(w, -1)
            call(w, -2)

    def option_shards():
        for s in shards:
            s._cast("dim0", torch.bfloat16)
            s._cast("dim1", torch.bfloat16)

    def option_use():
        for call, g0, g1 in gathered:
            call(g0, -1)
            call(g1, -2)

    def option_rest():
        for call, w in rest:
            call(w, -1)
            call(w, -2)

    with torch.no_grad():
        t_today = timed(today, device, args.iters)
        t_shards = timed(option_shards, device, args.iters)
        t_use = timed(option_use, device, args.iters)
        t_rest = timed(option_rest, device, args.iters) if rest else 0.0
    res = {
        "config": args.config, "world": args.world, "device": str(device),
        "mx_weights_mxfp8_gather": n_mx, "mx_weights_high_precision_gather": n_hp,
        "today_ms": t_today, "option_shard_casts_ms": t_shards, "option_gathered_use_ms": t_use,
        "option_other_weights_ms": t_rest, "option_total_ms": t_shards + t_use + t_rest,
        "gather_bytes_bf16": bytes_bf16, "gather_bytes_mxfp8": bytes_mx,
    }
    for k, v in res.items():
        print(f"{k:34s} {v:.3f}" if isinstance(v, float) else f"{k:34s} {v}")
    return res


if __name__ == "__main__":
    main()
