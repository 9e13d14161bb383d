"""The one timing utility and table printer every benchmark uses.

Timing is honest: every rank synchronizes its device and meets at a barrier before a measurement,
the function runs `warmup` times untimed, then `iters` times each bracketed by CUDA events; we
report the median. Inputs can be rotated (a list of argument tuples) so the L2 cache cannot serve
them. The ceilings (device copy bandwidth, bf16 GEMM rate) are measured with the same utility, in
the same run, so every speed is reported as a ratio to a number measured next to it.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch


def require_cuda(what: str) -> None:
    """Refuse clearly on a machine without a GPU."""
    if not torch.cuda.is_available():
        raise SystemExit(f"{what} measures GPU kernels and needs a CUDA GPU; none is available here")


@dataclass
class Timing:
    median_ms: float
    min_ms: float
    max_ms: float
    iters: int


def _barrier(group=None) -> None:
    torch.cuda.synchronize()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier(group=group)
        torch.cuda.synchronize()


def bench(
    fn: Callable,
    args: Sequence[tuple] = ((),),
    *,
    warmup: int = 10,
    iters: int = 50,
    group=None,
    graph: bool = False,
) -> Timing:
    """Median time of fn(*args[i % len(args)]) in ms over `iters` runs, after `warmup` runs.

    With torch.distributed initialized, all ranks of `group` barrier before timing, and the
    result is the maximum over ranks of each run's time (the collective finishes when the slowest
    rank does), so every rank reports the same number.

    graph=True: each argument set's call is captured once into a CUDA graph (after the warm-up) and
    the replays are timed: the GPU's time for the call's kernels without the host's per-call cost
    (Python, dispatch, launches), which otherwise shows in calls shorter than that cost.
    """
    if iters < 1 or warmup < 0 or not args:
        raise ValueError(
            f"bench needs iters >= 1, warmup >= 0 and at least one argument set; got iters={iters}, "
            f"warmup={warmup}, {len(args)} argument sets"
        )
    for i in range(warmup):
        fn(*args[i % len(args)])
    calls = [lambda a=a: fn(*a) for a in args]
    graphs = []
    if graph:
        torch.cuda.synchronize()
        for a in args:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn(*a)
            graphs.append(g)
        calls = [g.replay for g in graphs]
    _barrier(group)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for i in range(iters):
        starts[i].record()
        calls[i % len(calls)]()
        ends[i].record()
    torch.cuda.synchronize()
    times = torch.tensor([s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)])
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        t = times.cuda()
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=group)
        times = t.cpu()
    ts = times.tolist()
    return Timing(statistics.median(ts), min(ts), max(ts), iters)


def sync() -> None:
    """Wait for the GPU when there is one (a no-op on CPU)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def wall_us_per_call(fn: Callable, *, iters: int = 300, warmup: int = 20) -> float:
    """Host cost of a call: wall time of `iters` back-to-back calls of fn() in microseconds per call,
    after `warmup` calls, synchronizing the device only before and after the loop. For calls whose
    kernels are shorter than the host's work (Python, dispatch, launches) this is the host cost;
    otherwise it is the GPU time. Runs on CPU too."""
    if iters < 1 or warmup < 0:
        raise ValueError(f"wall_us_per_call needs iters >= 1 and warmup >= 0; got {iters}, {warmup}")
    for _ in range(warmup):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return (time.perf_counter() - t0) / iters * 1e6


def graph_replay_us(fn: Callable, *, iters: int = 300, warmup: int = 3) -> float:
    """fn() captured once in a CUDA graph (after `warmup` eager calls on a side stream): wall
    microseconds per replay, measured like `wall_us_per_call`. CUDA only."""
    require_cuda("graph_replay_us")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return wall_us_per_call(g.replay, iters=iters, warmup=2)


def rotation_count(bytes_per_set: int, l2_bytes: int | None = None) -> int:
    """How many input sets to rotate so that their total is >= 3x the L2 (at least 2)."""
    if l2_bytes is None:
        l2_bytes = torch.cuda.get_device_properties(0).L2_cache_size if torch.cuda.is_available() else 0
    return max(2, min(16, -(-3 * l2_bytes // max(1, bytes_per_set))))


def copy_bandwidth_tbs(nbytes: int = 1 << 30, iters: int = 50) -> float:
    """Device-to-device copy bandwidth in TB/s (bytes read + bytes written)."""
    n = nbytes // 2
    src = torch.empty(n, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    t = bench(lambda: dst.copy_(src), warmup=5, iters=iters)
    return 2 * src.numel() * src.element_size() / (t.median_ms * 1e-3) / 1e12


def bf16_gemm_tflops(n: int = 8192, iters: int = 20) -> float:
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    t = bench(lambda: a @ b, warmup=3, iters=iters)
    return 2 * n**3 / (t.median_ms * 1e-3) / 1e12


def print_table(rows: list[dict], title: str | None = None, floatfmt: str = ".3f") -> str:
    """Print rows (dicts with the same keys) as one table; returns the text."""
    from tabulate import tabulate

    text = tabulate(rows, headers="keys", floatfmt=floatfmt, tablefmt="github")
    if title:
        text = f"{title}\n{text}"
    print(text, flush=True)
    return text


def check_json(parser, path: str | None) -> None:
    """parser.error naming --json unless `path` (None: not asked for) can be written: checked before
    anything is measured, so a run does not end on a folder, a device or a read-only place. An empty
    path is refused too (the rows would silently not be written)."""
    if path is None:
        return
    if not path.strip():  # Path("") is the current folder
        parser.error(f"--json {path!r} is empty; expected a file path, e.g. result.json")
    from mxmoe.cli import check_out_file

    try:
        check_out_file(path, "--json", "result.json")
    except ValueError as e:
        parser.error(str(e))


def write_json(path: str, payload) -> None:
    """`payload` as JSON in `path`, its missing folders created (`check_json` checked it)."""

    def default(o):
        if hasattr(o, "__dataclass_fields__"):
            return asdict(o)
        return str(o)

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2, default=default)


def mxmoe_folder() -> str:
    """The folder of the mxmoe package this process imported: an A/B of two trees checks that each
    row ran the tree it names (a `python -m` started in a checkout imports that checkout's mxmoe
    before PYTHONPATH's)."""
    import os

    import mxmoe

    return os.path.dirname(os.path.abspath(mxmoe.__file__))


def environment() -> dict:
    """GPU, versions and the mxmoe package that ran: what docs/benchmarks.md records next to every
    table."""
    import platform

    env = {"torch": torch.__version__, "python": platform.python_version(), "mxmoe": mxmoe_folder()}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
        env["cuda"] = torch.version.cuda
    return env
