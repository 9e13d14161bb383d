"""What every part of the checkpoint package shares: the error, the names of the files and folders,
and the collectives through which every rank reaches the same verdict."""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

import torch.distributed as dist

STEP_DIR = re.compile(r"^step-(\d{8})$")
LEFTOVER = re.compile(r"^step-\d{8}\.(tmp|pruned)$")  # an interrupted save / prune
SHARD = re.compile(r"^__(\d+)_\d+\.distcp$")
MANIFEST = "manifest.json"
TRAIN_STATE = "trainer_state.json"
FORMAT = 2  # 1: trainer state in DCP byte items (pickle), no world size in the manifest


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be resumed from; the message names the file or the setting."""


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def all_gather(obj) -> list:
    if not distributed():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def process_cpus() -> int:
    """The CPUs this process may run on (its affinity; else the host's)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def io_threads() -> int:
    """Threads one rank writes and hashes a checkpoint with: min(8, the CPUs this process may run on
    / the ranks on this host (torchrun's LOCAL_WORLD_SIZE)), at least 1."""
    cpus = process_cpus()
    try:
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local = 1
    return max(1, min(8, cpus // local))


def sha256(path: Path) -> str:
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def broadcast(obj):
    """Rank 0's `obj` on every rank."""
    if not distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def agree(error: str | None) -> None:
    """Collective: a CheckpointError on every rank if any rank has an `error` (so that one rank's
    failure never leaves the others waiting in the next collective)."""
    errors = [e for e in all_gather(error) if e is not None]
    if errors:
        raise CheckpointError(errors[0])


def run_local(check, path: Path, *args):
    """check(path, *args) on every rank; a CheckpointError on every rank if it failed on any."""
    out, error = None, None
    try:
        out = check(path, *args)
    except CheckpointError as e:
        error = str(e)
    except OSError as e:
        error = f"checkpoint {path} cannot be read: {e}"
    agree(error)
    return out


def describe(e: BaseException) -> str:
    """The failure in one line; DCP's CheckpointException carries each rank's exception (ranks
    failing alike are named together)."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(e, CheckpointException):
        by_text: dict[str, list[int]] = {}
        for rank, failure in sorted(e.failures.items()):
            exc = failure[0] if isinstance(failure, tuple) else failure
            by_text.setdefault(describe(exc), []).append(rank)
        return "; ".join(
            f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {text}" for text, r in by_text.items()
        )
    return str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"
