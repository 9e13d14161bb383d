"""Seconds of `Checkpointer.save` (DCP's files, their SHA-256, the manifest) by writer threads, on CPU.

A model of `--gib` GiB of fp32 parameters (64 MiB each) with AdamW's two moments (3x that saved),
saved into `--folder` (default /dev/shm: the study's checkpoints live in RAM) with each
`--threads` value, interleaved, `--repeats` times; prints the median and every time. What a stopped
run's save costs is what the grace before a time limit must allow (docs/training.md#checkpoints).

    python scripts/checkpoint_save_cpu.py [--gib 1] [--threads 1,2] [--repeats 5] [--folder /dev/shm]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's mxmoe

import torch  # noqa: E402

from mxmoe.train.checkpoint import Checkpointer  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=1.0, help="GiB of parameters (saved: 3x, AdamW)")
    p.add_argument("--threads", default="1,2", help="comma list of writer threads per save")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--folder", default="/dev/shm")
    a = p.parse_args()
    threads = [int(t) for t in a.threads.split(",")]
    n = max(1, round(a.gib * 16))  # 64 MiB parameters
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(16, 1 << 20)) for _ in range(n)])
    opt = torch.optim.AdamW(model.parameters())
    sum(q.sum() for q in model).backward()
    opt.step()
    times: dict[int, list[float]] = {t: [] for t in threads}
    root = tempfile.mkdtemp(dir=a.folder)
    try:
        for _ in range(a.repeats):
            for t in threads:
                ck = Checkpointer(os.path.join(root, f"t{t}"), keep_latest=1, threads=t)
                t0 = time.perf_counter()
                ck.save(1, model, opt, {"step": 1})
                times[t].append(time.perf_counter() - t0)
                shutil.rmtree(os.path.join(root, f"t{t}"))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, {3 * n / 16:.2f} GiB saved into {a.folder}")
    for t, v in times.items():
        print(f"threads {t}: median {statistics.median(v):.2f} s ({' '.join(f'{x:.2f}' for x in v)})")


if __name__ == "__main__":
    main()
