"""One run, one folder: the metrics folder's lock and its records.

`RunLock` holds an exclusive `flock` on `folder/.lock` for as long as a run is live (the kernel
drops it when the process ends, however it ends), so a second run on the same folder stops with an
error naming the live one instead of interleaving its records. `MetricsWriter` writes
`metrics.jsonl`: one strict JSON object per logged step, each with the run's id and a timestamp;
NaN and infinities are written as null and listed under "nonfinite". A run resumed at step S first
moves the folder's records of steps > S (written after that checkpoint by the run that stopped) to
`metrics.dropped.jsonl`, so every step appears once.

The folder's own files are never written through a symbolic link: a folder holding one is refused
at the lock (a link named `.lock` or `config.json` would truncate or overwrite its target), files
are opened with O_NOFOLLOW and replaced by rename. `config.json` is the first run's config; a later
run in the folder (a resume, or a new run) writes `config.<run_id>.json` beside it.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import math
import os
import socket
import time
import uuid
from pathlib import Path

log = logging.getLogger("mxmoe.train")
METRICS = "metrics.jsonl"
DROPPED = "metrics.dropped.jsonl"


class RunFolderBusy(ValueError):
    """Another live run holds the metrics folder."""


class MetricsError(RuntimeError):
    """The metrics folder cannot be written (a full disk, a read-only or vanished folder): the
    message names the folder, the file and the system's reason."""


def new_run_id() -> str:
    """UTC start time and a random suffix, e.g. "20261130-091502-3fa2c1"."""
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + uuid.uuid4().hex[:6]


def refuse_symlinks(folder: Path, setting: str) -> None:
    """ValueError naming the symbolic links directly in `folder` (a run writes its files there and
    must never write through a link into someone else's file)."""
    links = sorted(p.name for p in folder.iterdir() if p.is_symlink())
    if links:
        raise ValueError(
            f"{setting}={str(folder)!r} holds symbolic links {links}: refused (the run would write "
            "through them); remove them or use another folder"
        )


def _no_follow(path: str, flags: int) -> int:
    """`open(..., opener=_no_follow)`: fails (ELOOP) instead of following a symbolic link."""
    return os.open(path, flags | os.O_NOFOLLOW, 0o644)


def write_atomic(path: Path, text: str) -> None:
    """Write `path` whole or not at all: a fresh temporary file (never through a link), fsync, rename."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


class RunLock:
    """An exclusive lock on `folder` (created if needed) for one live run; `release()` ends it.

    setting: the option that named the folder, for the messages ("job.dump_folder",
    "checkpoint.folder"). A lock file still naming a run when the lock is free was left by a run
    that was killed: it is taken over, with a warning naming that run."""

    def __init__(self, folder: str | Path, run_id: str, setting: str = "job.dump_folder"):
        self.path = Path(folder) / ".lock"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        refuse_symlinks(self.path.parent, setting)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self.fd, 4096, 0).decode(errors="replace").strip() or "unknown"
            os.close(self.fd)
            raise RunFolderBusy(
                f"{setting}={str(self.path.parent)!r} is in use by a live run ({holder}); wait for "
                f"it to finish or give this run another --{setting}"
            ) from None
        stale = os.pread(self.fd, 4096, 0).decode(errors="replace").strip()
        if stale:  # release() empties the file: this run ended without releasing (killed)
            log.warning(
                "%s=%s: taking over the lock of %s, which ended without releasing it",
                setting,
                self.path.parent,
                stale,
            )
        info = f"run {run_id}, pid {os.getpid()} on {socket.gethostname()}"
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, info.encode(), 0)

    def release(self) -> None:
        if self.fd is not None:
            os.ftruncate(self.fd, 0)
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


def strict_record(record: dict) -> dict:
    """`record` with NaN / inf floats replaced by None and their keys listed under "nonfinite"."""
    bad = sorted(k for k, v in record.items() if isinstance(v, float) and not math.isfinite(v))
    if not bad:
        return record
    out = {k: (None if k in bad else v) for k, v in record.items()}
    out["nonfinite"] = bad
    return out


class MetricsWriter:
    """metrics.jsonl (+ TensorBoard events, + a Weights & Biases run, when asked and installed); a
    no-op unless `enabled` (rank 0). `start_step`: the step the run starts after (its resume step; 0
    for a new run). TensorBoard and W&B get the same scalars: every number of each record but its
    step, at that step. The W&B run is named after `run_id`, holds `config`, and writes its local
    files under `folder`/wandb (WANDB_MODE=offline: only there)."""

    def __init__(
        self,
        folder: str,
        enabled: bool,
        tensorboard: bool,
        config: dict,
        run_id: str,
        start_step: int = 0,
        wandb: bool = False,
        wandb_project: str = "mxmoe",
    ):
        self.enabled, self.run_id, self.folder = enabled, run_id, folder
        self.fh = self.tb = self.wb = None
        self.failed = False
        if not enabled:
            return
        path = Path(folder)
        conf = path / "config.json"
        writing = conf.name
        try:
            path.mkdir(parents=True, exist_ok=True)
            if os.path.lexists(conf):  # keep the first run's config; this run's goes beside it
                conf = path / f"config.{run_id}.json"
                log.info("%s holds an earlier run's config.json: this run's config is in %s", path, conf.name)
            writing = conf.name
            write_atomic(conf, json.dumps({"run_id": run_id, **config}, indent=2, default=str))
            writing = METRICS
            self._drop_after(path / METRICS, start_step)
            self.fh = open(path / METRICS, "a", opener=_no_follow)
        except OSError as e:
            raise self._error(writing, e) from None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                log.warning(
                    "metrics.enable_tensorboard is on but the tensorboard package is not installed: writing "
                    "metrics.jsonl only. Install it with `pip install 'mxmoe[tensorboard]'` (or pass "
                    "--metrics.enable_tensorboard=false)"
                )
            else:
                self.tb = SummaryWriter(str(path / "tb"))
        if wandb:
            try:
                self.wb = _wandb_run(path, wandb_project, run_id, config)
            except MetricsError:
                self.close()
                raise

    def _drop_after(self, file: Path, step: int) -> None:
        """Move the records of steps > `step` from `file` to metrics.dropped.jsonl (atomically)."""
        if not file.is_file():
            return
        keep, drop = [], []
        for n, raw in enumerate(file.read_bytes().splitlines(), 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise MetricsError(
                    f"job.dump_folder={self.folder!r}: {file}:{n} is not UTF-8 text ({e.reason} at byte "
                    f"{e.start}), not a record the trainer writes; move the file aside or give another "
                    "--job.dump_folder"
                ) from None
            if not line.strip():
                continue
            try:
                rec_step = json.loads(line).get("step", 0)
            except ValueError:  # a line cut short by a killed run: not a record
                rec_step = None
            (keep if rec_step is not None and rec_step <= step else drop).append(line)
        if not drop:
            return
        try:
            with open(file.with_name(DROPPED), "a", opener=_no_follow) as fh:
                fh.write("".join(x + "\n" for x in drop))
        except OSError as e:
            raise self._error(DROPPED, e) from None
        write_atomic(file, "".join(x + "\n" for x in keep))
        log.info("%s: moved %d records after step %d (redone now) to %s", file, len(drop), step, DROPPED)

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        full = {"step": record["step"], "run_id": self.run_id, "time": round(time.time(), 3), **record}
        try:
            self.fh.write(json.dumps(strict_record(full), allow_nan=False) + "\n")
            self.fh.flush()
        except OSError as e:
            raise self._error(METRICS, e) from None
        scalars = {k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float))}
        if self.tb is not None:
            for k, v in scalars.items():
                self.tb.add_scalar(k, v, record["step"])
        if self.wb is not None:
            self.wb.log(scalars, step=record["step"])

    def _error(self, name: str, e: OSError) -> MetricsError:
        self.failed = True
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            fix = "free space there"
        elif e.errno == errno.EISDIR or (Path(self.folder) / name).is_dir():
            fix = f"{name} is a folder: move it aside"
        else:
            fix = "make the folder writable"
        return MetricsError(
            f"job.dump_folder={self.folder!r}: cannot write {name}: {e.strerror or e} (errno "
            f"{e.errno}); {fix} or give another --job.dump_folder"
        )

    def close(self) -> None:
        """Close the files; a failure to write what is buffered is a MetricsError, unless writing
        has already failed (that error is the one reported)."""
        if self.fh is not None:
            fh, self.fh = self.fh, None
            try:
                fh.close()
            except OSError as e:
                if not self.failed:
                    raise self._error(METRICS, e) from None
        if self.tb is not None:
            self.tb.close()
            self.tb = None
        if self.wb is not None:
            wb, self.wb = self.wb, None
            wb.finish()


def _wandb_run(folder: Path, project: str, run_id: str, config: dict):
    """A W&B run for the trainer's records (None, with a warning, where wandb is not installed);
    MetricsError naming the option and the fix when W&B does not start (no API key, no server)."""
    try:
        import wandb
    except ImportError:
        log.warning(
            "metrics.enable_wandb is on but the wandb package is not installed: not logging to W&B. "
            "Install it with `pip install 'mxmoe[wandb]'` (or pass --metrics.enable_wandb=false)"
        )
        return None
    try:
        return wandb.init(
            project=project, name=run_id, dir=str(folder), config=config, settings=wandb.Settings(quiet=True)
        )
    except Exception as e:  # wandb's UsageError, CommError, a timeout reaching its server
        raise MetricsError(
            f"metrics.enable_wandb: W&B did not start ({type(e).__name__}: {e}); log in (`wandb login` or "
            "WANDB_API_KEY), or set WANDB_MODE=offline to keep the run under job.dump_folder/wandb, or pass "
            "--metrics.enable_wandb=false"
        ) from None
