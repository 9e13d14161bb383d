"""Checkpoints with torch.distributed.checkpoint (DCP): model, optimizer, lr scheduler, data
sampler position, step and every rank's RNG state.

Layout: `folder/step-00000100/` (DCP files + `.metadata` + `manifest.json`). A save writes
`step-XXXXXXXX.tmp/` and renames it once every rank has finished, so an interrupted save (SIGTERM,
SIGKILL, a crash) never leaves a half-written directory under a final name; `latest()` only
returns complete ones.

`manifest.json` holds the size and SHA-256 of every file of the checkpoint (each rank hashes a
share of them) and the run's shape (model arguments, global batch, sequence length). A resume
verifies both before loading anything: a corrupted, truncated or missing file, or a run of another
shape, is a `CheckpointError` naming it, never a torch traceback or a silent continuation.
`resume_path(fallback=True)` instead moves a corrupt checkpoint aside (`step-XXXXXXXX.corrupt/`)
and takes the previous complete one. Pruning (`keep_latest`) never deletes the checkpoint just
written (verified by the hashing).

Expert-parallel experts are plain local tensors holding E / ep experts each; for saving they are
wrapped as DTensors on the (edp, ep) mesh (Shard(0) over ep, replicated over edp), so DCP stores
the full expert weights once and reloads each rank's slice.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

log = logging.getLogger("mxmoe.train")
_STEP_DIR = re.compile(r"^step-(\d{8})$")
MANIFEST = "manifest.json"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be resumed from; the message names the file or the setting."""


def _dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def _barrier() -> None:
    if _dist():
        dist.barrier()


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
        """(step, path) of complete checkpoints (saves that finished), oldest first."""
        if not self.folder.is_dir():
            return []
        out = []
        for p in self.folder.iterdir():
            m = _STEP_DIR.match(p.name)
            # a final name means the save finished (tmp dirs are renamed last); one that has lost
            # its .metadata since is still listed, so that resuming reports the damage
            if m and p.is_dir() and ((p / ".metadata").is_file() or (p / MANIFEST).is_file()):
                out.append((int(m.group(1)), p))
        return sorted(out)

    def latest(self) -> Path | None:
        done = self.complete()
        return done[-1][1] if done else None

    # -- integrity -----------------------------------------------------------------------------
    def _hash_files(self, path: Path, names: list[str]) -> dict[str, dict]:
        """{name: {"size", "sha256"}} of `names` under `path`, each rank hashing a share; the same
        dict on every rank. A missing file has size -1."""
        mine = {}
        for name in names[self.rank :: self.world]:
            f = path / name
            ok = f.is_file()
            mine[name] = {"size": f.stat().st_size if ok else -1, "sha256": _sha256(f) if ok else ""}
        out: dict[str, dict] = {}
        for part in _all_gather(mine):
            out.update(part)
        return out

    def verify(self, path: Path) -> dict:
        """Check `path` against its manifest (every file present, of the recorded size and SHA-256);
        returns the manifest. CheckpointError naming the first bad file otherwise (same on every rank)."""
        manifest_file = path / MANIFEST
        try:
            manifest = json.loads(manifest_file.read_text())
            files = manifest["files"]
        except FileNotFoundError:
            raise CheckpointError(
                f"checkpoint {path} has no {MANIFEST} (checksums): the file was deleted, or the "
                "checkpoint predates checksummed checkpoints (mxmoe 0.1.0 before them cannot be verified)"
            ) from None
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(
                f"{manifest_file} is not a valid manifest ({e}): the checkpoint is corrupt"
            ) from None
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
        return manifest

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
                if self.rank == 0:
                    log.warning("%s; moved aside as %s.corrupt", e, path.name)
                    aside = path.with_name(path.name + ".corrupt")
                    shutil.rmtree(aside, ignore_errors=True)
                    os.replace(path, aside)
                _barrier()
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
                "with the same model, training.batch_size x world size and training.seq_len, or start "
                "a new --checkpoint.folder (or --checkpoint.resume=false)"
            )

    # -- state -------------------------------------------------------------------------------
    def _is_expert(self, fqn: str) -> bool:
        return self.expert_mesh is not None and ".experts." in fqn

    def _wrap(self, t):
        from torch.distributed.tensor import DTensor, Replicate, Shard

        return DTensor.from_local(t, self.expert_mesh, [Replicate(), Shard(0)], run_check=False)

    def _state(self, model, optimizer, train_state: dict) -> dict:
        """The DCP state dict. Every dict in it is new: `get_optimizer_state_dict` hands back the
        optimizer's own per-parameter state dicts, and putting the DTensor wrappers into those
        would make the next `optimizer.step()` mix DTensors with plain tensors. The tensors
        themselves are shared (views), so `dcp.load` writes straight into the live state."""
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
        return {"model": msd, "optim": optim, "train": train_state, f"rng_rank{self.rank}": rng_state()}

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
        """Write checkpoint `step` atomically (temp dir, checksums, then rename) and prune old ones."""
        final = self.folder / f"step-{step:08d}"
        tmp = self.folder / f"step-{step:08d}.tmp"
        if self.rank == 0:
            self.folder.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        _barrier()
        state = self._state(model, optimizer, train_state)
        with warnings.catch_warnings():
            warnings.filterwarnings(
                "ignore", message=".*assuming the intent is to save in a single process.*"
            )
            dcp.save(state, checkpoint_id=str(tmp))
        _barrier()
        files = self._hash_files(tmp, sorted(p.name for p in tmp.iterdir() if p.is_file()))
        if self.rank == 0:
            manifest = {"step": step, "time": time.time(), "run": self.run, "files": files}
            with open(tmp / MANIFEST, "w") as fh:
                json.dump(manifest, fh, indent=1)
                fh.flush()
                os.fsync(fh.fileno())
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            _fsync_dir(self.folder)
            if self.keep_latest > 0:
                # the checkpoint just written (its files hashed back from disk) is never pruned,
                # even when the folder holds checkpoints of higher steps from an earlier run
                for _, old in self.complete()[: -self.keep_latest]:
                    if old != final:
                        shutil.rmtree(old, ignore_errors=True)
        _barrier()
        return final

    def load(self, path: Path, model, optimizer, train_state: dict) -> dict:
        """Load `path` (verified by `resume_path` or `verify`) into model and optimizer, restore this
        rank's RNG; returns the train state (a dict shaped like `train_state`, with the saved values).
        CheckpointError if the checkpoint's run shape differs from this run's, or it does not load."""
        manifest_file = path / MANIFEST
        if manifest_file.is_file():
            self._check_run(path, json.loads(manifest_file.read_text()).get("run", {}))
        state = self._state(model, optimizer, train_state)
        # RNG states are per rank and per device type: restore those the checkpoint has (a run
        # saved with fewer ranks, or on CPU, has none for this rank / for CUDA; they stay as seeded)
        saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
        rng_key = f"rng_rank{self.rank}"
        rng = {k: v for k, v in state.pop(rng_key).items() if f"{rng_key}.{k}" in saved}
        if rng:
            state[rng_key] = rng
        with warnings.catch_warnings():
            warnings.filterwarnings(
                "ignore", message=".*assuming the intent is to load in a single process.*"
            )
            try:
                dcp.load(state, checkpoint_id=str(path))
            except Exception as e:  # DCP wraps every rank's failure in one long exception
                raise CheckpointError(f"checkpoint {path} does not load into this model: {e}") from e
        self._unwrap(state)
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, optimizer, state["optim"])
        if rng:
            set_rng_state(rng)
        return state["train"]
