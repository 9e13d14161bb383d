"""What a step folder must hold: `manifest.json` (the size and SHA-256 of every file, the saving
world size, the run's shape) and the files it lists, each checked before anything is loaded."""

from __future__ import annotations

import json
import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from mxmoe.train.checkpoint.common import (
    FORMAT,
    MANIFEST,
    SHARD,
    TRAIN_STATE,
    CheckpointError,
    all_gather,
    io_threads,
    run_local,
    sha256,
)
from mxmoe.train.checkpoint.safe_load import read_metadata

log = logging.getLogger("mxmoe.train")


def _no_constant(name: str):
    raise ValueError(f"non-standard JSON constant {name}")


def _size_and_hash(f: Path) -> dict:
    try:
        if not f.is_file() or f.is_symlink():
            raise FileNotFoundError(f.name)
        return {"size": f.stat().st_size, "sha256": sha256(f)}
    except OSError:
        return {"size": -1, "sha256": ""}


def hash_files(
    path: Path, names: list[str], rank: int, world: int, threads: int | None = None
) -> dict[str, dict]:
    """{name: {"size", "sha256"}} of `names` under `path`, each rank hashing a share in `threads`
    threads (default `io_threads()`; hashlib releases the GIL); the same dict on every rank. A
    missing (or unreadable, or not regular) file has size -1."""
    share = names[rank::world]
    with ThreadPoolExecutor(max(1, min(threads or io_threads(), len(share) or 1))) as pool:
        mine = dict(zip(share, pool.map(_size_and_hash, [path / n for n in share]), strict=True))
    out: dict[str, dict] = {}
    for part in all_gather(mine):
        out.update(part)
    return out


def read_manifest(path: Path) -> dict:
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


def check_listing(path: Path) -> dict:
    """The manifest, checked against the folder's listing."""
    if path.is_symlink() or not path.is_dir():
        raise CheckpointError(f"checkpoint {path} is not a folder (a symbolic link or a file): refused")
    manifest = read_manifest(path)
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
    ranks = {int(m.group(1)) for name in files if (m := SHARD.match(name))}
    lost = [r for r in range(manifest["world"]) if r not in ranks]
    if lost:
        raise CheckpointError(
            f"checkpoint {path} was saved by {manifest['world']} ranks but its {MANIFEST} names no shard "
            f"of rank(s) {lost} (__{lost[0]}_0.distcp): the checkpoint is incomplete"
        )
    return manifest


def check_contents(path: Path, files: dict) -> None:
    """`.metadata` (allow-list unpickler) names only listed shards and the optimizer's byte
    items; the trainer state is JSON."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    md = read_metadata(path / ".metadata")
    for info in md.storage_data.values():
        rel = getattr(info, "relative_path", None)
        if rel not in files or not SHARD.match(str(rel)):
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
    read_train_state(path)


def read_train_state(path: Path) -> dict:
    f = path / TRAIN_STATE
    try:
        state = json.loads(f.read_text(), parse_constant=_no_constant)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint file {f} is not valid JSON ({e}): refused") from None
    if not isinstance(state, dict) or type(state.get("step")) is not int:
        raise CheckpointError(f"checkpoint file {f} holds no trainer state (an object with an int step)")
    return state


def verify(path: Path, rank: int, world: int) -> dict:
    """Check step folder `path` against its manifest: the files present are exactly those listed
    (every rank's shard among them), each of the recorded size and SHA-256, `.metadata` holds
    only DCP metadata (allow-list unpickler) naming listed files, its byte items are the
    optimizer's. Returns the manifest; CheckpointError naming the first problem otherwise (the
    same on every rank: the local checks are agreed on before and after the collective hashing)."""
    manifest = run_local(check_listing, path)
    files = manifest["files"]
    got = hash_files(path, sorted(files), rank, world)
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
    run_local(check_contents, path, files)
    return manifest


def check_run(path: Path, run: dict, saved: dict) -> None:
    """CheckpointError if the checkpoint's run shape differs from this run's."""
    diffs = []
    for k, v in run.items():
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


def check_precision(path: Path, precision: dict, saved, allow: bool, warn: bool) -> None:
    """CheckpointError naming each option of `precision` ({option: value}: this run's) that differs
    from `saved` (the manifest's), unless `allow` (then a warning, logged where `warn`). A
    checkpoint without a record (`saved` None: an earlier mxmoe) is resumed with a warning."""
    if saved is None:
        if warn:
            log.warning(
                "checkpoint %s records no precision (saved by an earlier mxmoe): resuming it in this run's "
                "(%s) without a check",
                path,
                ", ".join(f"{k}={v!r}" for k, v in precision.items()),
            )
        return
    if not isinstance(saved, dict):
        raise CheckpointError(f"{path / MANIFEST}: \"precision\" must be an object, got {saved!r}: refused")
    def shown(d: dict, k: str) -> str:
        return repr(d[k]) if k in d else "unset"

    diffs = [
        f"{k}: checkpoint {shown(saved, k)}, this run {shown(precision, k)}"
        for k in sorted(set(saved) | set(precision))
        if k not in saved or k not in precision or saved[k] != precision[k]
    ]
    if not diffs:
        return
    if allow:
        if warn:
            log.warning(
                "checkpoint %s was trained in another precision (%s): continuing it in this run's, as "
                "checkpoint.allow_precision_change=true asks",
                path,
                "; ".join(diffs),
            )
        return
    raise CheckpointError(
        f"checkpoint {path} was trained in another precision ({'; '.join(diffs)}): resume with its "
        "--model.converters / --mx.* / --training.mixed_precision, start a new --checkpoint.folder, or "
        "pass --checkpoint.allow_precision_change=true to continue it in this run's precision"
    )
