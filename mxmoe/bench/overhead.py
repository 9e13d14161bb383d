"""`mxmoe bench overhead`: host cost per call of every public MX op, beside torch's native ops.

At a small shape (default 1024x1024) the kernels take a few microseconds, so the wall time per call
of back-to-back calls (after warm-up, the device synchronized only before and after the loop) is
what the host spends per call: Python, argument checks, dispatch, kernel launches. Each MX op is
listed next to the native op it stands in for, all from the same run, and the casts also replayed
from a CUDA graph (the GPU's time for them, with no host work per call). Runs on CPU too (no graphs).

    mxmoe bench overhead                                   # 1024x1024, every available kernel
    mxmoe bench overhead --shape 4096x4096 --iters 1000 --json overhead.json
    mxmoe bench overhead --kernel cuda --kernel auto

Rows: op (what is called; `qdq ...`: the fused quantize-dequantize that feeds the emulated GEMM;
`zero_rows_after`: the zeroing of the rows after the last group that follows each bf16 grouped
forward and dgrad GEMM, `mxmoe.ops.tail_rows`),
impl ("native" or the MX cast kernel), host_us (wall µs per call), graph_us (wall µs per CUDA-graph
replay of the same call; casts, qdq and zero_rows_after only), x_to_fp8 (host_us / that of
`x.to(torch.float8_e4m3fn)` in the same run).
"""

from __future__ import annotations

import argparse
import socket
import sys
from collections.abc import Callable

import torch

from mxmoe.bench import timing
from mxmoe.cli import ArgumentParser, positive_int
from mxmoe.recipe import CAST_KERNELS

BLOCK = 32
NUM_GROUPS = 4


def _shape(text: str) -> tuple[int, int]:
    try:
        dims = tuple(int(t) for t in text.lower().split("x"))
    except ValueError:
        dims = ()
    if len(dims) != 2 or any(d <= 0 or d % (BLOCK * NUM_GROUPS) for d in dims):
        raise argparse.ArgumentTypeError(
            f"shape {text!r} is not RxC with positive multiples of {BLOCK * NUM_GROUPS} (e.g. 1024x1024)"
        )
    return dims


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="mxmoe bench overhead",
        description="Host microseconds per call of the MX ops (casts, dequantize, mx_mm, mx_grouped_mm, "
        "the all-to-all on one rank) beside copy_, x.to(float8), torch.mm and torch._grouped_mm.",
    )
    p.add_argument(
        "--shape", type=_shape, default=(1024, 1024), help="RxC of the activation (default 1024x1024)"
    )
    p.add_argument(
        "--kernel",
        action="append",
        choices=("auto", *CAST_KERNELS),
        help="MX cast kernel(s), repeatable; default: auto and every kernel available here",
    )
    p.add_argument("--iters", type=positive_int, default=300, help="calls per measurement (default 300)")
    p.add_argument("--warmup", type=positive_int, default=20, help="untimed calls first (default 20)")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto", help="default: cuda if any")
    p.add_argument("--no_graph", action="store_true", help="skip the CUDA-graph replays")
    p.add_argument("--json", metavar="PATH", help="also write the rows and the environment as JSON")
    return p


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cases(args, device: torch.device) -> list[tuple[str, str, Callable, bool]]:
    """(op, impl, fn, graphable) for every row; inputs are made here, once."""
    from mxmoe.comm import a2a_unquantized, to_mxfp8_a2a_dequant
    from mxmoe.ops import mx_grouped_mm, mx_mm
    from mxmoe.quant import available_kernels, to_mx, to_mx_dim0_dim1
    from mxmoe.quant.qdq import qdq, qdq_dim0_dim1
    from mxmoe.recipe import DEFAULT_RECIPE

    R, C = args.shape
    dt = torch.bfloat16
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(R, C, device=device, dtype=dt, generator=g)
    dst = torch.empty_like(x)
    w3 = torch.randn(NUM_GROUPS, C, C, device=device, dtype=dt, generator=g)  # (E, K, N), the casts' rows
    # the GEMM rows' weights as the modules hand them over: nn.Linear's (N, K) weight transposed
    # (MXLinear: weight.t()), the experts' (E, N, K) transposed; a row-major (K, N) operand would
    # add a copy per call to the MX rows (the cast wants each column's blocks contiguous)
    w = torch.randn(C, C, device=device, dtype=dt, generator=g).t()  # (K, N), column-major
    w3t = torch.randn(NUM_GROUPS, C, C, device=device, dtype=dt, generator=g).transpose(-2, -1)
    offs = torch.arange(1, NUM_GROUPS + 1, device=device, dtype=torch.int32) * (R // NUM_GROUPS)
    dy = torch.randn(R, C, device=device, dtype=dt, generator=g)
    xg = x.clone().requires_grad_()
    wg = w.t().clone().requires_grad_()  # (N, K) leaves, used transposed as above
    w3g = w3t.transpose(-2, -1).clone().requires_grad_()

    def fwd_bwd(f: Callable) -> Callable:
        def run():
            f().backward(dy)
            xg.grad = wg.grad = w3g.grad = None

        return run

    kernels = list(dict.fromkeys(args.kernel)) if args.kernel else ["auto", *available_kernels(device)]
    cases: list[tuple[str, str, Callable, bool]] = [
        ("copy_", "native", lambda: dst.copy_(x), True),
        ("x.to(float8_e4m3fn)", "native", lambda: x.to(torch.float8_e4m3fn), True),
    ]
    for k in kernels:
        rk = DEFAULT_RECIPE.replace(dim0_kernel=k, dim1_kernel=k)  # the kernel goes in through a recipe
        mx0 = to_mx(x, -1, recipe=rk)
        cases += [
            ("to_mx dim0", k, lambda rk=rk: to_mx(x, -1, recipe=rk), True),
            ("to_mx dim1", k, lambda rk=rk: to_mx(x, 0, recipe=rk), True),
            ("to_mx_dim0_dim1", k, lambda rk=rk: to_mx_dim0_dim1(x, recipe=rk), True),
            ("to_mx 3D along K", k, lambda rk=rk: to_mx(w3, -1, recipe=rk), True),
            ("to_mx 3D along N", k, lambda rk=rk: to_mx(w3, -2, recipe=rk), True),
            ("dequantize", k, lambda rk=rk, m=mx0: m.dequantize(recipe=rk), True),
        ]
        # the fused quantize-dequantize the emulated GEMM's operands come from (on a GPU, "cuda" and
        # "auto" run the C++ operators mxmoe_cuda::qdq_dim0 / qdq_dim1 / qdq_dim0_dim1, the grouped
        # dim1 call too)
        cases += [
            ("qdq dim0", k, lambda rk=rk: qdq(x, -1, recipe=rk), True),
            ("qdq dim1", k, lambda rk=rk: qdq(x, -2, recipe=rk), True),
            ("qdq 3D along N", k, lambda rk=rk: qdq(w3, -2, recipe=rk), True),
            ("qdq_dim0_dim1", k, lambda rk=rk: qdq_dim0_dim1(x, recipe=rk), True),
            ("qdq dim1, groups", k, lambda rk=rk: qdq(x, -2, recipe=rk, offs=offs), True),
        ]
    r = DEFAULT_RECIPE
    cases += [
        ("torch.mm fwd", "native", lambda: torch.mm(x, w), False),
        ("mx_mm fwd", "auto", lambda: mx_mm(x, w, r), False),
        ("torch.mm fwd+bwd", "native", fwd_bwd(lambda: torch.mm(xg, wg.t())), False),
        ("mx_mm fwd+bwd", "auto", fwd_bwd(lambda: mx_mm(xg, wg.t(), r)), False),
    ]
    if device.type == "cuda":  # torch._grouped_mm: CUDA bf16 only
        # the tail-rows kernels are Triton's and the C++ extension's (their module imports triton)
        from mxmoe.ops.tail_rows import zero_rows_after

        cases += [
            ("torch._grouped_mm fwd", "native", lambda: torch._grouped_mm(x, w3t, offs=offs), False),
            (
                "torch._grouped_mm fwd+bwd",
                "native",
                fwd_bwd(lambda: torch._grouped_mm(xg, w3g.mT, offs=offs)),
                False,
            ),
        ]
        # what mx_grouped_mm runs after each grouped forward and dgrad GEMM ("auto": the C++
        # operator where the extension loads); the groups cover every row, as in a MoE step
        tail = torch.zeros_like(x)
        cases += [
            ("zero_rows_after", k, lambda k=k: zero_rows_after(tail, offs, kernel=k), True)
            for k in kernels
            if k != "torch"
        ]
    cases += [
        ("mx_grouped_mm fwd", "auto", lambda: mx_grouped_mm(x, w3t, offs, r), False),
        ("mx_grouped_mm fwd+bwd", "auto", fwd_bwd(lambda: mx_grouped_mm(xg, w3g.mT, offs, r)), False),
        ("a2a_unquantized, 1 rank", "native", lambda: a2a_unquantized(x, [R], [R], check=False), False),
        (
            "to_mxfp8_a2a_dequant, 1 rank",
            "auto",
            lambda: to_mxfp8_a2a_dequant(x, [R], [R], check=False),
            False,
        ),
    ]
    return cases


def run(args) -> list[dict]:
    import torch.distributed as dist

    device = torch.device(
        ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    )
    if device.type == "cuda":
        timing.require_cuda("mxmoe bench overhead --device cuda")
    own_pg = False
    if dist.is_available() and not dist.is_initialized():
        # the all-to-all rows run on a process group of one rank, as in training
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            init_method=f"tcp://127.0.0.1:{_free_port()}",
            rank=0,
            world_size=1,
            **(
                {"device_id": torch.device("cuda", torch.cuda.current_device())}
                if device.type == "cuda"
                else {}
            ),
        )
        own_pg = True
    rows: list[dict] = []
    try:
        graphs = device.type == "cuda" and not args.no_graph
        for op, impl, fn, graphable in _cases(args, device):
            row = {"op": op, "impl": impl, "host_us": None, "graph_us": None, "x_to_fp8": None, "error": ""}
            try:
                row["host_us"] = timing.wall_us_per_call(fn, iters=args.iters, warmup=args.warmup)
                if graphs and graphable:
                    row["graph_us"] = timing.graph_replay_us(fn, iters=args.iters)
            except Exception as e:  # an op that cannot run here is reported, not fatal
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"
            rows.append(row)
    finally:
        if own_pg:
            dist.destroy_process_group()
    ref = next(r["host_us"] for r in rows if r["op"] == "x.to(float8_e4m3fn)")
    for r in rows:
        if r["host_us"] is not None and ref:
            r["x_to_fp8"] = r["host_us"] / ref
    return rows


def missing_triton(kernels: list[str] | None) -> str | None:
    """The one-line refusal of kernels that need the triton package where it is not installed (the
    CUDA rows all do: `zero_rows_after`'s module imports it); None when nothing asked needs it."""
    import importlib.util

    if importlib.util.find_spec("triton") is not None:
        return None
    asked = sorted(set(kernels or []) & {"triton", "cuda"})
    if asked:
        return f"--kernel {','.join(asked)}: needs the triton package, which is not installed"
    if torch.cuda.is_available():
        return "the CUDA rows need the triton package, which is not installed (or pass --device cpu)"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    timing.check_json(parser, args.json)
    why = missing_triton(args.kernel) if args.device != "cpu" or args.kernel else None
    if why is not None:
        print(f"mxmoe bench overhead: {why}: pip install 'mxmoe[triton]'", file=sys.stderr)
        return 2
    if args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available()):
        from mxmoe.quant.backends import why_unavailable

        for k in args.kernel or []:  # on CUDA every kernel runs (require_cuda refuses no GPU)
            why = None if k == "auto" else why_unavailable(k, torch.device("cpu"))
            if why is not None:
                parser.error(f"--kernel {k} cannot run on the cpu: {why}")
    rows = run(args)
    R, C = args.shape
    env = timing.environment()
    timing.print_table(
        [{k: v for k, v in r.items() if k != "error" or any(q["error"] for q in rows)} for r in rows],
        title=f"host cost per call, {R}x{C} bf16, {args.iters} calls after {args.warmup} warm-up "
        f"({', '.join(f'{k} {v}' for k, v in env.items())})",
        floatfmt=".1f",
    )
    if args.json:
        timing.write_json(
            args.json,
            {"bench": "overhead", "shape": [R, C], "iters": args.iters, "environment": env, "rows": rows},
        )
    return 0
