"""Where the time of the symmetric-memory MXFP8 exchange goes, stage by stage (2+ GPUs, torchrun).

    torchrun --standalone --nproc-per-node 2 scripts/gpu/symm_probe.py [--json PATH]

Per shape (rows per rank x 5120, bf16, equal splits): the dim0 cast of the peers' rows into a local
buffer and straight into the peer's buffer; a copy-engine copy of those bytes to the peer; the device
barrier; the flag wait kernel; dequantize of the received rows; the fused quantize+dequantize of the own rows; whole forward
exchanges (store mode; copy mode with several piece sizes), the public API (copy, store, NCCL), bf16;
and host time per call (enqueue only). CUDA-event medians, maximum over ranks (mxmoe.bench.timing).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

from mxmoe.bench.timing import bench, environment, print_table, write_json
from mxmoe.comm import all_to_all_hp, dequantize_into, qdq_into, to_mxfp8_a2a_dequant
from mxmoe.comm import symm
from mxmoe.comm.symm import Layout, SymmWorkspace, halves_bytes, symm_mx_exchange
from mxmoe.formats import make_spec
from mxmoe.quant import triton_cast

SPEC = make_spec(32, "rceil", torch.float8_e4m3fn)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="8192,32768,131072")
    ap.add_argument("--dim", type=int, default=5120)
    ap.add_argument("--json", default=None)
    ap.add_argument("--cprofile", action="store_true", help="host profile (rank 0) of 50 calls per op")
    args = ap.parse_args(argv)
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    me, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local)
    say = print if me == 0 else (lambda *a, **k: None)
    say(f"symm probe: {world} ranks, {environment()}")
    rows = []
    ws = SymmWorkspace.get(None, dev)
    for n in [int(v) for v in args.rows.split(",")]:
        dim = args.dim
        splits = [n // world] * world
        xs = [torch.randn(n, dim, device=dev, dtype=torch.bfloat16) for _ in range(2)]
        half = n // world
        peer = (me + 1) % world
        ws.ensure()
        qp, sp = Layout(world, dim, halves_bytes(ws.nbytes)).slot(ws.buffers[peer], 0, me, peer)
        ql = torch.empty(half, dim, dtype=torch.uint8, device=dev)
        sl = torch.empty(half, dim // 32, dtype=torch.uint8, device=dev)
        out = torch.empty(half, dim, dtype=torch.bfloat16, device=dev)
        x0 = xs[0][:half]
        t = {}
        t["quantize_local"] = bench(lambda: triton_cast.quantize_dim0(x0, SPEC, out=(ql, sl)), iters=30)
        dist.barrier()
        t["quantize_into_peer"] = bench(lambda: triton_cast.quantize_dim0(x0, SPEC, out=(qp[:half], sp[:half])), iters=30)
        dist.barrier()

        def ce():
            qp[:half].copy_(ql)
            sp[:half].copy_(sl)

        t["ce_copy_to_peer"] = bench(ce, iters=30)
        t["barrier (torch)"] = bench(ws.barrier, iters=30)
        t["barrier (flags)"] = bench(lambda: ws.barrier(ws.next_epoch()), iters=30)
        t["wait_flag (raised)"] = bench(lambda: ws.wait(0, 0), iters=30)
        t["dequantize_into"] = bench(lambda: dequantize_into(ql, sl, out), iters=30)
        for cfg in ((64, 4), (32, 4), (128, 4), (128, 8), (256, 8)):
            t[f"qdq_own_rows config={cfg}"] = bench(lambda cfg=cfg: qdq_into(x0, out, config=cfg), iters=30)
        ex = {"store": ("store", symm.PIECE_ROWS)}
        for pr in (4096, 8192, 16384, 1 << 30):
            ex[f"copy piece_rows={pr}"] = ("copy", pr)
        for name, (mode, pr) in ex.items():
            symm.PIECE_ROWS = pr
            t[f"symm_exchange {name}"] = bench(
                lambda x, mode=mode: symm_mx_exchange(x, splits, splits, me, ws, "auto", True, mode=mode),
                [(x,) for x in xs], iters=30,
            )
        symm.PIECE_ROWS = 8192

        def api(mode):
            def f(x):
                with symm.using_mode(mode):
                    return to_mxfp8_a2a_dequant(x, splits, splits, check=False, transport="symm")
            return f

        ops = {
            "api_symm_copy": api("copy"),
            "api_symm_store": api("store"),
            "api_nccl": lambda x: to_mxfp8_a2a_dequant(x, splits, splits, check=False, transport="nccl"),
            "bf16_nccl": lambda x: all_to_all_hp(x, splits, splits, check=False),
        }
        with torch.no_grad():
            for name, op in ops.items():
                t[name] = bench(op, [(x,) for x in xs], iters=30)
        host = {}
        with torch.no_grad():
            for name, op in ops.items():
                torch.cuda.synchronize()
                dist.barrier()
                h0 = time.perf_counter()
                for i in range(20):
                    op(xs[i % 2])
                host[name] = (time.perf_counter() - h0) / 20 * 1e3
                torch.cuda.synchronize()
        for k, v in t.items():
            rows.append({"rows_per_rank": n, "stage": k, "ms": v.median_ms})
        for k, v in host.items():
            rows.append({"rows_per_rank": n, "stage": f"host {k}", "ms": v})
        if args.cprofile and n == min(int(v) for v in args.rows.split(",")):
            _cprofile(me, ops, xs)
        del xs
        torch.cuda.empty_cache()
    say("")
    if me == 0:
        print_table(rows, title="stages (CUDA-event medians, max over ranks; host rows: enqueue time per call)")
        if args.json:
            write_json(args.json, {"env": environment(), "world": world, "rows": rows})
    dist.destroy_process_group()
    return 0


def _cprofile(me: int, ops: dict, xs) -> None:
    import cProfile
    import io
    import pstats

    for name, op in ops.items():
        prof = cProfile.Profile()
        torch.cuda.synchronize()
        dist.barrier()
        with torch.no_grad():
            prof.enable()
            for i in range(50):
                op(xs[i % 2])
            prof.disable()
        torch.cuda.synchronize()
        if me == 0:
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(14)
            lines = [ln for ln in buf.getvalue().splitlines() if ln.strip()][3:]
            print(f"\n== host profile, 50 calls of {name}\n" + "\n".join(ln[:170] for ln in lines), flush=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
