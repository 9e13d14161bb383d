"""`mxmoe compare`'s runs: one `python -m mxmoe train` subprocess per (variant, seed), `parallel` at
a time, each recorded in its folder's command.json so that a finished run is not run again."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from mxmoe.train.checkpoint import save_seconds

# trainer options compare sets itself for every run: a variant or the extra arguments may not
_OWN = ("--debug.seed", "--job.dump_folder")

def parse_variant(text: str) -> tuple[str, list[str]]:
    """'NAME=ARGS' (or 'NAME': no options) -> (NAME, shlex-split ARGS); an argparse `type`."""
    name, _, args = text.partition("=")
    name = name.strip()
    if not name or name.startswith(".") or not all(c.isalnum() or c in "_-." for c in name):
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected NAME=ARGS, NAME of letters, digits, '_', '-', '.' (a folder name), ARGS the "
            "trainer options of the variant as one string (none: 'bf16' or 'bf16=')"
        )
    try:
        parts = shlex.split(args)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None
    return name, parts


def check_own(where: str, args: list[str]) -> None:
    for a in args:
        if a.split("=", 1)[0] in _OWN:
            raise ValueError(f"{where}: {a!r} is set by mxmoe compare itself (per run); remove it")


def _checkpoint_folder(args: list[str]) -> str | None:
    """The last `--checkpoint.folder` value in trainer arguments (`=VALUE` or a separate VALUE), or
    None if they set none (the trainer takes the last one)."""
    value = None
    for i, a in enumerate(args):
        if a.startswith("--checkpoint.folder="):
            value = a.split("=", 1)[1]
        elif a == "--checkpoint.folder" and i + 1 < len(args):
            value = args[i + 1]
    return value


def trainer_argv(cfg: str, steps: int | None, deterministic: bool, vargs, extra, seed: int, folder: Path):
    """The `mxmoe train` arguments of one run: the config, no checkpoints (the config's folder would
    be every run's), the deterministic mode and steps, the variant's and the common options, then
    the seed and the metrics folder `folder` (OUT/runs/VARIANT/seedS). A checkpoint folder X among
    the options becomes X/VARIANT/seedS, the run's own: runs never resume one another."""
    argv = [f"--config={cfg}", "--checkpoint.folder=", "--metrics.progress_bar=false"]
    if deterministic:
        argv.append("--debug.deterministic=true")
    if steps is not None:
        argv.append(f"--training.steps={steps}")
    argv += list(vargs) + list(extra) + [f"--debug.seed={seed}", f"--job.dump_folder={folder}"]
    ckpt = _checkpoint_folder(list(vargs) + list(extra))
    if ckpt:
        argv.append(f"--checkpoint.folder={Path(ckpt) / folder.parent.name / folder.name}")
    return argv


DONE = "done"


def _last_value(args: list[str], option: str) -> str | None:
    """The last `option=VALUE` (or `option VALUE`) in trainer arguments, or None."""
    value = None
    for i, a in enumerate(args):
        if a.startswith(option + "="):
            value = a.split("=", 1)[1]
        elif a == option and i + 1 < len(args):
            value = args[i + 1]
    return value


def reached_last_step(argv: list[str], folder: Path) -> bool:
    """Whether the run of `argv` logged its last step (`--training.steps`) in folder/metrics.jsonl: a
    run that got SIGTERM during its last step finished it, and counts as finished."""
    steps = _last_value(argv, "--training.steps")
    try:
        lines = (folder / "metrics.jsonl").read_text().splitlines()
        return steps is not None and bool(lines) and json.loads(lines[-1]).get("step") == int(steps)
    except (OSError, ValueError, AttributeError):
        return False


def grace_seconds(jobs: list[tuple[str, int, list[str], Path]], given: float | None) -> float:
    """How long before the time limit the runs get SIGTERM, so that a run's checkpoint (saved when
    it gets SIGTERM) is written before the SIGKILL at the limit: the longer of `given` (--grace-s)
    and 1.5 x the longest save recorded in the jobs' checkpoint folders (`save_s` of their
    manifests: the saves of earlier calls) + 10 s. With no save recorded: `given`, else 120 s (30 s
    when no run has a checkpoint folder: a run then only finishes its step)."""
    folders = [f for *_, argv, _ in jobs if (f := _checkpoint_folder(argv))]
    recorded = [x for f in folders if (x := save_seconds(f)) is not None]
    if recorded:
        return max(1.5 * max(recorded) + 10.0, given or 0.0)
    return given if given is not None else (120.0 if folders else 30.0)


def launch(
    jobs: list[tuple[str, int, list[str], Path]],
    parallel: int,
    devices: list[str] | None,
    nproc: int = 1,
    time_limit_s: float | None = None,
    grace_s: float = 0.0,
    delete_checkpoints: bool = False,
) -> dict:
    """Run `python -m mxmoe train ARGV` per job (variant, seed, argv, folder), `parallel` at a time
    (per group of `nproc` devices when `devices` are given; with nproc > 1 under
    `torch.distributed.run --standalone`); a job whose folder's command.json records the same argv
    and status 0 is skipped. `time_limit_s` bounds the whole call: `grace_s` before it no run starts
    and running ones get SIGTERM (the trainer stops after its step and saves its checkpoint; the run
    counts as unfinished), at it whatever still runs is killed (`grace_seconds` picks a grace that
    lets the save finish). delete_checkpoints: a run that finishes deletes its own checkpoint folder
    (the last --checkpoint.folder of its argv). Returns {(variant, seed): DONE or what else happened}."""
    if time_limit_s is not None and not 0 <= grace_s < time_limit_s:
        raise ValueError(f"grace_s={grace_s}: expected 0 <= grace_s < time_limit_s={time_limit_s}")
    end = None if time_limit_s is None else time.monotonic() + time_limit_s
    deadline = None if end is None else end - grace_s  # SIGTERM; SIGKILL at `end`
    status: dict = {}
    lock = threading.Lock()
    free = None  # device slots: CUDA_VISIBLE_DEVICES values, each `parallel` times
    if devices:
        groups = [",".join(devices[i : i + nproc]) for i in range(0, len(devices) - nproc + 1, nproc)]
        free = [g for g in groups for _ in range(parallel)]
    if nproc > 1:
        # --standalone: a free rendezvous port per run, so concurrent runs do not collide
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
        cmd += ["-m", "mxmoe", "train"]
    else:
        cmd = [sys.executable, "-m", "mxmoe", "train"]
    todo = []
    for variant, seed, argv, folder in jobs:
        done = folder / "command.json"
        try:
            prev = json.loads(done.read_text())
        except (OSError, ValueError):
            prev = None
        key = ("argv", "nproc", "returncode", "stopped")
        if prev and tuple(prev.get(k) for k in key) == (argv, nproc, 0, False):
            print(f"{variant} seed {seed}: done before ({folder}), not run again", flush=True)
            status[(variant, seed)] = DONE
        else:
            todo.append((variant, seed, argv, folder))

    def one(job) -> None:
        variant, seed, argv, folder = job
        if deadline is not None and time.monotonic() >= deadline:
            with lock:
                status[(variant, seed)] = "not started (time limit)"
            return
        env = dict(os.environ)
        device = None
        if free is not None:
            with lock:
                device = free.pop(0)
            env["CUDA_VISIBLE_DEVICES"] = device
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "command.json").unlink(missing_ok=True)
        t0 = time.monotonic()
        stopped = False
        with open(folder / "train.log", "w") as log:
            proc = subprocess.Popen([*cmd, *argv], stdout=log, stderr=subprocess.STDOUT, env=env)
            try:
                proc.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                stopped = True
                proc.terminate()  # SIGTERM: the trainer finishes its step, saves, closes its metrics
                try:
                    proc.wait(max(1.0, end - time.monotonic()))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        rc = proc.returncode
        if stopped and rc == 0 and reached_last_step(argv, folder):
            stopped = False  # the SIGTERM came during the last step: the run finished
        ckpt = _checkpoint_folder(argv)
        if delete_checkpoints and rc == 0 and not stopped and ckpt:
            shutil.rmtree(ckpt, ignore_errors=True)  # a finished run's: frees the disk for the others
        if free is not None:
            with lock:
                free.append(device)
        secs = time.monotonic() - t0
        record = {
            "argv": argv,
            "nproc": nproc,
            "returncode": rc,
            "stopped": stopped,
            "seconds": round(secs, 1),
        }
        record["device"] = device
        (folder / "command.json").write_text(json.dumps(record, indent=2) + "\n")
        with lock:
            if stopped:
                what = "stopped at the time limit"
            else:
                what = DONE if rc == 0 else f"FAILED (exit status {rc}; see {folder / 'train.log'})"
            status[(variant, seed)] = what
            print(f"{variant} seed {seed}: {what} after {secs:.0f} s", flush=True)

    with ThreadPoolExecutor(max_workers=len(free) if free else parallel) as pool:
        list(pool.map(one, todo))
    return status
