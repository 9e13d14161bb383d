"""torchtitan 0.2.2's trainer with expert parallelism over NGPU GPUs of one host (2 or 4 H200s),
four ways with the same seed, data and model, then mxmoe's all-to-all alone:

    bf16      torchtitan's bf16 model and its bf16 exchange (its ExpertParallel)
    mxmoe     --model.converters mxmoe: MX Linear layers and experts, the MXFP8 exchange
    exchange  --model.converters mxmoe --mx.expert_gemm bf16 --mx.no-convert-linears: bf16 GEMMs
              everywhere (the experts' on MX-rounded rows), the MXFP8 exchange only
    torchao   --model.converters torchao_mxfp8: torchao 0.18's emulated MXFP8 on the same modules as
              mxmoe (scripts/torchtitan_torchao_peer.py), torchtitan's bf16 exchange
    a2a       torchrun -m mxmoe bench a2a at 16 x 8192 x 5120 per rank (symm and nccl transports)

Model: scripts/torchtitan_ep_flavor.py's "mxmoe_ep" (DeepSeek-V3, dim 5120, 16 experts of hidden
2048, top-8, 4 layers), local batch 2 x 8192 tokens per GPU, EP = FSDP = NGPU, AdamW
(the schedule of `mxmoe config show torchtitan/deepseek_v3_debug_0.2`), eager unless --compile.

    scripts/torchtitan_ep.sh OUT_DIR NGPU [--steps 30] [--timeout 600] [--runs bf16,mxmoe,...]
                                          [--flavor mxmoe_ep] [--local-batch 2] [--seq-len 8192]
                                          [--compile] [--dry-run]

writes OUT_DIR/<run>.log (torchtitan's logs), OUT_DIR/<run>.csv and OUT_DIR/summary.md (loss and
tokens/s per GPU side by side, scripts/torchtitan_summary.py), OUT_DIR/a2a.log and a2a.json.
A trainer run longer than --timeout seconds is stopped and summarized with the steps it logged; the
all-to-all bench stopped (or failed) is a failed run, and leaves no a2a.json.
Targets it measures (docs/torchtitan.md): exchange >= 1.0x bf16's tokens/s at EP=2, mxmoe >=
0.95x; the all-to-all alone >= 1.9x bf16 at 16 x 8192 x 5120 per rank.

scripts/torchtitan_ep.sh installs the wheels and writes the data; this module builds and runs the
commands (`commands` is what the CPU test checks against torchtitan's parser).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from mxmoe import configs

REPO = Path(__file__).resolve().parents[1]
CONFIG = configs.path("torchtitan/deepseek_v3_debug_0.2")
VARIANTS: dict[str, list[str]] = {
    "bf16": [],
    "mxmoe": ["--model.converters", "mxmoe"],
    "exchange": ["--model.converters", "mxmoe", "--mx.expert_gemm", "bf16", "--mx.no-convert-linears"],
    "torchao": ["--model.converters", "torchao_mxfp8"],
}
"""Trainer runs: their flags beyond the common ones."""
RUNS = (*VARIANTS, "a2a")
PYTHON = os.environ.get("PY") or sys.executable
"""The Python of the runs (scripts/torchtitan_ep.sh exports PY)."""


def trainer_args(
    out: Path, name: str, data: Path, tokenizer: Path, ngpu: int, *, steps: int, flavor: str,
    local_batch: int, seq_len: int, compile: bool,
) -> list[str]:
    """torchtitan.train's arguments for run `name` (a key of VARIANTS)."""
    return [
        "--job.config_file", str(CONFIG),
        "--job.dump_folder", str(out / name),
        "--experimental.custom_import", "torchtitan_ep_flavor",
        "--model.flavor", flavor,
        "--model.hf_assets_path", str(tokenizer),
        "--training.dataset_path", str(data),
        "--training.steps", str(steps),
        "--training.local_batch_size", str(local_batch),
        "--training.seq_len", str(seq_len),
        "--parallelism.data_parallel_shard_degree", "-1",
        "--parallelism.expert_parallel_degree", str(ngpu),
        "--debug.seed", "0",
        *(["--compile.enable"] if compile else []),
        *VARIANTS[name],
    ]  # fmt: skip


def commands(out: Path, data: Path, tokenizer: Path, ngpu: int, **kw) -> dict[str, list[str]]:
    """The command line of every run: the trainer runs under torchrun, then the all-to-all bench."""
    torchrun = [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ngpu)]
    cmds = {
        name: [*torchrun, "-m", "torchtitan.train", *trainer_args(out, name, data, tokenizer, ngpu, **kw)]
        for name in VARIANTS
    }
    cmds["a2a"] = [
        *torchrun, "-m", "mxmoe", "bench", "a2a", "--batches", "16", "--seq", "8192", "--dims", "5120",
        "--transport", "symm,nccl", "--json", str(out / "a2a.json"),
    ]  # fmt: skip
    return cmds


def run(cmd: list[str], log: Path, timeout: float) -> int:
    """Run `cmd` with its output in `log`; stopped (and its process group killed) after `timeout` s."""
    t0 = time.monotonic()
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True, cwd=REPO)
        try:
            rc = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, 15)
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, 9)
                p.wait()
            rc = 124
    print(f"   exit {rc} after {time.monotonic() - t0:.0f}s", flush=True)
    return rc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="output folder")
    ap.add_argument("ngpu", type=int, choices=(2, 4), help="GPUs of this host (EP = FSDP = NGPU)")
    ap.add_argument("--steps", type=int, default=30, help="training steps per run (default 30)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per run (default 600)")
    ap.add_argument("--runs", default=",".join(RUNS), help=f"comma list of {', '.join(RUNS)} (default all)")
    ap.add_argument("--flavor", default="mxmoe_ep", help="torchtitan DeepSeek-V3 flavor (default mxmoe_ep)")
    ap.add_argument("--local-batch", type=int, default=2, help="sequences per GPU (default 2)")
    ap.add_argument("--seq-len", type=int, default=8192, help="tokens per sequence (default 8192)")
    ap.add_argument("--compile", action="store_true", help="--compile.enable for the trainer runs")
    ap.add_argument("--data", type=Path, required=True,
                    help="text data folder (python -m mxmoe.integrations.torchtitan.data)")
    ap.add_argument("--tokenizer", type=Path, required=True, help="tokenizer folder (the byte tokenizer)")
    ap.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = ap.parse_args(argv)
    runs = [r for r in args.runs.split(",") if r]
    bad = sorted(set(runs) - set(RUNS))
    if bad:
        ap.error(f"--runs: {bad} are not runs; expected some of {list(RUNS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    cmds = commands(
        args.out.resolve(), args.data.resolve(), args.tokenizer.resolve(), args.ngpu, steps=args.steps,
        flavor=args.flavor, local_batch=args.local_batch, seq_len=args.seq_len, compile=args.compile,
    )  # fmt: skip
    failed = []
    for name in runs:
        print(f"== {name}: {' '.join(cmds[name])}", flush=True)
        if args.dry_run:
            continue
        if name == "a2a":  # an earlier call's a2a.json would stand for this call's if it writes none
            (args.out / "a2a.json").unlink(missing_ok=True)
        rc = run(cmds[name], args.out / f"{name}.log", args.timeout)
        # a trainer run stopped at the timeout is summarized with the steps it logged; the
        # all-to-all bench stopped has no result
        if rc not in (0, 124) or (name == "a2a" and rc != 0):
            failed.append(name)
    trained = [r for r in runs if r in VARIANTS]
    if trained and not args.dry_run:
        summary = REPO / "scripts" / "torchtitan_summary.py"
        subprocess.run([PYTHON, str(summary), str(args.out), *trained], check=True)
    if failed:
        print(f"failed: {failed} (see their logs)", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
