"""FSDP2 weight all-gathers in MXFP8 vs bf16 over NGPU GPUs of one host (issue 58, item 5): tokens/s
and all-gather time per step, mxmoe's trainer and torchtitan 0.2.2's, three runs each:

    bf16        no converter (bf16 training, FSDP2 gathers bf16)
    mx          MX linears and experts, FSDP2 gathers the weights in bf16
    mx_gather   the same with --mx.fsdp_mxfp8_all_gather (MXFP8 gathers)

    python scripts/fsdp_mx_gather.py OUT_DIR --ngpu 8 [--steps 30] [--runs mxmoe_bf16,mxmoe_mx,...]
    python scripts/fsdp_mx_gather.py OUT_DIR --ngpu 2 --device cpu --steps 4   # gloo, mxmoe only

On CUDA every run compiles its blocks (`--compile.enable`; the MXFP8 gather compiles too), as the
trainers run for speed; on CPU they run eager.
mxmoe runs: `torchrun -m mxmoe train --config CONFIG` (default moe_1b; expert parallelism off, so
the experts are FSDP-sharded too), profiled at the last step; torchtitan runs: torchtitan.train on
`mxmoe config path torchtitan/deepseek_v3_debug_0.2` with scripts/torchtitan_ep_flavor.py's
"mxmoe_ep" model (dim 5120, 16 experts, 4 layers; FSDP over every GPU, no expert parallelism),
local batch 2 x 8192 tokens, profiled at the last step (torchtitan 0.2.2 installed as
scripts/torchtitan_ep.sh installs it; its text data and byte tokenizer are written to OUT_DIR). --device cpu
runs the mxmoe runs on gloo ranks with the debug_moe config (torchtitan 0.2 assumes CUDA).
All-gather time: the summed duration of the all-gather events of rank 0's Chrome trace of the
profiled step (NCCL kernels on CUDA, the gloo operators on CPU). Writes OUT_DIR/<run>.log and
OUT_DIR/summary.md (tokens/s is the mean over the steps after the first).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from mxmoe import configs

MXMOE = {
    "mxmoe_bf16": [],
    "mxmoe_mx": ["--model.converters=mx"],
    "mxmoe_mx_gather": ["--model.converters=mx", "--mx.fsdp_mxfp8_all_gather=true"],
}
TITAN = {
    "titan_bf16": [],
    "titan_mx": ["--model.converters", "mxmoe"],
    "titan_mx_gather": ["--model.converters", "mxmoe", "--mx.fsdp_mxfp8_all_gather"],
}
PYTHON = os.environ.get("PY") or sys.executable


def commands(out: Path, ngpu: int, *, steps: int, device: str, config: str) -> dict[str, list[str]]:
    """Each run's command line (what the CPU test runs and checks)."""
    run = [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ngpu)]
    cmds = {}
    for name, flags in MXMOE.items():
        cmds[name] = [*run, "-m", "mxmoe", "train", "--config", config, f"--job.dump_folder={out / name}",
                      f"--training.steps={steps}", f"--training.device={device}",
                      "--metrics.progress_bar=false", "--metrics.log_freq=1", "--validation.freq=0",
                      "--checkpoint.folder=", "--profiling.enable_profiling=true",
                      f"--profiling.profile_freq={steps}", "--profiling.profiler_active=1",
                      f"--compile.enable={str(device == 'cuda').lower()}", *flags]
    if device == "cuda":
        for name, flags in TITAN.items():
            cmds[name] = [*run, "-m", "torchtitan.train",
                          "--job.config_file", str(configs.path("torchtitan/deepseek_v3_debug_0.2")),
                          "--job.dump_folder", str(out / name),
                          "--experimental.custom_import", "torchtitan_ep_flavor",
                          "--model.flavor", "mxmoe_ep",
                          "--model.hf_assets_path", str(out / "tt_tokenizer"),
                          "--training.dataset_path", str(out / "tt_data"),
                          "--training.steps", str(steps), "--training.local_batch_size", "2",
                          "--training.seq_len", "8192", "--parallelism.data_parallel_shard_degree", "-1",
                          "--debug.seed", "0", "--metrics.log_freq", "1", "--profiling.enable_profiling",
                          "--profiling.profile_freq", str(steps), "--compile.enable", *flags]  # fmt: skip
    return cmds


def _fresh(path: str | Path, since: float | None) -> bool:
    """Whether `path` was written at or after `since` (time.time() when its run started; a second of
    slack for file systems that keep whole seconds): files an earlier call left in a run's folder
    are not this run's."""
    return since is None or os.path.getmtime(path) >= since - 1.0


def all_gather_ms(folder: Path, since: float | None = None) -> float | None:
    """Summed duration (ms) of the all-gather events in rank 0's Chrome trace under `folder` (of the
    last step profiled; only traces written since `since`: see `_fresh`)."""
    found = glob.glob(str(folder / "**" / "rank0*.json"), recursive=True)
    traces = sorted(t for t in found if _fresh(t, since))
    if not traces:
        return None
    events = json.loads(Path(traces[-1]).read_text()).get("traceEvents", [])
    hits = [e for e in events if "allgather" in str(e.get("name", "")).lower().replace("_", "")
            and "dur" in e]
    kernels = [e for e in hits if e.get("cat") == "kernel"]
    gloo = [e for e in hits if e.get("cat") == "cpu_op" and e["name"].startswith(("c10d::", "gloo:"))]
    ops = kernels or gloo
    return sum(e["dur"] for e in ops) / 1e3


def tokens_per_s(name: str, folder: Path, log: str, since: float | None = None) -> float | None:
    """Mean tokens/s over the steps after the first (mxmoe: of a metrics.jsonl written since `since`)."""
    if name.startswith("mxmoe"):
        path = folder / "metrics.jsonl"
        if not path.exists() or not _fresh(path, since):
            return None
        tps = [json.loads(x)["tokens_per_s"] for x in path.read_text().splitlines()]
    else:
        tps = [float(m) for m in re.findall(r"tps: ([\d,.]+)", log.replace(",", ""))]
    tps = tps[1:] or tps
    return sum(tps) / len(tps) if tps else None


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--ngpu", type=int, required=True, help="ranks: 2, 4 or 8 GPUs (or CPU processes)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--config", default=None, help="mxmoe's config (default moe_1b; debug_moe on cpu)")
    ap.add_argument("--runs", default=None, help="comma-separated subset of the runs")
    ap.add_argument("--timeout", type=int, default=1800)
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args(argv)
    if args.ngpu < 1 or args.steps < 2:
        raise SystemExit(f"--ngpu={args.ngpu} --steps={args.steps}: expected ngpu >= 1 and steps >= 2")
    config = args.config or ("moe_1b" if args.device == "cuda" else "debug_moe")
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out.resolve()
    cmds = commands(out, args.ngpu, steps=args.steps, device=args.device, config=config)
    if args.runs:
        unknown = set(args.runs.split(",")) - set(cmds)
        if unknown:
            raise SystemExit(f"--runs: unknown {sorted(unknown)}; expected some of {sorted(cmds)}")
        cmds = {k: v for k, v in cmds.items() if k in args.runs.split(",")}
    env = dict(os.environ)
    if any(n in TITAN for n in cmds) and not args.dry_run:
        from mxmoe.integrations.torchtitan.data import write_byte_tokenizer, write_text_dataset

        write_byte_tokenizer(out / "tt_tokenizer")
        write_text_dataset(out / "tt_data")  # the Python standard library
        scripts = str(Path(__file__).resolve().parent)  # torchtitan_ep_flavor
        env["PYTHONPATH"] = os.pathsep.join(p for p in (scripts, env.get("PYTHONPATH")) if p)
    rows = {}
    for name, cmd in cmds.items():
        print(" ".join(cmd), flush=True)
        if args.dry_run:
            continue
        log = out / f"{name}.log"
        t0 = time.time()  # the run's own files only: an earlier call's stay in its folder
        with open(log, "w") as fh:
            try:
                rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, timeout=args.timeout,
                                    env=env).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        text = log.read_text()
        rows[name] = {"rc": rc, "tokens_per_s": tokens_per_s(name, out / name, text, t0),
                      "all_gather_ms": all_gather_ms(out / name, t0)}
    if rows:
        head = f"FSDP2 gathers over {args.ngpu} {args.device} ranks, {args.steps} steps, config {config}"
        lines = [head,
                 "", "| run | rc | tokens/s | all-gather ms (profiled step) |", "|---|---|---|---|"]
        for name, r in rows.items():
            tps = "-" if r["tokens_per_s"] is None else f"{r['tokens_per_s']:.0f}"
            ag = "-" if r["all_gather_ms"] is None else f"{r['all_gather_ms']:.2f}"
            lines.append(f"| {name} | {r['rc']} | {tps} | {ag} |")
        (out / "summary.md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines))
    return rows


if __name__ == "__main__":
    main()
