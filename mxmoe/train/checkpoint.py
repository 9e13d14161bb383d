"""Checkpoints with torch.distributed.checkpoint (DCP): model, optimizer, lr scheduler, data
sampler position, step and every rank's RNG state.

Layout: `folder/step-00000100/`: DCP's files (`.metadata` and one `__R_0.distcp` shard per rank R),
`trainer_state.json` (step, scheduler, sampler: JSON, no pickle) and `manifest.json`. A save writes
`step-XXXXXXXX.tmp/` and renames it once every rank has finished, so an interrupted save (SIGTERM,
SIGKILL, a crash) never leaves a half-written directory under a final name; a step folder under a
final name that lacks files is reported by verification, never skipped. Pruning renames a folder
(`step-XXXXXXXX.pruned/`) before deleting it. `claim_folder` locks the folder for one live run.

`manifest.json` holds the size and SHA-256 of every file of the checkpoint (each rank hashes a
share of them), the saving world size and the run's shape (model arguments, global batch, sequence
length). A resume verifies all of it before loading anything: the files present must be exactly
those listed, with every rank's shard; a corrupted, truncated, missing or unlisted file, a step
folder that is incomplete, or a run of another shape, is a `CheckpointError` naming it, never a
torch traceback, a silent skip or a silent continuation. `resume_path(fallback=True)` instead moves
a checkpoint that fails verification aside (`step-XXXXXXXX.corrupt/`) and takes the previous one.
Pruning (`keep_latest`) never deletes the checkpoint just written (verified by the hashing).

Nothing is loaded through an unrestricted unpickler (a checksum is no signature: whoever can write
the folder can rewrite the manifest). DCP's `.metadata` is read with an allow-list unpickler (DCP's
metadata classes and torch's Size / dtype / layout only); the byte items DCP stores (the
optimizer's param-group values) are read only if this run's own state has that item, and only with
`torch.load(weights_only=True)`; tensors are DCP's, read with `weights_only=True` by DCP itself.
The trainer's own state is JSON. Every save or load failure, DCP's `CheckpointException` (a
BaseException) included, is a `CheckpointError` naming the step and the file.

Expert-parallel experts are plain local tensors holding E / ep experts each; for saving they are
wrapped as DTensors on the (edp, ep) mesh (Shard(0) over ep, replicated over edp), so DCP stores
the full expert weights once and reloads each rank's slice.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import io
import json
import logging
import os
import pickle
import re
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from mxmoe.train.metrics import RunLock, write_atomic

# torch.distributed.checkpoint (DCP, and DTensor with it) is imported where a checkpoint is saved or
# read, never at import: it costs every process ~1.2 s, and most runs (no checkpoint.folder, a
# benchmark, `--help`) never touch a checkpoint.

log = logging.getLogger("mxmoe.train")
_STEP_DIR = re.compile(r"^step-(\d{8})$")
_LEFTOVER = re.compile(r"^step-\d{8}\.(tmp|pruned)$")  # an interrupted save / prune
_SHARD = re.compile(r"^__(\d+)_\d+\.distcp$")
MANIFEST = "manifest.json"
TRAIN_STATE = "trainer_state.json"
FORMAT = 2  # 1: trainer state in DCP byte items (pickle), no world size in the manifest


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be resumed from; the message names the file or the setting."""


def _dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def _all_gather(obj) -> list:
    if not _dist():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _sha256(path: Path) -> str:
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _broadcast(obj):
    """Rank 0's `obj` on every rank."""
    if not _dist():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _agree(error: str | None) -> None:
    """Collective: a CheckpointError on every rank if any rank has an `error` (so that one rank's
    failure never leaves the others waiting in the next collective)."""
    errors = [e for e in _all_gather(error) if e is not None]
    if errors:
        raise CheckpointError(errors[0])


def _describe(e: BaseException) -> str:
    """The failure in one line; DCP's CheckpointException carries each rank's exception (ranks
    failing alike are named together)."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(e, CheckpointException):
        by_text: dict[str, list[int]] = {}
        for rank, failure in sorted(e.failures.items()):
            exc = failure[0] if isinstance(failure, tuple) else failure
            by_text.setdefault(_describe(exc), []).append(rank)
        return "; ".join(
            f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {text}" for text, r in by_text.items()
        )
    return str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"


# -- reading what a checkpoint holds without running code from it -------------------------------
_PATH_CLASSES = ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")


def _allowed_global(module: str, name: str) -> bool:
    """What DCP's `.metadata` pickle may name: DCP's metadata dataclasses and enums, its
    `_StorageInfo`, torch.Size / dtypes / layouts / memory formats and pathlib paths (the
    checkpoint id). Their constructors only store their arguments."""
    if module == "torch.distributed.checkpoint.metadata":
        obj = getattr(sys.modules[module], name, None)
        return (
            isinstance(obj, type)
            and obj.__module__ == module
            and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum))
        )
    if module == "torch":
        obj = getattr(torch, name, None)
        return obj is torch.Size or isinstance(obj, (torch.dtype, torch.layout, torch.memory_format))
    return (module, name) in (
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch.serialization", "_get_layout"),
        ("collections", "OrderedDict"),
    ) or (module in ("pathlib", "pathlib._local") and name in _PATH_CLASSES)


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if _allowed_global(module, name):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it names {module}.{name}, which a DCP metadata file never holds")


def read_metadata(file: Path):
    """DCP's `.metadata` (a pickle) read with an allow-list unpickler: its `Metadata`;
    CheckpointError naming the file if it holds anything else (an object whose unpickling would run
    code)."""
    from torch.distributed.checkpoint.metadata import Metadata  # also what _allowed_global looks up

    try:
        md = _MetadataUnpickler(io.BytesIO(file.read_bytes())).load()
    except OSError as e:
        raise CheckpointError(f"checkpoint file {file} cannot be read: {e}") from None
    except Exception as e:  # UnpicklingError, or a truncated / garbled pickle
        raise CheckpointError(f"checkpoint file {file} is refused: {type(e).__name__}: {e}") from None
    if not isinstance(md, Metadata):
        raise CheckpointError(
            f"checkpoint file {file} is refused: it holds a {type(md).__name__}, not DCP Metadata"
        )
    return md


@functools.cache
def _checked_reader_and_planner() -> tuple[type, type]:
    """DCP's file reader and load planner, restricted (classes built on first use, DCP imported)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, StorageMeta

    class CheckedReader(dcp.FileSystemReader):
        """DCP's file reader with `.metadata` read through the allow-list unpickler."""

        def read_metadata(self, *args, **kwargs):
            if kwargs.get("rank") is not None:  # per-rank metadata files: a layout this module never writes
                raise CheckpointError(f"checkpoint {self.path}: per-rank metadata files are not supported")
            md = read_metadata(Path(self.path) / ".metadata")
            if getattr(md, "storage_meta", None) is None:  # as DCP's own reader does
                md.storage_meta = StorageMeta()
            md.storage_meta.load_id = getattr(self, "load_id", None)
            return md

    class CheckedLoadPlanner(DefaultLoadPlanner):
        """DCP's load planner that reads only the byte items this run's own state has (as byte items),
        each through `torch.load(weights_only=True)` before DCP's own `torch.load` sees the same bytes."""

        def set_up_planner(self, *args, **kwargs) -> None:
            super().set_up_planner(*args, **kwargs)
            foreign = sorted(
                k
                for k, v in self.metadata.state_dict_metadata.items()
                if isinstance(v, BytesStorageMetadata)
                and (k not in self.state_dict or isinstance(self.state_dict[k], torch.Tensor))
            )
            if foreign:
                raise CheckpointError(
                    f"byte items {foreign[:5]}{' ...' if len(foreign) > 5 else ''} are refused: this "
                    "trainer never writes them"
                )

        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            try:
                torch.load(value, weights_only=True)  # torch's allow-list unpickler: plain values only
            except Exception as e:
                raise CheckpointError(
                    f"byte item {read_item.dest_index.fqn!r} is refused: {type(e).__name__}: {e}"
                ) from None
            value.seek(0)
            super().load_bytes(read_item, value)

    return CheckedReader, CheckedLoadPlanner


def claim_folder(folder: str, run_id: str, resume: bool, locked: bool = False) -> RunLock | None:
    """Rank 0, before anything is built: lock checkpoint `folder` for this run (as the metrics
    folder is locked; symbolic links in it are refused), check that it can be written, remove what
    interrupted saves and prunes left (`step-N.tmp`, `step-N.pruned`, empty step folders older than
    the newest checkpoint), and with `resume=False` move the folder's checkpoints to
    `superseded-<run_id>/`, so that a later resuming run continues this run, not the earlier one.
    locked: the folder is the metrics folder, already locked by this run (no second lock; None is
    returned). ValueError naming checkpoint.folder if any of it fails."""
    path = Path(folder)
    try:
        path.mkdir(parents=True, exist_ok=True)
        lock = None if locked else RunLock(path, run_id, "checkpoint.folder")
    except OSError as e:
        raise ValueError(f"checkpoint.folder={folder!r} cannot be created or locked: {e}") from None
    try:
        fd, probe = tempfile.mkstemp(dir=path, prefix=".write-test-")
        os.close(fd)
        os.unlink(probe)
        for p in sorted(path.iterdir()):
            if _LEFTOVER.match(p.name) and p.is_dir():
                shutil.rmtree(p)
                log.info("%s: removed %s, left by an interrupted save or prune", path, p.name)
        steps = sorted((int(m.group(1)), p) for p in path.iterdir() if (m := _STEP_DIR.match(p.name)))
        filled = [s for s, p in steps if p.is_dir() and any(p.iterdir())]
        for s, p in steps:
            if filled and s < filled[-1] and p.is_dir() and not any(p.iterdir()):
                p.rmdir()
                log.warning("%s: removed the empty folder %s (an interrupted prune)", path, p.name)
        steps = [(s, p) for s, p in steps if os.path.lexists(p)]
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


def _no_constant(name: str):
    raise ValueError(f"non-standard JSON constant {name}")


def rng_state() -> dict:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    if "cpu" in state:
        torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


class Checkpointer:
    """Save / find / load training checkpoints under `folder`.

    expert_mesh: the (edp, ep) DeviceMesh when experts are sharded by expert parallelism, else None.
    """

    def __init__(self, folder: str, keep_latest: int = 2, expert_mesh=None, run: dict | None = None):
        """run: what a resumed run must match (JSON-able; e.g. model arguments, global batch and
        sequence length), stored in each checkpoint's manifest and compared by `load`."""
        self.folder = Path(folder)
        self.keep_latest = keep_latest
        self.expert_mesh = expert_mesh
        self.run = run or {}
        self.rank = dist.get_rank() if _dist() else 0
        self.world = dist.get_world_size() if _dist() else 1

    # -- discovery ---------------------------------------------------------------------------
    def complete(self) -> list[tuple[int, Path]]:
        """(step, path) of every step folder (saves that finished: tmp dirs are renamed last),
        oldest first. One that has lost files since is listed too, so that resuming reports it."""
        if not self.folder.is_dir():
            return []
        out = []
        for p in self.folder.iterdir():
            m = _STEP_DIR.match(p.name)
            if m and (p.is_dir() or p.is_symlink()):
                out.append((int(m.group(1)), p))
        return sorted(out)

    def latest(self) -> Path | None:
        done = self.complete()
        return done[-1][1] if done else None

    # -- integrity -----------------------------------------------------------------------------
    def _hash_files(self, path: Path, names: list[str]) -> dict[str, dict]:
        """{name: {"size", "sha256"}} of `names` under `path`, each rank hashing a share; the same
        dict on every rank. A missing (or unreadable, or not regular) file has size -1."""
        mine = {}
        for name in names[self.rank :: self.world]:
            f = path / name
            try:
                if not f.is_file() or f.is_symlink():
                    raise FileNotFoundError(name)
                mine[name] = {"size": f.stat().st_size, "sha256": _sha256(f)}
            except OSError:
                mine[name] = {"size": -1, "sha256": ""}
        out: dict[str, dict] = {}
        for part in _all_gather(mine):
            out.update(part)
        return out

    @staticmethod
    def _read_manifest(path: Path) -> dict:
        """The manifest of step folder `path`, its form checked; CheckpointError naming what is wrong."""
        manifest_file = path / MANIFEST
        if not manifest_file.is_file() or manifest_file.is_symlink():
            raise CheckpointError(
                f"checkpoint {path} is incomplete: it has no {MANIFEST} (checksums); the file was "
                "deleted, or the folder was not written by a finished save"
            )
        try:
            manifest = json.loads(manifest_file.read_text())
        except (OSError, ValueError) as e:
            raise CheckpointError(
                f"{manifest_file} is not a valid manifest ({e}): the checkpoint is corrupt"
            ) from None
        files = manifest.get("files") if isinstance(manifest, dict) else None
        if not isinstance(files, dict) or not all(
            isinstance(v, dict)
            and type(v.get("size")) is int
            and isinstance(v.get("sha256"), str)
            and "/" not in k
            for k, v in files.items()
        ):
            raise CheckpointError(
                f"{manifest_file} is not a valid manifest: \"files\" must map each file name to its size "
                f"and sha256, got {type(files).__name__}: the checkpoint is corrupt"
            )
        world = manifest.get("world")
        if manifest.get("format") != FORMAT or type(world) is not int or world < 1:
            raise CheckpointError(
                f"{manifest_file}: checkpoint format {manifest.get('format', 1)}, this mxmoe reads format "
                f"{FORMAT} only (written by an earlier mxmoe, whose trainer state needs pickle): start a new "
                "--checkpoint.folder"
            )
        return manifest

    def verify(self, path: Path) -> dict:
        """Check step folder `path` against its manifest: the files present are exactly those listed
        (every rank's shard among them), each of the recorded size and SHA-256, `.metadata` holds
        only DCP metadata (allow-list unpickler) naming listed files, its byte items are the
        optimizer's. Returns the manifest; CheckpointError naming the first problem otherwise (the
        same on every rank: the local checks are agreed on before and after the collective hashing)."""
        manifest = self._local(self._check_listing, path)
        files = manifest["files"]
        got = self._hash_files(path, sorted(files))
        for name in sorted(files):
            want, have = files[name], got[name]
            f = path / name
            if have["size"] < 0:
                raise CheckpointError(f"checkpoint file {f} is missing")
            if have["size"] != want["size"]:
                raise CheckpointError(
                    f"checkpoint file {f} has {have['size']} bytes, its manifest says {want['size']}: "
                    "truncated or overwritten"
                )
            if have["sha256"] != want["sha256"]:
                raise CheckpointError(
                    f"checkpoint file {f} does not match its SHA-256 in {MANIFEST}: the file is corrupted"
                )
        self._local(self._check_contents, path, files)
        return manifest

    @staticmethod
    def _local(check, path: Path, *args):
        """check(path, *args) on every rank; a CheckpointError on every rank if it failed on any."""
        out, error = None, None
        try:
            out = check(path, *args)
        except CheckpointError as e:
            error = str(e)
        except OSError as e:
            error = f"checkpoint {path} cannot be read: {e}"
        _agree(error)
        return out

    def _check_listing(self, path: Path) -> dict:
        """The manifest, checked against the folder's listing."""
        if path.is_symlink() or not path.is_dir():
            raise CheckpointError(f"checkpoint {path} is not a folder (a symbolic link or a file): refused")
        manifest = self._read_manifest(path)
        files = manifest["files"]
        present = {}
        for p in path.iterdir():
            if p.name != MANIFEST:
                present[p.name] = p
        for name in sorted(set(files) - set(present)):
            raise CheckpointError(f"checkpoint file {path / name} is missing")
        for name in sorted(set(present) - set(files)):
            raise CheckpointError(
                f"checkpoint file {path / name} is not listed in {MANIFEST}: an unlisted file is refused"
            )
        for _, p in sorted(present.items()):
            if p.is_symlink() or not p.is_file():
                raise CheckpointError(
                    f"checkpoint file {p} is not a regular file (a link or a folder): refused"
                )
        for name in (".metadata", TRAIN_STATE):
            if name not in files:
                raise CheckpointError(f"checkpoint file {path / name} is missing (and not in {MANIFEST})")
        ranks = {int(m.group(1)) for name in files if (m := _SHARD.match(name))}
        lost = [r for r in range(manifest["world"]) if r not in ranks]
        if lost:
            raise CheckpointError(
                f"checkpoint {path} was saved by {manifest['world']} ranks but its {MANIFEST} names no shard "
                f"of rank(s) {lost} (__{lost[0]}_0.distcp): the checkpoint is incomplete"
            )
        return manifest

    def _check_contents(self, path: Path, files: dict) -> None:
        """`.metadata` (allow-list unpickler) names only listed shards and the optimizer's byte
        items; the trainer state is JSON."""
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata

        md = read_metadata(path / ".metadata")
        for info in md.storage_data.values():
            rel = getattr(info, "relative_path", None)
            if rel not in files or not _SHARD.match(str(rel)):
                raise CheckpointError(
                    f"checkpoint file {path / '.metadata'} points at {rel!r}, not a shard listed in "
                    f"{MANIFEST}: refused"
                )
        for key, item in md.state_dict_metadata.items():
            if isinstance(item, BytesStorageMetadata) and not key.startswith("optim.param_groups."):
                raise CheckpointError(
                    f"checkpoint file {path / '.metadata'} has the byte item {key!r}, which this trainer "
                    "never writes: refused"
                )
        self._read_train_state(path)

    @staticmethod
    def _read_train_state(path: Path) -> dict:
        f = path / TRAIN_STATE
        try:
            state = json.loads(f.read_text(), parse_constant=_no_constant)
        except (OSError, ValueError) as e:
            raise CheckpointError(f"checkpoint file {f} is not valid JSON ({e}): refused") from None
        if not isinstance(state, dict) or type(state.get("step")) is not int:
            raise CheckpointError(f"checkpoint file {f} holds no trainer state (an object with an int step)")
        return state

    def resume_path(self, fallback: bool = False) -> Path | None:
        """The newest complete checkpoint that verifies, or None if the folder has none.

        A newest checkpoint that fails verification is a CheckpointError unless `fallback`: then it
        is renamed `step-XXXXXXXX.corrupt` (kept for inspection, never resumed from or pruned as a
        good one) and the previous complete checkpoint is tried."""
        done = self.complete()
        for i in range(len(done) - 1, -1, -1):
            path = done[i][1]
            try:
                self.verify(path)
                return path
            except CheckpointError as e:
                prev = done[i - 1][1] if i > 0 else None
                if not fallback:
                    hint = (
                        f"pass --checkpoint.fallback=true to resume from the previous complete checkpoint "
                        f"{prev.name} instead"
                        if prev is not None
                        else "there is no earlier checkpoint: use another --checkpoint.folder or "
                        "--checkpoint.resume=false"
                    )
                    raise CheckpointError(f"cannot resume: {e}; {hint}") from None
                error = None
                if self.rank == 0:
                    log.warning("%s; moved aside as %s.corrupt", e, path.name)
                    aside = path.with_name(path.name + ".corrupt")
                    try:
                        shutil.rmtree(aside, ignore_errors=True)
                        os.replace(path, aside)
                    except OSError as err:
                        error = f"cannot move checkpoint {path} aside: {err}"
                _agree(error)
        if done:
            raise CheckpointError(f"cannot resume: no checkpoint in {self.folder} verifies (all moved aside)")
        return None

    def _check_run(self, path: Path, saved: dict) -> None:
        """CheckpointError if the checkpoint's run shape differs from this run's."""
        diffs = []
        for k, v in self.run.items():
            old = saved.get(k, v)
            if isinstance(v, dict) and isinstance(old, dict):  # name the differing fields only
                diffs += [
                    f"{k}.{f}: checkpoint {old.get(f)!r}, this run {v.get(f)!r}"
                    for f in sorted(set(v) | set(old))
                    if old.get(f) != v.get(f)
                ]
            elif old != v:
                diffs.append(f"{k}: checkpoint {old!r}, this run {v!r}")
        if diffs:
            raise CheckpointError(
                f"checkpoint {path} was written by a run of another shape ({'; '.join(diffs)}): resume "
                "with the same model, training.local_batch_size x world size and training.seq_len, or start "
                "a new --checkpoint.folder (or --checkpoint.resume=false)"
            )

    # -- state -------------------------------------------------------------------------------
    def _is_expert(self, fqn: str) -> bool:
        return self.expert_mesh is not None and ".experts." in fqn

    def _wrap(self, t):
        from torch.distributed.tensor import DTensor, Replicate, Shard

        return DTensor.from_local(t, self.expert_mesh, [Replicate(), Shard(0)], run_check=False)

    def _state(self, model, optimizer) -> dict:
        """The DCP state dict. Every dict in it is new: `get_optimizer_state_dict` hands back the
        optimizer's own per-parameter state dicts, and putting the DTensor wrappers into those
        would make the next `optimizer.step()` mix DTensors with plain tensors. The tensors
        themselves are shared (views), so `dcp.load` writes straight into the live state."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        msd = {
            k: self._wrap(v) if self._is_expert(k) else v for k, v in get_model_state_dict(model).items()
        }
        osd = get_optimizer_state_dict(model, optimizer)
        optim_state = {}
        for fqn, st in osd["state"].items():
            expert = self._is_expert(fqn)
            optim_state[fqn] = {
                name: self._wrap(v) if expert and isinstance(v, torch.Tensor) and v.ndim > 0 else v
                for name, v in st.items()
            }
        optim = {**osd, "state": optim_state}
        return {"model": msd, "optim": optim, f"rng_rank{self.rank}": rng_state()}

    @staticmethod
    def _unwrap(sd: dict) -> None:
        from torch.distributed.tensor import DTensor

        for k, v in sd.items():
            if isinstance(v, dict):
                Checkpointer._unwrap(v)
            elif isinstance(v, DTensor) and v.device_mesh.ndim == 2:
                sd[k] = v.to_local()

    # -- save / load ---------------------------------------------------------------------------
    def save(self, step: int, model, optimizer, train_state: dict) -> Path:
        """Write checkpoint `step` atomically (temp dir, checksums, then rename) and prune old ones.

        train_state: the trainer's own state (step, scheduler, sampler), stored as JSON: plain
        dicts, lists, str, int, finite floats, bools and None only. CheckpointError naming the step
        and the file on any failure (on every rank)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        final = self.folder / f"step-{step:08d}"
        tmp = self.folder / f"step-{step:08d}.tmp"
        where = f"saving checkpoint step {step} in {tmp}"
        try:
            train_json = json.dumps(train_state, indent=1, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"{where}: the trainer state is not plain JSON ({e})") from None
        error = None
        if self.rank == 0:
            try:
                self.folder.mkdir(parents=True, exist_ok=True)
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir()
            except OSError as e:
                error = f"{where}: {e}"
        _agree(error)
        state = self._state(model, optimizer)
        with warnings.catch_warnings():
            warnings.filterwarnings(
                "ignore", message=".*assuming the intent is to save in a single process.*"
            )
            try:
                dcp.save(state, checkpoint_id=str(tmp))
            except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
                raise CheckpointError(f"{where}: {_describe(e)}") from None
        error = None
        if self.rank == 0:
            try:
                write_atomic(tmp / TRAIN_STATE, train_json)
            except OSError as e:
                error = f"{where}: {e}"
        _agree(error)
        # rank 0's listing, hashed by every rank: a file some rank cannot see is reported here
        names = _broadcast(sorted(p.name for p in tmp.iterdir()) if self.rank == 0 else None)
        files = self._hash_files(tmp, names)
        error = None
        unseen = sorted(n for n, v in files.items() if v["size"] < 0)
        ranks = {int(m.group(1)) for n in names if (m := _SHARD.match(n))}
        lost = [r for r in range(self.world) if r not in ranks]
        if unseen or lost:
            error = (
                f"{where}: {'files ' + str(unseen) + ' are not readable by every rank' if unseen else ''}"
                f"{'; ' if unseen and lost else ''}{f'no shard of rank(s) {lost} in it' if lost else ''}: "
                "every rank must write to the same --checkpoint.folder, on a file system they share"
            )
        if error is None and self.rank == 0:
            try:
                manifest = {
                    "format": FORMAT,
                    "step": step,
                    "time": time.time(),
                    "world": self.world,
                    "run": self.run,
                    "files": files,
                }
                write_atomic(tmp / MANIFEST, json.dumps(manifest, indent=1))
                if final.exists():
                    shutil.rmtree(final)
                os.replace(tmp, final)
                _fsync_dir(self.folder)
                if self.keep_latest > 0:
                    # the checkpoint just written (its files hashed back from disk) is never pruned,
                    # even when the folder holds checkpoints of higher steps from an earlier run;
                    # renamed before deleting, so an interrupted prune leaves no partial step folder
                    for _, old in self.complete()[: -self.keep_latest]:
                        if old != final:
                            gone = old.with_name(old.name + ".pruned")
                            os.replace(old, gone)
                            shutil.rmtree(gone, ignore_errors=True)
            except OSError as e:
                error = f"{where}: {e}"
        _agree(error)
        return final

    def _before_load(self, path: Path) -> tuple[dict, dict]:
        """The run shape checked; (DCP's state_dict_metadata, the trainer state)."""
        manifest_file = path / MANIFEST
        if manifest_file.is_file():
            try:
                saved_run = json.loads(manifest_file.read_text()).get("run", {})
            except (ValueError, AttributeError) as e:
                raise CheckpointError(f"{manifest_file} is not a valid manifest ({e})") from None
            self._check_run(path, saved_run)
        return read_metadata(path / ".metadata").state_dict_metadata, self._read_train_state(path)

    def load(self, path: Path, model, optimizer, train_state: dict) -> dict:
        """Load `path` (verified by `resume_path` or `verify`) into model and optimizer, restore this
        rank's RNG; returns the saved train state (the JSON `train_state` of the saving `save`;
        the `train_state` argument is not read).
        CheckpointError if the checkpoint's run shape differs from this run's, or it does not load
        (naming the step and the file)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        reader, planner = _checked_reader_and_planner()
        saved, train = self._local(self._before_load, path)
        step = _STEP_DIR.match(path.name)
        where = f"checkpoint step {int(step.group(1)) if step else '?'} ({path})"
        state = self._state(model, optimizer)
        # RNG states are per rank and per device type: restore those the checkpoint has (a run
        # saved with fewer ranks, or on CPU, has none for this rank / for CUDA; they stay as seeded)
        rng_key = f"rng_rank{self.rank}"
        rng = {k: v for k, v in state.pop(rng_key).items() if f"{rng_key}.{k}" in saved}
        if rng:
            state[rng_key] = rng
        with warnings.catch_warnings():
            warnings.filterwarnings(
                "ignore", message=".*assuming the intent is to load in a single process.*"
            )
            try:
                dcp.load(state, storage_reader=reader(str(path)), planner=planner())
            except (Exception, CheckpointException) as e:  # DCP wraps every rank's failure in one
                raise CheckpointError(f"{where} does not load into this model: {_describe(e)}") from None
        self._unwrap(state)
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, optimizer, state["optim"])
        if rng:
            set_rng_state(rng)
        return train
