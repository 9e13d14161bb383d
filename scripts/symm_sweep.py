"""The symmetric-memory exchange kernel's schedule constants, measured (2+ GPUs of one host).

    torchrun --standalone --nproc-per-node 2 scripts/symm_sweep.py [--batches 16,4] [--dim 5120]

For each shape (batch x 8192 tokens of `dim` bf16 per rank, equal splits) prints the bf16 NCCL
all-to-all forward and the MXFP8 symm forward (`to_mxfp8_a2a_dequant`, transport="symm", check=False)
for every (ITEM_TILES, store tile, receive tile, RECV_DELAY, programs per SM, fast bit): work items
of ITEM_TILES flag tiles of 8192 elements (one ticket, and for a store one system-scope fence, per
item), store items quantize register tiles of `store tile` blocks of 32 (64: 8-byte NVLink element
stores a thread, 128: 16-byte ones), receive items dequantize register tiles of `receive tile`
blocks (symm._RECV_SUB_BLOCKS for bf16: 64 or 128), receives start after 1/RECV_DELAY of the stores
(1: after all of them), the kernel runs programs-per-SM x SMs programs, and with the fast bit
(symm._FAST_BIT_FLAGS) the flags say whether an item's scales allow the dequantize's fast path
(receives read each scale once and reduce nothing across warps). The tuples below: 24
configurations a shape, 48 for --batches 16,4 (12 kernel builds; estimated two to three minutes on
2 H200s, not measured). Median
ms over 30 runs, maximum over ranks (mxmoe.bench.timing.bench), and the ratio bf16 / MXFP8. Each
configuration is first checked bit for bit against `reference_mxfp8_a2a` on the same rows (normal
rows, with a NaN, an Inf, a zero and a tiny block in the rows for the next rank). Then, with the
module's own constants, the stages alone, on one pair's share of rows (rows / world): the same kernel when
every rank keeps them (own tiles only) and when every rank sends them to the next rank (stores and
receives only).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import os

import torch
import torch.distributed as dist

from mxmoe.bench.timing import bench
from mxmoe.comm import a2a_unquantized, reference_mxfp8_a2a, symm, to_mxfp8_a2a_dequant

ITEMS = (None, 4, 8)  # symm.ITEM_TILES (None: by size, the default; 1 and 2 were slower than 4)
STORE_SUBS = (128,)  # symm._STORE_SUB_BLOCKS (64 was slower than 128)
RECV_SUBS = (64, 128)  # symm._RECV_SUB_BLOCKS[torch.bfloat16]
DELAYS = (4,)  # symm.RECV_DELAY (1 was slower than 4)
PROGS = (2, 3)  # at 80 registers a program, three fit on an SM (one was far slower)
FAST_BITS = (False, True)  # symm._FAST_BIT_FLAGS


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="16,4")
    ap.add_argument("--dim", type=int, default=5120)
    args = ap.parse_args()
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=60), device_id=dev)
    world = dist.get_world_size()
    default = (symm.ITEM_TILES, symm._STORE_SUB_BLOCKS, symm.RECV_DELAY, symm._PROGS_PER_SM,
               symm._FAST_BIT_FLAGS, symm._RECV_SUB_BLOCKS)
    ws = symm.SymmWorkspace.get(None, dev)
    inexact = 0  # configurations whose output differed from the reference on some rank
    for b in (int(v) for v in args.batches.split(",")):
        rows = b * 8192
        splits = [rows // world] * world
        x = torch.randn(rows, args.dim, device="cuda", dtype=torch.bfloat16)
        # a few awkward blocks in the rows for the next rank (so the exactness check covers them on
        # the NVLink path): NaN, Inf, zeros and tiny scales (the dequantize's integer path)
        p0 = (rank + 1) % world * (rows // world)
        x[p0 + 3, 5], x[p0 + 1000, 40] = float("nan"), float("inf")
        x[p0 + 2000, :64] = 0.0
        x[p0 + 3000, 64:96] *= 2.0**-140
        ref = reference_mxfp8_a2a(x, splits, splits)
        bf = bench(lambda t, s=splits: a2a_unquantized(t, s, s, check=False), [(x,)], warmup=5, iters=30)
        if rank == 0:
            print(f"{b}x8192x{args.dim}: bf16 {bf.median_ms:.3f} ms", flush=True)
        configs = itertools.product(ITEMS, STORE_SUBS, RECV_SUBS, DELAYS, PROGS, FAST_BITS)
        for item, sub, rsub, delay, progs, fast in configs:
            symm.ITEM_TILES, symm._STORE_SUB_BLOCKS = item, sub
            symm.RECV_DELAY, symm._PROGS_PER_SM, symm._FAST_BIT_FLAGS = delay, progs, fast
            symm._RECV_SUB_BLOCKS = {**default[5], torch.bfloat16: rsub}
            ws.__dict__.pop("_items", None)  # the item tables hold the item size and delay

            def mx(t, s=splits):
                return to_mxfp8_a2a_dequant(t, s, s, check=False, transport="symm")

            # every rank's output against the reference: rank 0 prints, and a miss on any rank counts
            flag = torch.tensor(int(torch.equal(mx(x).view(torch.int16), ref.view(torch.int16))), device=dev)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            exact = bool(flag)
            inexact += not exact
            t = bench(mx, [(x,)], warmup=5, iters=30)
            if rank == 0:
                print(
                    f"  ITEM_TILES={str(item):<4} store tile={sub:<3} receive tile={rsub:<3} "
                    f"RECV_DELAY={delay:<2} progs/SM={progs} fast bit={int(fast)}: "
                    f"{t.median_ms:.3f} ms "
                    f"({bf.median_ms / t.median_ms:.2f}x bf16){'' if exact else '  NOT EXACT'}",
                    flush=True,
                )
        (symm.ITEM_TILES, symm._STORE_SUB_BLOCKS, symm.RECV_DELAY, symm._PROGS_PER_SM,
         symm._FAST_BIT_FLAGS, symm._RECV_SUB_BLOCKS) = default
        ws.__dict__.pop("_items", None)
        n = rows // world  # as many rows as one pair of the equal split
        own = [n if p == rank else 0 for p in range(world)]
        ins = [n if p == (rank + 1) % world else 0 for p in range(world)]
        outs = [n if p == (rank - 1) % world else 0 for p in range(world)]
        for name, i, o in (("own rows only", own, own), ("peer rows only", ins, outs)):
            t = bench(lambda t, i=i, o=o: to_mxfp8_a2a_dequant(t, o, i, check=False, transport="symm"),
                      [(x[:n],)], warmup=5, iters=30)
            if rank == 0:
                it, sb, d, pr, fb, rs = default
                print(f"  {name} (ITEM_TILES={it}, store tile={sb}, receive tile={rs[torch.bfloat16]}, "
                      f"RECV_DELAY={d}, progs/SM={pr}, fast bit={int(fb)}): "
                      f"{t.median_ms:.3f} ms", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    if inexact:
        raise SystemExit(f"{inexact} configuration(s) NOT EXACT on some rank (marked above)")


if __name__ == "__main__":
    main()
