"""A checkpoint folder: its lock for one live run, what interrupted saves and prunes left, and its
step folders."""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
from pathlib import Path

from mxmoe.train.checkpoint.common import LEFTOVER, MANIFEST, STEP_DIR, TRAIN_STATE
from mxmoe.train.metrics import RunLock

log = logging.getLogger("mxmoe.train")
# what saves, prunes, fallbacks and divergences write
_STEP_NAME = re.compile(r"^step-\d{8}(\.(tmp|pruned|corrupt|diverged))?$")
# a step folder of another trainer (torchtitan's step-100), which resuming does not read
_OTHER_STEP = re.compile(r"^step-\d+$")


def step_folders(folder: Path) -> list[tuple[int, Path]]:
    """(step, path) of every step folder in `folder` (saves that finished: tmp dirs are renamed
    last), oldest first. One that has lost files since is listed too, so that resuming reports it."""
    if not folder.is_dir():
        return []
    out = []
    for p in folder.iterdir():
        m = STEP_DIR.match(p.name)
        if m and (p.is_dir() or p.is_symlink()):
            out.append((int(m.group(1)), p))
    return sorted(out)


def enclosing_step_folder(path: str | Path) -> Path | None:
    """The checkpoint step folder that `path` is or lies in (`path` or the nearest folder above it
    holding a manifest.json and named step-XXXXXXXX or holding trainer_state.json), else None. A
    file written there is unlisted in its manifest: resuming and exporting refuse the checkpoint."""
    here = Path(os.path.abspath(path))
    for p in (here, *here.parents):
        if (p / MANIFEST).is_file() and (_STEP_NAME.match(p.name) or (p / TRAIN_STATE).is_file()):
            return p
    return None


def claim_folder(folder: str, run_id: str, resume: bool, locked: bool = False) -> RunLock | None:
    """Rank 0, before anything is built: lock checkpoint `folder` for this run (as the metrics
    folder is locked; symbolic links in it are refused), check that it can be written, refuse files
    under the names checkpoints are saved as, remove what interrupted saves and prunes left
    (`step-N.tmp`, `step-N.pruned`, empty step folders older than the newest checkpoint), and with
    `resume=False` move the folder's checkpoints to `superseded-<run_id>/`, so that a later resuming
    run continues this run, not the earlier one.
    locked: the folder is the metrics folder, already locked by this run (no second lock; None is
    returned). ValueError naming checkpoint.folder if any of it fails."""
    path = Path(folder)
    step = enclosing_step_folder(path)
    if step is not None:  # a run there would start afresh and write into that checkpoint
        what = "is" if step == Path(os.path.abspath(path)) else f"lies in {str(step)!r},"
        raise ValueError(
            f"checkpoint.folder={folder!r} {what} a checkpoint's step folder (it holds {MANIFEST}), not a "
            f"checkpoint folder: a run there would not resume it and would write into it (a file its "
            f"manifest does not list spoils it); give --checkpoint.folder={str(step.parent)!r} to resume "
            "its newest checkpoint"
        )
    try:
        path.mkdir(parents=True, exist_ok=True)
        lock = None if locked else RunLock(path, run_id, "checkpoint.folder")
    except OSError as e:
        raise ValueError(f"checkpoint.folder={folder!r} cannot be created or locked: {e}") from None
    try:
        fd, probe = tempfile.mkstemp(dir=path, prefix=".write-test-")
        os.close(fd)
        os.unlink(probe)
        # a save at step N writes step-N.tmp/ and renames it step-N/: a file under either name
        # would make that save fail, steps after the last checkpoint
        taken = sorted(p.name for p in path.iterdir() if _STEP_NAME.match(p.name) and not p.is_dir())
        if taken:
            raise ValueError(
                f"checkpoint.folder={folder!r} holds {taken}, not folders, under the names checkpoints "
                "are saved as: a save at that step would fail; move them out of the folder or give this "
                "run another --checkpoint.folder"
            )
        for p in sorted(path.iterdir()):
            if LEFTOVER.match(p.name) and p.is_dir():
                shutil.rmtree(p)
                log.info("%s: removed %s, left by an interrupted save or prune", path, p.name)
        steps = sorted((int(m.group(1)), p) for p in path.iterdir() if (m := STEP_DIR.match(p.name)))
        filled = [s for s, p in steps if p.is_dir() and any(p.iterdir())]
        for s, p in steps:
            if filled and s < filled[-1] and p.is_dir() and not any(p.iterdir()):
                p.rmdir()
                log.warning("%s: removed the empty folder %s (an interrupted prune)", path, p.name)
        steps = [(s, p) for s, p in steps if os.path.lexists(p)]
        other = sorted(
            p.name for p in path.iterdir() if _OTHER_STEP.match(p.name) and not STEP_DIR.match(p.name)
        )
        if resume and other and not steps:  # the run would start at step 1 where a resume was meant
            raise ValueError(
                f"checkpoint.folder={folder!r} holds {other[:3]}{' ...' if len(other) > 3 else ''}, not a "
                "checkpoint of mxmoe train (step-XXXXXXXX, 8 digits; torchtitan's checkpoints are not "
                "read): a run would not resume it but start at step 1; give another --checkpoint.folder, or "
                "--checkpoint.resume=false to start afresh in this one"
            )
        if not resume and steps:
            aside = path / f"superseded-{run_id}"
            aside.mkdir()
            for _, p in steps:
                os.replace(p, aside / p.name)
            log.warning(
                "checkpoint.resume=false: moved the %d checkpoints already in %s (%s..%s) to %s, so that "
                "a later resume continues this run",
                len(steps),
                path,
                steps[0][1].name,
                steps[-1][1].name,
                aside.name,
            )
    except BaseException as e:
        if lock is not None:
            lock.release()
        if isinstance(e, OSError):
            raise ValueError(f"checkpoint.folder={folder!r} cannot be written: {e}") from None
        raise
    return lock
