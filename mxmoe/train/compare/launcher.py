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


def check_trainer_args(where: str, argv: list[str], world: int = 1):
    """ValueError naming `where` unless `mxmoe train` accepts `argv` on `world` processes (its parser,
    its checks of the values, `mxmoe.train.build.check_values`, and of the parallel degrees against
    `world` and the model, `mxmoe.train.parallel.check_parallel_dims`): a misspelled or out-of-range
    option stops compare before any run starts, not in its own run after the others (tyro's
    message, for an option it refuses, is on stderr above). Returns the resolved `JobConfig`."""
    from mxmoe.train import parallel
    from mxmoe.train.build import build_model_args, check_values
    from mxmoe.train.config import parse_args

    try:
        cfg = parse_args(argv, prog="mxmoe train")
        check_values(cfg)
        p = cfg.parallelism
        pd = parallel.make_parallel_dims(
            world, p.data_parallel_shard_degree, p.expert_parallel_degree, p.tensor_parallel_degree
        )
        parallel.check_parallel_dims(pd, build_model_args(cfg).num_experts)
        return cfg
    except SystemExit:
        raise ValueError(f"{where}: `mxmoe train` refuses its options (its message is above)") from None
    except (ValueError, TypeError) as e:
        raise ValueError(f"{where}: {e}") from None


PAIRED_KEYS = (
    "training.steps",
    "training.seq_len",
    "training.local_batch_size",
    "data.path",
    "data.val_fraction",
    "data.max_files",
    "data.extensions",
)
"""Trainer options every variant must share with the baseline: what a paired difference needs the
runs to share (`mxmoe.train.compare.report.SETUP`: steps, seq_len, global batch, corpus)."""


def check_paired_setup(configs: dict, baseline: str) -> None:
    """ValueError naming each variant and option whose value differs from the baseline's among
    PAIRED_KEYS (`configs`: variant -> its resolved JobConfig), before any run: the runs could not be
    paired after they finished (`report.check_setups`)."""
    base = configs[baseline].flat()
    diffs = []
    for name, cfg in configs.items():
        flat = cfg.flat()
        diffs += [
            f"--variant {name}: {k}={flat[k]!r}, the baseline {baseline}'s is {base[k]!r}"
            for k in PAIRED_KEYS
            if name != baseline and flat[k] != base[k]
        ]
    if diffs:
        raise ValueError(
            f"{'; '.join(diffs)}: runs of different setups cannot be paired (a paired difference needs the "
            "same steps, sequence length, global batch and corpus); set these for every variant "
            "(--steps, or trainer options after `--`)"
        )


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


def _options(args: list[str]) -> list[tuple[str, list[str]]]:
    """(key, its tokens) per option of trainer arguments, in order: `--key=value`, `--key value`
    (two tokens) or a bare `--key`; a token that is no option gets the key ""."""
    out, i = [], 0
    while i < len(args):
        a = args[i]
        key, eq, _ = a[2:].partition("=") if a.startswith("--") else ("", "", "")
        if key and not eq and i + 1 < len(args) and not args[i + 1].startswith("--"):
            out.append((key.replace("-", "_"), [a, args[i + 1]]))
            i += 2
            continue
        out.append((key.replace("-", "_"), [a]))
        i += 1
    return out


def trainer_argv(cfg: str, steps: int | None, deterministic: bool, vargs, extra, seed: int, folder: Path):
    """The `mxmoe train` arguments of one run: the config, no checkpoints (the config's folder would
    be every run's), the deterministic mode and steps (each unless the options set it), the
    variant's and the common options, then the seed and the metrics folder `folder`
    (OUT/runs/VARIANT/seedS). A checkpoint folder X among the options becomes X/VARIANT/seedS, the
    run's own: runs never resume one another. An option compare sets itself is left out when the
    variant's or the common options set it (the trainer warns of a key given twice)."""
    user = _options(list(vargs) + list(extra))
    keys = [k for k, _ in user if k]
    own = [
        ("checkpoint.folder", "--checkpoint.folder="),
        ("metrics.progress_bar", "--metrics.progress_bar=false"),
    ]
    if deterministic:
        own.append(("debug.deterministic", "--debug.deterministic=true"))
    if steps is not None:
        own.append(("training.steps", f"--training.steps={steps}"))
    ckpt = _checkpoint_folder(list(vargs) + list(extra))
    argv = [f"--config={cfg}"] + [arg for key, arg in own if key not in keys]
    argv += [tok for k, t in user if not (ckpt and k == "checkpoint.folder") for tok in t]
    argv += [f"--debug.seed={seed}", f"--job.dump_folder={folder}"]
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


# a run the grace would stop finishes instead when its remaining steps, at the rate its current
# process logged them, take at most (time left before the limit - FINISH_MARGIN_S) / FINISH_FACTOR:
# a stop saves a checkpoint that takes longer to write than the last steps take to run (moe_2b's
# 23 GB: more than 75 s on an H100 host's /dev/shm, where its last 109 steps needed ~27 s)
FINISH_FACTOR = 1.1
FINISH_MARGIN_S = 15.0
STALE_S = 60.0


def seconds_to_finish(argv: list[str], folder: Path, now: float | None = None) -> tuple[int, float] | None:
    """(steps left, seconds they need) for the run of `argv` from its folder/metrics.jsonl: the steps
    up to `--training.steps` after the last record, at the rate between the first and the last
    record of the process that wrote the last one (its run_id: a resumed run's start-up and
    compilation come before its first record), less the time since the last record (wall clock
    `now`, default time.time()). None when that cannot be told: no --training.steps, fewer than two
    records of that process, records without step, time or run_id, or a last record older than
    STALE_S or 5 record intervals (a run not progressing as it logged: stopped as before)."""
    steps = _last_value(argv, "--training.steps")
    try:
        recs = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines() if x.strip()]
        last = recs[-1]
        mine = [r for r in recs if r.get("run_id") == last["run_id"]]
        first = mine[0]
        dstep, dt = int(last["step"]) - int(first["step"]), float(last["time"]) - float(first["time"])
        left = int(steps) - int(last["step"])
    except (OSError, ValueError, KeyError, IndexError, TypeError, AttributeError):
        return None
    if dstep <= 0 or dt <= 0:
        return None
    now = time.time() if now is None else now
    since = max(0.0, now - float(last["time"]))
    if since > max(STALE_S, 5 * dt / (len(mine) - 1)):
        return None
    return left, max(0.0, left * dt / dstep - since)


def grace_seconds(jobs: list[tuple[str, int, list[str], Path]], given: float | None) -> float:
    """How long before the time limit the runs get SIGTERM, so that a run's checkpoint (saved when
    it gets SIGTERM) is written before the SIGKILL at the limit: the longer of `given` (--grace_s)
    and 1.5 x the longest save recorded in the jobs' checkpoint folders (`save_s` of their
    manifests: the saves of earlier calls) + 10 s. With no save recorded: `given`, else 120 s (30 s
    when no run has a checkpoint folder: a run then only finishes its step)."""
    folders = [f for *_, argv, _ in jobs if (f := _checkpoint_folder(argv))]
    recorded = [x for f in folders if (x := save_seconds(f)) is not None]
    if recorded:
        return max(1.5 * max(recorded) + 10.0, given or 0.0)
    return given if given is not None else (120.0 if folders else 30.0)


def trainer_command(nproc: int) -> list[str]:
    """The command a run's trainer arguments follow: `python -m mxmoe train`, under
    `torch.distributed.run --standalone` (a free rendezvous port per run, so concurrent runs do not
    collide) for nproc > 1."""
    if nproc > 1:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                "-m", "mxmoe", "train"]
    return [sys.executable, "-m", "mxmoe", "train"]


def _finishes_before(proc: subprocess.Popen, argv: list[str], folder: Path, end: float, name: str) -> bool:
    """At the grace: let the run finish while its remaining steps fit before `end` (monotonic;
    FINISH_FACTOR, FINISH_MARGIN_S), checked again every few seconds at its latest rate. True when
    it ended so; False when it must be stopped now (it does not fit, or no longer does: then
    SIGTERM at once, its save getting what is left)."""
    told = False
    while True:
        left = end - time.monotonic()
        est = seconds_to_finish(argv, folder)
        if est is None or FINISH_FACTOR * est[1] + FINISH_MARGIN_S > left:
            if told:
                print(f"{name}: no longer finishes before the time limit: stopping it", flush=True)
            return False
        if not told:
            print(f"{name}: {est[0]} steps left, ~{est[1]:.0f} s at its rate; finishing it instead of "
                  f"stopping it ({left:.0f} s to the time limit)", flush=True)
            told = True
        try:
            proc.wait(min(5.0, left))
            return True
        except subprocess.TimeoutExpired:
            pass


def launch(
    jobs: list[tuple[str, int, list[str], Path]],
    parallel: int,
    devices: list[str] | None,
    nproc: int = 1,
    time_limit_s: float | None = None,
    grace_s: float = 0.0,
    delete_checkpoints: bool = False,
    config_sha256: str | None = None,
) -> dict:
    """Run `python -m mxmoe train ARGV` per job (variant, seed, argv, folder), `parallel` at a time
    (per group of `nproc` devices when `devices` are given; with nproc > 1 under
    `torch.distributed.run --standalone`); a job whose folder's command.json records the same argv
    and status 0 (and, when given, the same `config_sha256`: the config file's bytes, so a run of an
    edited config runs again) is skipped. `time_limit_s` bounds the whole call: `grace_s` before it
    no run starts and running ones get SIGTERM (the trainer stops after its step and saves its
    checkpoint; the run counts as unfinished), at it whatever still runs is killed (`grace_seconds`
    picks a grace that lets the save finish), except a run whose remaining steps fit before the
limit (`seconds_to_finish`): it finishes instead. delete_checkpoints: a run that finishes deletes its
    own checkpoint folder (the last --checkpoint.folder of its argv). Returns {(variant, seed):
    DONE or what else happened}."""
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
    cmd = trainer_command(nproc)
    todo = []
    for variant, seed, argv, folder in jobs:
        done = folder / "command.json"
        try:
            prev = json.loads(done.read_text())
        except (OSError, ValueError):
            prev = None
        key = ("argv", "nproc", "returncode", "stopped")
        same = bool(prev) and tuple(prev.get(k) for k in key) == (argv, nproc, 0, False)
        # a record without the digest was written by an earlier mxmoe: its run stands
        edited = same and config_sha256 is not None
        edited = edited and prev.get("config_sha256", config_sha256) != config_sha256
        gone = same and not edited and not (folder / "metrics.jsonl").is_file()  # removed since
        if same and not edited and not gone:
            print(f"{variant} seed {seed}: done before ({folder}), not run again", flush=True)
            status[(variant, seed)] = DONE
        else:
            if edited:
                print(f"{variant} seed {seed}: config changed since it ran ({folder}): run again", flush=True)
            if gone:
                print(f"{variant} seed {seed}: done before, but its metrics.jsonl is gone ({folder}): "
                      "run again", flush=True)
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
                if not _finishes_before(proc, argv, folder, end, f"{variant} seed {seed}"):
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
        if config_sha256 is not None:
            record["config_sha256"] = config_sha256
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
