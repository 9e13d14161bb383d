"""`mxmoe bench trace`: GPU time per kernel category in profiler traces (Chrome trace JSON).

Reads the traces torch.profiler writes (`export_chrome_trace`: mxmoe's `--profiling.*`, torchtitan's
`--profiling.enable_profiling`), sums the GPU kernels, copies and memsets of each by the categories of
`mxmoe.train.profiling.KERNEL_CATEGORIES` (GEMMs, MX casts, attention, optimizer, ...), and prints
ms per recorded step: the step count is the number of `ProfilerStep#N` ranges in the trace within
which the host launched GPU work (1 if none). The MX casts are also listed by kernel name. Beside
the GPU time, the host's side of the same steps (where a step is host-bound, the GPU ms say little):
the steps' wall ms, operator calls, kernel launches, CUDA runtime / driver calls and their µs, and the
calls that wait for the GPU (synchronizes, blocking copies), so that two runs' traces show whether
one issues more work or issues the same work more slowly. A trace without GPU events (recorded on a
CPU) is refused.

    mxmoe bench trace outputs/profile_trace/iteration_20/rank0_trace.json --json trace.json
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import re

from mxmoe.cli import ArgumentParser

_GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}


def _load(path: str) -> dict:
    try:
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rt") as fh:
            return json.load(fh)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SystemExit(f"mxmoe bench trace: cannot read {path!r} as a Chrome trace: {e}") from None


def _us(e: dict, key: str) -> float:
    """Event `e`'s "ts" or "dur" (µs; 0 if absent); ValueError naming the event and the value unless
    it is a number."""
    v = e.get(key, 0)
    if type(v) not in (int, float):
        raise ValueError(f"event {str(e.get('name', ''))[:80]!r}: {key}={v!r}, expected a number of µs")
    return float(v)


def breakdown(trace: dict) -> dict:
    """{"steps": n, "ms_per_step": {category: ms, ..., "total": ms}, "cast_kernels": {name: ms}} of
    one Chrome trace: GPU events (kernels, copies, memsets) per ProfilerStep range recorded; ValueError
    naming the event whose ts or dur is not a number."""
    from mxmoe.train.profiling import kernel_category

    # the JSON Object Format (torch's) or the JSON Array Format (the events alone)
    raw = trace.get("traceEvents", []) if isinstance(trace, dict) else trace
    raw = raw if isinstance(raw, list) else []
    events = [e for e in raw if isinstance(e, dict)]
    step_name = re.compile(r"ProfilerStep#\d+$")
    # a step counts when the host launched GPU work inside its range (a trace can also hold the
    # empty start of the step after the recorded ones)
    host_api = ("cuda_runtime", "cuda_driver")
    launches = sorted(_us(e, "ts") for e in events if e.get("cat") in host_api)
    steps, step_us = 0, 0.0
    for e in events:
        if step_name.match(str(e.get("name", ""))):
            t0 = _us(e, "ts")
            t1 = t0 + _us(e, "dur")
            i = bisect.bisect_left(launches, t0)
            counted = not launches or (i < len(launches) and launches[i] <= t1)
            steps += counted
            step_us += (t1 - t0) if counted else 0.0
    wall = step_us / steps / 1e3 if steps else None  # no ProfilerStep range: the wall time is unknown
    steps = max(steps, 1)
    cats: dict[str, float] = {}
    casts: dict[str, float] = {}
    for e in events:
        if not isinstance(e, dict) or e.get("cat") not in _GPU_CATS or e.get("ph") != "X":
            continue
        name, ms = str(e.get("name", "")), _us(e, "dur") / 1e3
        cat = kernel_category(name)
        cats[cat] = cats.get(cat, 0.0) + ms
        if cat == "mx cast / qdq":
            casts[name[:120]] = casts.get(name[:120], 0.0) + ms
    per = {k: v / steps for k, v in sorted(cats.items(), key=lambda kv: -kv[1])}
    per["total"] = sum(per.values())
    return {
        "steps": steps,
        "ms_per_step": per,
        "cast_kernels": {k: v / steps for k, v in sorted(casts.items(), key=lambda kv: -kv[1])},
        "host_per_step": _host(events, steps, wall),
    }


# CUDA runtime / driver calls that wait for the GPU (the host cannot run ahead past them)
_WAITS = re.compile(
    r"^(cudaStreamSynchronize|cudaDeviceSynchronize|cudaEventSynchronize|cudaMemcpy(2D)?|"
    r"cuStreamSynchronize|cuCtxSynchronize|cuEventSynchronize|cuMemcpy(DtoH|HtoD|DtoD)?(_v2)?)$"
)


def _host(events: list[dict], steps: int, wall_ms: float | None) -> dict:
    """The host's side of the recorded steps, per step: wall ms of the ProfilerStep ranges (None
    without them), operator calls (cpu_op), kernel launches, CUDA runtime / driver calls and their
    µs, and of those the calls that wait for the GPU."""
    ops = launches = api = waits = 0
    api_us = 0.0
    for e in events:
        if e.get("ph") != "X":
            continue
        cat, name = e.get("cat"), str(e.get("name", ""))
        if cat == "cpu_op":
            ops += 1
        elif cat in ("cuda_runtime", "cuda_driver"):
            api += 1
            api_us += _us(e, "dur")
            launches += "LaunchKernel" in name
            waits += bool(_WAITS.match(name))
    return {
        "wall_ms": wall_ms,
        "operator_calls": ops / steps,
        "kernel_launches": launches / steps,
        "cuda_api_calls": api / steps,
        "cuda_api_us": api_us / steps,
        "gpu_waits": waits / steps,
    }


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="mxmoe bench trace",
        description="GPU ms per recorded step by kernel category (GEMMs, MX casts, attention, ...) "
        "of torch.profiler Chrome traces (mxmoe's or torchtitan's)",
    )
    p.add_argument("traces", nargs="+", metavar="TRACE", help="trace .json (or .json.gz) files")
    p.add_argument("--json", metavar="PATH", help="also write the breakdowns as JSON")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    from mxmoe.bench import timing

    timing.check_json(p, args.json)
    results = {}
    for path in args.traces:
        try:
            results[path] = breakdown(_load(path))
        except ValueError as e:
            raise SystemExit(
                f"mxmoe bench trace: {path!r} is not a torch.profiler Chrome trace: {e}"
            ) from None
    for path, r in results.items():
        if len(r["ms_per_step"]) == 1:  # the total alone: not one GPU event
            raise SystemExit(
                f"mxmoe bench trace: {path!r} holds no GPU kernel, copy or memset (a trace recorded on a "
                "CPU, or without ProfilerActivity.CUDA?): nothing to break down"
            )
    for path, r in results.items():
        rows = [{"category": k, "ms_per_step": v} for k, v in r["ms_per_step"].items()]
        rows += [{"category": f"  cast kernel {k}", "ms_per_step": v} for k, v in r["cast_kernels"].items()]
        title = f"{path}: GPU ms per step ({r['steps']} steps recorded)"
        timing.print_table(rows, title=title, floatfmt=".3f")
        host = [{"host, per step": k, "value": v} for k, v in r["host_per_step"].items()]
        timing.print_table(host, title=f"{path}: the host, per step", floatfmt=".1f")
    if args.json:
        timing.write_json(args.json, {"bench": "trace", "traces": results})
    return 0
