"""`mxmoe bench train`: bf16 and MX training steps of the same model and batch.

The model comes from the trainer's configuration (`--config FILE.toml` and `--section.key=value`
overrides, as `mxmoe train` takes them): the same ModelArgs, the same `mxmoe.convert` settings
(`[mx]`), the same AdamW and loss (cross-entropy + aux loss, bf16 autocast on CUDA). Each variant
(bf16 = the high-precision model, mx = converted) is built fresh from the same seed and trained
on one fixed batch, in each mode:

  eager          no compilation
  compile        the trainer's `compile.enable` (each block's parts compiled; at EP=1 the MoE
                 layer, routed experts included, as one graph)
  compile_full   the whole model compiled with fullgraph=True (possible at EP=1: no host syncs; the
                 trainer's `compile.whole_model`)
  reduce_overhead  the same with mode="reduce-overhead" (inductor's CUDA graphs of forward and
                 backward); CUDA only
  graph          forward+backward captured in one CUDA graph (`mxmoe.models.GraphedStep`; the
                 trainer's `training.cuda_graph`), optimizer eager; CUDA only
  compile+graph  per-block compile, the step as one CUDA graph
  compile_full+graph   both

After `--warmup_steps` untimed steps (compilation, capture, autotuning), `--steps` steps are timed
by wall clock with the device synchronized only at both ends: tokens/s, ms per step; then three
steps each started on an idle device, host_ms their median time until the step's Python returns (its
kernels queued, not waited for: near step_ms, the step is bound by the host); peak memory
(CUDA: max allocated during the variant; CPU: the process's peak RSS so far), final loss, and
torch.compile's graphs, graph breaks and graphs compiled during the timed steps (nonzero: the
timing includes recompilation). A mode that fails is reported with its error. Runs on CPU (tiny
config) too.

Each row (variant, mode) runs alone in a child process of its own (`python -m mxmoe bench train`
for that row), and this process creates no CUDA context: a host-bound row (the MX per-block compile
step) run after others in one process, or beside a parent process holding a CUDA context, runs
markedly slower than alone (docs/benchmarks.md, "Training step"). `--same_process` runs the
rows in this process instead (quicker to start; several torchrun ranks always do).

    mxmoe bench train --config moe_1b --json train.json
    mxmoe bench train --config debug_moe --training.device=cpu --modes eager --steps 2
"""

from __future__ import annotations

import argparse
import gc
import time

import torch

from mxmoe.bench import timing
from mxmoe.cli import ArgumentParser, comma_list, positive_int
from mxmoe.train import determinism

MODES = (
    "eager", "compile", "compile_full", "reduce_overhead", "graph", "compile+graph", "compile_full+graph"
)
VARIANTS = ("bf16", "mx")
_COMPILE = {  # mode -> build_model(compile=...)
    "eager": None,
    "compile": "blocks",
    "compile_full": "full",
    "reduce_overhead": "reduce_overhead",
    "graph": None,
    "compile+graph": "blocks",
    "compile_full+graph": "full",
}


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="mxmoe bench train",
        description="bf16 vs MX training steps of one model and batch (tokens/s, step time, peak memory), "
        "eager, compiled and CUDA-graphed. Other options (--config, --section.key=value) are the "
        "trainer's (`mxmoe train --help`).",
    )
    p.add_argument(
        "--variants",
        type=comma_list(choices=VARIANTS),
        default=list(VARIANTS),
        help="bf16 (high precision) and/or mx (the [mx] converter settings); default both",
    )
    p.add_argument(
        "--modes",
        type=comma_list(choices=MODES),
        default=None,
        help=f"comma list of {list(MODES)}; default all on CUDA, eager on CPU",
    )
    p.add_argument("--steps", type=positive_int, default=20, help="timed steps (default 20)")
    p.add_argument("--warmup_steps", type=positive_int, default=10, help="untimed steps first (default 10)")
    p.add_argument(
        "--profile",
        metavar="DIR",
        help="after timing, record --profile_steps more steps of each variant and mode with "
        "torch.profiler: DIR/<variant>_<mode>.txt (GPU time per kernel category, the operator table by "
        "device time, and the same grouped by input shapes) and the categories per step in the rows",
    )
    p.add_argument(
        "--profile_steps", type=positive_int, default=2, help="steps recorded with --profile (default 2)"
    )
    p.add_argument(
        "--json", metavar="PATH", help="also write the rows, the config and the environment as JSON"
    )
    p.add_argument(
        "--same_process",
        action="store_true",
        help="run every row in this process (default: each row alone in a child process, so no row is "
        "slowed by what another left behind; several torchrun ranks always share one)",
    )
    return p


def _tokens(cfg, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    from mxmoe.train.data import VOCAB_SIZE

    t = cfg.training
    g = torch.Generator().manual_seed(cfg.debug.seed + 1)
    seq = torch.randint(0, VOCAB_SIZE, (t.local_batch_size, t.seq_len + 1), generator=g).to(device)
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def _one(cfg, variant: str, mode: str, device: torch.device, args) -> dict:
    """Build, warm up and time one variant in one mode."""
    from mxmoe.models import GraphedStep
    from mxmoe.train import parallel
    from mxmoe.train.build import autocast, aux_loss_weight, build_model, build_optimizer
    from mxmoe.train.trainer import lm_loss, memory_gib

    graph = "graph" in mode
    if (graph or mode == "reduce_overhead") and device.type != "cuda":
        raise RuntimeError("CUDA graphs need a CUDA device")
    # the trainer's model (one process: no expert parallelism, no FSDP), bf16 or converted
    model = build_model(
        cfg,
        device,
        parallel.make_parallel_dims(1, -1, 1, 1),
        mx=variant == "mx",
        compile=_COMPILE[mode],
        backend=cfg.compile.backend,
    )
    report = model.mx_conversion if variant == "mx" else None
    opt = build_optimizer(model, cfg, distributed=False)
    amp = autocast(cfg, device, cache_enabled=not (graph or mode == "reduce_overhead"))
    aux_coef = aux_loss_weight(model.args)
    x, y = _tokens(cfg, device)

    def step_fn(xs, ys):
        ce, aux = lm_loss(model, xs, ys, amp)
        return ce + aux_coef * aux, ce

    graphed = None

    def step() -> torch.Tensor:
        nonlocal graphed
        if graph:
            if graphed is None:
                graphed = GraphedStep(step_fn, model.parameters(), (x, y))
            _, ce = graphed(x, y)
        else:
            if mode == "reduce_overhead":  # a new step: inductor's graphs may reuse their outputs
                torch.compiler.cudagraph_mark_step_begin()
            loss, ce = step_fn(x, y)
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return ce

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    dynamo = torch._dynamo.utils.counters
    dynamo.clear()
    t0 = time.perf_counter()
    for _ in range(args.warmup_steps):
        step()
    timing.sync()
    warm_s = time.perf_counter() - t0
    graphs_warm = dynamo["stats"]["unique_graphs"]
    t0 = time.perf_counter()
    for _ in range(args.steps):
        ce = step()
    timing.sync()
    dt = (time.perf_counter() - t0) / args.steps
    host = []  # steps started on an idle device: the time until step() returns, its kernels queued
    for _ in range(3):
        timing.sync()
        t0 = time.perf_counter()
        step()
        host.append(time.perf_counter() - t0)
    timing.sync()
    prof = _profile(step, list(model.parameters()), variant, mode, device, args) if args.profile else {}
    return {
        "variant": variant,
        "mode": mode,
        "tokens_per_s": cfg.training.local_batch_size * cfg.training.seq_len / dt,
        "step_ms": dt * 1e3,
        "host_ms": sorted(host)[1] * 1e3,
        "peak_mem_gib": memory_gib(device),
        "warmup_s": warm_s,
        # torch.compile's work: graphs compiled (warm-up and timed steps), graph breaks, and graphs
        # compiled during the timed steps (recompiles: then the timed steps were no steady state)
        "graphs": dynamo["stats"]["unique_graphs"],
        "graph_breaks": sum(dynamo["graph_break"].values()),
        "graphs_timed": dynamo["stats"]["unique_graphs"] - graphs_warm,
        "loss": float(ce.detach()),
        "deterministic": torch.are_deterministic_algorithms_enabled(),  # --debug.deterministic
        "mxmoe": timing.mxmoe_folder(),  # the package this row ran (its own process's)
        "kernels": _kernels(cfg, device) if variant == "mx" else {},  # what "auto" chose
        "converted": report.summary() if report is not None else "",
        **prof,
    }


def _kernels(cfg, device: torch.device) -> dict:
    """The concrete cast kernels and GEMM backend the MX row ran (the options may say "auto")."""
    from mxmoe.ops.gemm_backend import resolve_gemm_backend
    from mxmoe.quant.backends import cast_kernel

    r = cfg.mx.to_recipe()
    out = {c: cast_kernel(r, device, c) for c in ("dim0", "dim1", "qdq_dim0", "qdq_dim1", "dequant")}
    out["gemm"] = resolve_gemm_backend(r, device)
    return out


def _profile(step, params, variant: str, mode: str, device: torch.device, args) -> dict:
    """Record `args.profile_steps` more steps; write the table, return GPU ms per step by kernel
    category and (`cast_breakdown`; `params` the model's parameters) of the MX casts by what they cast."""
    import os

    from torch.profiler import ProfilerActivity, profile

    from mxmoe.train.profiling import cast_breakdown, kernel_breakdown

    cuda = device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    n = args.profile_steps
    timing.sync()
    with profile(activities=acts, record_shapes=True) as prof:
        with torch.profiler.record_function("mxmoe.bench.steps"):  # marks the forward's thread
            for _ in range(n):
                step()
            timing.sync()
    os.makedirs(args.profile, exist_ok=True)
    sort_by = "self_device_time_total" if cuda else "self_cpu_time_total"
    per_step = {k: v / n for k, v in kernel_breakdown(prof).items()} if cuda else {}
    main = next(e.thread for e in prof.events() if e.name == "mxmoe.bench.steps")
    shapes = {tuple(p.shape) for p in params}
    casts = {k: v / n for k, v in cast_breakdown(prof, shapes, main).items()}
    with open(os.path.join(args.profile, f"{variant}_{mode}.txt"), "w") as fh:
        fh.write(f"{variant}, {mode}: {n} steps recorded\n")
        if per_step:
            fh.write("GPU ms per step by kernel category: ")
            fh.write(", ".join(f"{k} {v:.2f}" for k, v in per_step.items()) + "\n\n")
        if casts:
            fh.write("GPU ms per step of the MX casts, by what they cast:\n")
            fh.write("".join(f"  {k:70s} {v:8.3f}\n" for k, v in casts.items()) + "\n")
        fh.write(prof.key_averages().table(sort_by=sort_by, row_limit=50, max_name_column_width=90))
        fh.write(f"\n\nThe same, by input shapes ({n} steps):\n")
        by_shape = prof.key_averages(group_by_input_shape=True)
        total = sort_by.replace("self_", "")  # total, not self: a C++ operator owns its kernels
        fh.write(
            by_shape.table(sort_by=total, row_limit=80, max_name_column_width=60, max_shapes_column_width=90)
        )
    out = {"gpu_ms_per_step": per_step} if per_step else {}
    if casts:
        out["cast_ms_per_step"] = casts
    return out


def _row_in_subprocess(rest: list[str], variant: str, mode: str, args) -> dict:
    """One row measured by `python -m mxmoe bench train` in a child process, the row's variant and
    mode only (`--same_process`); the row comes back through a JSON file. The caller (this process)
    holds no CUDA context: a child beside a parent holding one ran the host-bound MX per-block
    compile step slower than the same row run alone."""
    import json
    import os
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory(prefix="mxmoe_bench_train_") as tmp:
        out = os.path.join(tmp, "row.json")
        cmd = [sys.executable, "-m", "mxmoe", "bench", "train", *rest, "--variants", variant, "--modes", mode,
               "--steps", str(args.steps), "--warmup_steps", str(args.warmup_steps),
               "--same_process", "--json", out]
        if args.profile:
            cmd += ["--profile", args.profile, "--profile_steps", str(args.profile_steps)]
        # its stdout (its own one-row table) is dropped; its stderr (warnings, TORCH_LOGS, a crash) is ours
        proc = subprocess.run(cmd, stdout=subprocess.DEVNULL)
        if os.path.exists(out):
            with open(out) as fh:
                return json.load(fh)["rows"][0]
    raise RuntimeError(f"the row's process exited with code {proc.returncode}, no row (its stderr: above)")


def _device_type(pref: str) -> str:
    """cpu or cuda, as init_distributed would pick, without creating a CUDA context."""
    if pref == "cpu" or (pref == "auto" and not torch.cuda.is_available()):
        return "cpu"
    return "cuda"


def run(cfg, args, rest: list[str] | tuple[str, ...] = ()) -> list[dict]:
    """The rows, each (variant, mode) in a child process unless `args.same_process` or several
    torchrun ranks (then here, one after another). `rest`: the trainer's arguments, for the children."""
    from mxmoe.train import parallel

    fresh = not args.same_process and parallel.launch_env()[1] == 1
    if fresh:
        device, own_pg = torch.device(_device_type(cfg.training.device)), False
    else:
        _, _, device, own_pg = parallel.init_distributed(cfg.training.device, cfg.parallelism.timeout_s)
        if cfg.training.cpu_threads:
            torch.set_num_threads(cfg.training.cpu_threads)
    modes = args.modes or (list(MODES) if device.type == "cuda" else ["eager"])
    rows = []
    try:
        # --debug.deterministic=true times the trainer's deterministic mode (each child enters it)
        with determinism.deterministic_mode(cfg.debug.deterministic and not fresh):
            determinism.settle_cublas_config(device)
            for mode in modes:
                for variant in args.variants:
                    try:
                        if fresh:
                            row = _row_in_subprocess(list(rest), variant, mode, args)
                        else:
                            row = _one(cfg, variant, mode, device, args)
                    except Exception as e:  # reported in the table; the other modes still run
                        row = {"variant": variant, "mode": mode, "error": f"{type(e).__name__}: {e}"[:200]}
                    rows.append(row)
                    if not fresh:
                        gc.collect()
                        torch._dynamo.reset()
                        if device.type == "cuda":
                            torch.cuda.empty_cache()
    finally:
        if own_pg:
            import torch.distributed as dist

            dist.destroy_process_group()
    base = {r["mode"]: r["tokens_per_s"] for r in rows if r["variant"] == "bf16" and "tokens_per_s" in r}
    for r in rows:
        if "tokens_per_s" in r and r["mode"] in base:
            r["vs_bf16"] = r["tokens_per_s"] / base[r["mode"]]
    return rows


def main(argv: list[str] | None = None) -> int:
    from mxmoe.nn.converter import asked_options
    from mxmoe.train.build import check_bench_values, check_cast_kernels, check_compile_backend
    from mxmoe.train.config import ConfigError, parse_args
    from mxmoe.train.parallel import check_device, launch_env

    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    timing.check_json(parser, args.json)
    if args.profile:
        from mxmoe.cli import check_out_folder

        try:  # before any row: each row writes its table there after its timed steps
            check_out_folder(args.profile, "--profile")
        except ValueError as e:
            parser.error(str(e))
    try:
        cfg = parse_args(rest, prog="mxmoe bench train")
        check_bench_values(cfg)
        check_device(cfg.training.device)
        if "mx" in args.variants:
            check_cast_kernels(cfg, torch.device(_device_type(cfg.training.device)))
        elif not args.same_process and not cfg.mx.allow_unconverted and asked_options(cfg.mx):
            # (a row's own process, --same_process, gets the parent's options with its one variant)
            given = ", ".join(f"mx.{k}={v!r}" for k, v in asked_options(cfg.mx).items())
            raise ValueError(
                f"{given} given, but --variants={','.join(args.variants)} has no mx row: the options would "
                "be ignored. Add mx to --variants, or set mx.allow_unconverted=true"
            )
        device_type = _device_type(cfg.training.device)
        graphed = [m for m in args.modes or () if "graph" in m or m == "reduce_overhead"]
        if graphed and device_type != "cuda":  # before any row (each failed in its own process)
            raise ValueError(
                f"--modes={','.join(args.modes)}: {', '.join(graphed)} replay CUDA graphs, which need a CUDA "
                f"device; this run's is {device_type} (training.device={cfg.training.device!r}): use eager, "
                "compile or compile_full"
            )
        if args.modes is None or any(_COMPILE[m] for m in args.modes):
            check_compile_backend(cfg.compile.backend, "compile.backend")
        launch_env()  # the launcher's variables, before any row
    except (ConfigError, ValueError) as e:
        parser.error(str(e))
    rows = run(cfg, args, rest)
    keys = (
        "variant",
        "mode",
        "tokens_per_s",
        "vs_bf16",
        "step_ms",
        "host_ms",
        "peak_mem_gib",
        "warmup_s",
        "graphs",
        "graph_breaks",
        "graphs_timed",
        "loss",
        "deterministic",
        "error",
    )
    table = [{k: r.get(k, "") for k in keys if any(k in q for q in rows)} for r in rows]
    t, env = cfg.training, timing.environment()
    where = ", ".join(f"{k} {v}" for k, v in env.items())
    timing.print_table(
        table,
        title=f"training steps, model {cfg.model.name}, {t.local_batch_size}x{t.seq_len} tokens/step, "
        f"{args.steps} timed after {args.warmup_steps} warm-up ({where})",
        floatfmt=".4g",
    )
    for r in rows:
        if r.get("converted"):
            print(f"{r['variant']} {r['mode']}: {r['converted']}")
            break
    if args.json:
        timing.write_json(
            args.json,
            {
                "bench": "train",
                "config": cfg.to_dict(),
                "steps": args.steps,
                "warmup_steps": args.warmup_steps,
                "environment": env,
                "rows": rows,
            },
        )
    return 0 if all("error" not in r for r in rows) else 1
