"""`mxmoe bench a2a`: MXFP8 vs bf16 all-to-all for expert parallelism, on N GPUs.

    torchrun --nproc-per-node 2 -m mxmoe bench a2a [--batches 1,2,4,8,16] [--seq 8192] \
        [--dims 5120,7168] [--transport symm,nccl] [--chunks auto,2,4,8] [--profile DIR] [--json PATH]
        [--check_only]

Each rank holds batch x seq tokens of `dim` (bf16) and sends an equal share to every rank. Rows:
forward, backward and forward+backward times of the bf16 all-to-all (`a2a_unquantized`, NCCL) and of the
MXFP8 one (`to_mxfp8_a2a_dequant`, one row per --transport x --chunks choice; symm ignores chunks;
`ran`: the transport that ran, what "auto" chose), median of >= 20 runs, maximum over ranks
(mxmoe.bench.timing.bench). The breakdown times each stage alone: quantize all rows, the NCCL exchange
of the MXFP8 bytes (elements + scales, all_to_all_single), dequantize all rows, and their serial sum.
Before timing, every shape is checked bit for bit against `reference_mxfp8_a2a` (forward and backward),
plus one uneven-split case; `--no_check` skips that.
"""

from __future__ import annotations

import argparse
import datetime
import os

import torch
import torch.distributed as dist

from mxmoe.bench.timing import bench, check_json, environment, print_table, require_cuda, write_json
from mxmoe.cli import ArgumentParser, comma_list, positive_int
from mxmoe.comm import (
    a2a_combine,
    a2a_dispatch_mxfp8,
    a2a_unquantized,
    dequantize_into,
    qdq_into,
    reference_mxfp8_a2a,
    to_mxfp8_a2a_dequant,
)
from mxmoe.comm.mx_rows import quantize_rows
from mxmoe.comm.nccl import all_to_all_rows
from mxmoe.comm.transport import row_transport_name
from mxmoe.quant import custom_ops
from mxmoe.quant.backends import cast_kernel
from mxmoe.recipe import CAST_KERNELS, DEFAULT_RECIPE, MXRecipe

_DEVICE = ["cuda"]  # where the small result reductions live (a list so a CPU smoke test can swap it)


def _ints(text: str) -> list[int]:
    """An argparse `type`: a comma list of positive ints."""
    return comma_list(positive_int)(text)


def _non_negative(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        v = -1
    if v < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= 0")
    return v


def _seconds(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = float("nan")
    if not v > 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds")
    return v


def _chunks(text: str) -> list[int | None]:
    return [None if v == "auto" else int(v) for v in text.split(",") if v]


def _transports(text: str) -> list[str]:
    out = [v for v in text.split(",") if v]
    bad = [v for v in out if v not in TRANSPORT_LABELS]
    if bad or not out:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a comma list of {', '.join(TRANSPORT_LABELS)}")
    return out


TRANSPORT_LABELS = ("auto", "nccl", "symm")


def variants(transports: list[str], chunks: list[int | None]) -> list[tuple[str, int | None]]:
    """(transport, chunks) pairs to time, in order; symm takes no chunks, so it appears once."""
    out = []
    for t in transports:
        for c in [None] if t.startswith("symm") else chunks:
            if (t, c) not in out:
                out.append((t, c))
    return out


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="mxmoe bench a2a", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--batches", type=_ints, default=[1, 2, 4, 8, 16], help="batch sizes (comma list)")
    p.add_argument(
        "--seq", type=positive_int, default=8192, help="sequence length; tokens per rank = batch x seq"
    )
    p.add_argument("--dims", type=_ints, default=[5120], help="model dims (comma list), e.g. 5120,7168")
    p.add_argument(
        "--chunks",
        type=_chunks,
        default=[None],
        help="pieces per pair of ranks for the pipeline: a comma list of auto / 0 (no pipelining) / k >= 1, "
        "each timed in its own rows; the first is used for checks, breakdown and profile (default: auto)",
    )
    p.add_argument(
        "--transport",
        type=_transports,
        default=["auto"],
        help="MXFP8 transports to time (comma list of auto, nccl, symm; default auto)",
    )
    p.add_argument("--kernel", default="auto", choices=("auto", *CAST_KERNELS),
                   help="cast kernel of the exchange (its recipe's dim0_kernel): auto, cuda, triton, torch")
    p.add_argument("--iters", type=int, default=30, help="timed runs per measurement (>= 20)")
    p.add_argument(
        "--warmup", type=_non_negative, default=5, help="untimed runs before each measurement (default 5)"
    )
    p.add_argument("--timeout", type=_seconds, default=300.0, help="process-group timeout in seconds")
    p.add_argument(
        "--high_priority_nccl",
        action="store_true",
        help="give NCCL's streams high priority (ProcessGroupNCCL.Options)",
    )
    p.add_argument("--no_check", dest="check", action="store_false", help="skip the bit-exactness check")
    p.add_argument("--check_only", action="store_true", help="only run the bit-exactness checks")
    p.add_argument(
        "--profile",
        default=None,
        metavar="DIR",
        help="write Chrome traces of bf16 and mxfp8 forward+backward (largest shape) to DIR",
    )
    p.add_argument("--json", default=None, metavar="PATH", help="write all results to PATH (rank 0)")
    return p


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    if args.iters < 20:
        p.error(f"--iters={args.iters}; use at least 20 (the median needs them)")
    odd = [d for d in args.dims if d % DEFAULT_RECIPE.block_size]
    if odd:
        p.error(f"--dims={odd[0]}: expected multiples of {DEFAULT_RECIPE.block_size} (the MX block)")
    check_json(p, args.json)
    args.variants = variants(args.transport, args.chunks)
    args.recipe = DEFAULT_RECIPE.replace(dim0_kernel=args.kernel)  # the exchanges' format and kernel
    return args


def _init(args) -> tuple[int, int]:
    require_cuda("mxmoe bench a2a")
    missing = [
        v for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ
    ]
    if missing:
        raise SystemExit(
            f"mxmoe bench a2a runs one process per GPU under torchrun (missing {', '.join(missing)}); "
            "launch it as: torchrun --nproc-per-node 2 -m mxmoe bench a2a ..."
        )
    local = int(os.environ["LOCAL_RANK"])
    if local >= torch.cuda.device_count():
        raise SystemExit(f"LOCAL_RANK={local} but only {torch.cuda.device_count()} GPUs are visible")
    torch.cuda.set_device(local)
    kwargs = {}
    if args.high_priority_nccl:
        kwargs["pg_options"] = dist.ProcessGroupNCCL.Options(is_high_priority_stream=True)
    dist.init_process_group(
        "nccl",
        timeout=datetime.timedelta(seconds=args.timeout),
        device_id=torch.device("cuda", local),
        **kwargs,
    )
    return dist.get_rank(), dist.get_world_size()


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    na, nb = a.isnan(), b.isnan()
    ints = torch.int16 if a.dtype == torch.bfloat16 else torch.int32
    return bool(torch.equal(na, nb) and torch.equal(a.view(ints)[~na], b.view(ints)[~nb]))


def check_exact(
    x: torch.Tensor, g: torch.Tensor, outs, ins, chunks: int | None, recipe: MXRecipe, transport: str = "auto"
) -> list[str]:
    """Names of the checks that are NOT bit-exact against the reference (forward and backward)."""
    return _check_exact(x, g, outs, ins, dict(chunks=chunks, recipe=recipe, transport=transport))


def _check_exact(x, g, outs, ins, kw) -> list[str]:
    recipe = kw["recipe"]
    failed = []
    xr = x.detach().clone().requires_grad_()
    yr = reference_mxfp8_a2a(xr, outs, ins, recipe=recipe)
    yr.backward(g)
    xm = x.detach().clone().requires_grad_()
    ym = to_mxfp8_a2a_dequant(xm, outs, ins, **kw)
    ym.backward(g)
    if not _same_bits(ym, yr):
        failed.append("forward")
    if not _same_bits(xm.grad, xr.grad):
        failed.append("backward")
    mx = a2a_dispatch_mxfp8(x.detach(), outs, ins, **kw)
    if not _same_bits(mx.dequantize(recipe=recipe), yr.detach()):
        failed.append("dispatch")
    xc = x.detach().clone().requires_grad_()
    yc = a2a_combine(xc, outs, ins, **kw)
    yc.backward(yr.detach())
    if not _same_bits(xc.grad, reference_mxfp8_a2a(yr.detach(), ins, outs, recipe=recipe)):
        failed.append("combine backward")
    del xr, yr, xm, ym, mx, xc, yc
    return failed


def _all_ok(failed: list[str]) -> bool:
    t = torch.tensor([len(failed)], device=_DEVICE[0])
    dist.all_reduce(t)
    return t.item() == 0


def _check(args, rank: int, world: int, dev, say) -> list[dict]:
    """Uneven and zero splits at a small shape, both dtypes, pipelined and simple paths."""
    # rank r sends ((r + p) % 3) * 96 + 32 * p rows to rank p (zero from rank 0 to itself).
    ins = [((rank + p) % 3) * 96 + 32 * p for p in range(world)]
    outs = [((p + rank) % 3) * 96 + 32 * rank for p in range(world)]
    checks = []
    for dtype in (torch.bfloat16, torch.float32):
        # rows scaled by 2^-135 .. 2^100: subnormal, tiny-scale and huge blocks take the exact slow paths
        x = (
            torch.randn(sum(ins), 512, device=dev)
            * torch.exp2(torch.randint(-135, 100, (sum(ins), 1), device=dev))
        ).to(dtype)
        g = (
            torch.randn(sum(outs), 512, device=dev)
            * torch.exp2(torch.randint(-135, 100, (sum(outs), 1), device=dev))
        ).to(dtype)
        for transport, chunks in dict.fromkeys([*args.variants, ("nccl", 0), ("nccl", 3)]):
            ok = _all_ok(check_exact(x, g, outs, ins, chunks, args.recipe, transport))
            case = f"uneven splits {dtype} transport={transport} chunks={chunks}"
            checks.append({"case": case, "exact": ok})
            say(f"check {case}: {'exact' if ok else 'MISMATCH'}")
    return checks


def _time_op(op, xs, gs, timed) -> dict:
    """Median ms of op's forward (no grad), backward (autograd.grad of a kept graph) and both."""
    res = {}
    with torch.no_grad():
        res["forward"] = bench(op, [(x,) for x in xs], **timed).median_ms
    xg = [x.detach().clone().requires_grad_() for x in xs]
    ys = [op(x) for x in xg]
    res["backward"] = bench(
        lambda x, y, g: torch.autograd.grad(y, x, g, retain_graph=True),
        list(zip(xg, ys, gs, strict=True)),
        **timed,
    ).median_ms
    del ys
    res["both"] = bench(
        lambda x, g: torch.autograd.grad(op(x), x, g), list(zip(xg, gs, strict=True)), **timed
    ).median_ms
    return res


def _bench_shape(xs, gs, splits, shape, world, args, rows, breakdown) -> None:
    timed = dict(warmup=args.warmup, iters=args.iters)
    bf = _time_op(lambda t: a2a_unquantized(t, splits, splits, check=False), xs, gs, timed)
    fwd = {}
    for transport, chunks in args.variants:

        def mxfp8(t, chunks=chunks, transport=transport):
            return to_mxfp8_a2a_dequant(
                t, splits, splits, check=False, chunks=chunks, recipe=args.recipe, transport=transport
            )

        mx = _time_op(mxfp8, xs, gs, timed)
        fwd[transport, chunks] = mx["forward"]
        ran = row_transport_name(transport, xs[0], None, args.recipe.fmt, chunks, world)  # "auto" chose
        for part in ("forward", "backward", "both"):
            rows.append(
                {
                    "pass": part,
                    "input_shape": shape,
                    "num_splits": world,
                    "transport": transport,
                    "ran": ran,
                    "chunks": "-" if transport.startswith("symm") else "auto" if chunks is None else chunks,
                    "bf16_ms": bf[part],
                    "mxfp8_ms": mx[part],
                    "speedup": bf[part] / mx[part],
                }
            )
    transport, chunks = args.variants[0]
    with torch.no_grad():
        checked = bench(
            lambda t: to_mxfp8_a2a_dequant(
                t, splits, splits, check=True, chunks=chunks, recipe=args.recipe, transport=transport
            ),
            [(x,) for x in xs],
            **timed,
        ).median_ms
    breakdown.append(_breakdown(xs, splits, shape, args, bf["forward"], fwd[transport, chunks], checked))


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    rank, world = _init(args)
    dev = torch.device("cuda", torch.cuda.current_device()) if _DEVICE[0] == "cuda" else torch.device("cpu")
    say = print if rank == 0 else (lambda *a, **k: None)
    nccl_env = {k: v for k, v in os.environ.items() if k.startswith(("NCCL_", "MXMOE_"))}
    say(
        f"mxmoe bench a2a: {world} ranks, {environment()}, (transport, chunks)={args.variants}, "
        f"kernel={args.kernel}, "
        f"env {nccl_env}"
    )
    rows, breakdown, checks = [], [], []
    try:
        if args.check or args.check_only:
            checks += _check(args, rank, world, dev, say)
        for dim in args.dims:
            for batch in args.batches:
                n = batch * args.seq
                if n % world:
                    raise SystemExit(f"batch x seq = {n} tokens is not divisible by {world} ranks")
                splits = [n // world] * world
                xs = [torch.randn(n, dim, device=dev, dtype=torch.bfloat16) for _ in range(2)]
                gs = [torch.randn(n, dim, device=dev, dtype=torch.bfloat16) for _ in range(2)]
                shape = f"{batch}x{args.seq}x{dim}"
                if args.check or args.check_only:
                    t0, c0 = args.variants[0]
                    ok = _all_ok(check_exact(xs[0], gs[0], splits, splits, c0, args.recipe, t0))
                    checks.append({"case": shape, "exact": ok})
                    say(f"check {shape}: {'exact' if ok else 'MISMATCH'}")
                if not args.check_only:
                    _bench_shape(xs, gs, splits, shape, world, args, rows, breakdown)
                del xs, gs
                torch.cuda.empty_cache()
        if rows and rank == 0:
            for part in ("forward", "backward", "both"):
                print_table([r for r in rows if r["pass"] == part], title=f"\n{part}")
            print_table(
                breakdown,
                title="\nbreakdown (each stage timed alone, ms; NCCL stages; mxfp8 rows: the first variant)",
            )
        if args.profile and not args.check_only:
            _profile(args, rank, world, dev)
        if args.json and rank == 0:
            payload = {
                "env": environment(),
                "nccl_env": nccl_env,
                "world": world,
                "args": vars(args),
                "checks": checks,
                "rows": rows,
                "breakdown": breakdown,
            }
            write_json(args.json, payload)
        if not all(c["exact"] for c in checks):
            say("NOT EXACT: see the check lines above")
            return 1
    finally:
        dist.destroy_process_group()
    return 0


def _breakdown(xs, splits, shape, args, bf16_fwd, mx_fwd, checked_fwd) -> dict:
    timed = dict(warmup=args.warmup, iters=args.iters)
    k = cast_kernel(args.recipe, xs[0].device, "dim0")  # the exchange's kernel (its casts run along rows)
    q, s = quantize_rows(xs[0], recipe=args.recipe)
    qo, so = torch.empty_like(q.view(torch.uint8)), torch.empty_like(s.view(torch.uint8))
    t_q = bench(lambda x: quantize_rows(x, recipe=args.recipe), [(x,) for x in xs], **timed).median_ms

    def exchange():
        all_to_all_rows(qo, q.view(torch.uint8), splits, splits)
        all_to_all_rows(so, s.view(torch.uint8), splits, splits)

    t_x = bench(exchange, **timed).median_ms
    q8, s8 = qo.view(torch.float8_e4m3fn), so.view(args.recipe.fmt.scale_dtype)
    t_d = bench(lambda: custom_ops.dequantize(q8, s8, 32, torch.bfloat16, k), **timed).median_ms
    out = torch.empty_like(xs[0])
    t_di = bench(lambda: dequantize_into(qo, so, out, k), **timed).median_ms
    t_qdq = bench(lambda x: qdq_into(x, out, k), [(x,) for x in xs], **timed).median_ms
    return {
        "input_shape": shape,
        "cast_kernel": k,
        "quantize_ms": t_q,
        "exchange_mxfp8_ms": t_x,
        "dequantize_ms": t_d,
        "serial_sum_ms": t_q + t_x + t_d,
        "dequantize_into_ms": t_di,
        "fused_qdq_ms": t_qdq,
        "mx_fwd_ms": mx_fwd,
        "checked_fwd_ms": checked_fwd,
        "bf16_exchange_ms": bf16_fwd,
    }


def _profile(args, rank, world, dev) -> None:
    from torch.profiler import ProfilerActivity, profile

    os.makedirs(args.profile, exist_ok=True)
    n, dim = max(args.batches) * args.seq, max(args.dims)
    splits = [n // world] * world
    x = torch.randn(n, dim, device=dev, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(n, dim, device=dev, dtype=torch.bfloat16)
    ops = {
        "bf16": lambda: a2a_unquantized(x, splits, splits, check=False).backward(g),
        "mxfp8": lambda: to_mxfp8_a2a_dequant(
            x,
            splits,
            splits,
            check=False,
            chunks=args.variants[0][1],
            recipe=args.recipe,
            transport=args.variants[0][0],
        ).backward(g),
    }
    for name, fn in ops.items():
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
        path = os.path.join(args.profile, f"a2a_{name}_{max(args.batches)}x{args.seq}x{dim}_rank{rank}.json")
        prof.export_chrome_trace(path)
        with open(path[: -len(".json")] + ".txt", "w") as fh:  # where the host and device time goes
            for key in ("self_cpu_time_total", "self_device_time_total"):
                fh.write(prof.key_averages().table(sort_by=key, row_limit=30, max_name_column_width=60))
                fh.write("\n")
        if rank == 0:
            print(f"wrote {path} and .txt", flush=True)
