"""`Checkpointer`: save a run's state as a checkpoint, find the one to resume from, verify it and
load it (the package docstring says what a checkpoint holds and refuses)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from mxmoe.train.checkpoint import manifest as mf
from mxmoe.train.checkpoint.common import (
    FORMAT,
    MANIFEST,
    SHARD,
    STEP_DIR,
    TRAIN_STATE,
    CheckpointError,
    agree,
    broadcast,
    describe,
    distributed,
    fsync_dir,
    io_threads,
    run_local,
)
from mxmoe.train.checkpoint.folders import step_folders
from mxmoe.train.checkpoint.safe_load import checked_reader_and_planner, read_metadata
from mxmoe.train.metrics import write_atomic

log = logging.getLogger("mxmoe.train")


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


@contextmanager
def _writer_thread_errors():
    """The exceptions DCP's writer threads (`FileSystemWriter(thread_count > 1)`) die of, collected
    (not printed) while the block runs, the threads joined before it ends. DCP joins them and never
    looks at how they ended: a file one of them failed to write would be missing from a checkpoint
    that DCP wrote `.metadata` for as if it were whole."""
    errors: list[BaseException] = []
    previous = threading.excepthook

    def mine(thread) -> bool:
        return thread is not None and "_write_files_from_queue" in thread.name

    def hook(args) -> None:
        if mine(args.thread):
            errors.append(args.exc_value)
        else:
            previous(args)

    threading.excepthook = hook
    try:
        yield errors
    finally:
        for t in threading.enumerate():  # after a failure in the calling thread, its helpers may run on
            if mine(t) and t is not threading.current_thread():
                t.join(timeout=120)
        threading.excepthook = previous


class Checkpointer:
    """Save / find / load training checkpoints under `folder`.

    expert_mesh: the (edp, ep) DeviceMesh when experts are sharded by expert parallelism, else None.
    """

    def __init__(
        self,
        folder: str,
        keep_latest: int = 2,
        expert_mesh=None,
        run: dict | None = None,
        precision: dict | None = None,
        allow_precision_change: bool = False,
        threads: int = 0,
    ):
        """run: what a resumed run must match (JSON-able; e.g. model arguments, global batch and
        sequence length), stored in each checkpoint's manifest and compared by `load`.
        precision: the settings that decide the run's arithmetic ({option: value}, JSON-able),
        stored likewise; `load` refuses a checkpoint of another precision (naming each differing
        option) unless `allow_precision_change`, which only warns. None: not recorded nor checked.
        threads: this rank's writer and hashing threads for a save (0: `io_threads()`)."""
        self.folder = Path(folder)
        self.keep_latest = keep_latest
        self.expert_mesh = expert_mesh
        self.run = run or {}
        self.precision = precision
        self.allow_precision_change = allow_precision_change
        self.threads = threads or io_threads()
        self.rank = dist.get_rank() if distributed() else 0
        self.world = dist.get_world_size() if distributed() else 1

    # -- discovery ---------------------------------------------------------------------------
    def complete(self) -> list[tuple[int, Path]]:
        """(step, path) of every step folder (saves that finished: tmp dirs are renamed last),
        oldest first. One that has lost files since is listed too, so that resuming reports it."""
        return step_folders(self.folder)

    def latest(self) -> Path | None:
        done = self.complete()
        return done[-1][1] if done else None

    def verify(self, path: Path) -> dict:
        """Check step folder `path` against its manifest: the files present are exactly those listed
        (every rank's shard among them), each of the recorded size and SHA-256, `.metadata` holds
        only DCP metadata (allow-list unpickler) naming listed files, its byte items are the
        optimizer's. Returns the manifest; CheckpointError naming the first problem otherwise (the
        same on every rank: the local checks are agreed on before and after the collective hashing)."""
        return mf.verify(path, self.rank, self.world)

    @staticmethod
    def set_aside(path: Path, why: str) -> Path:
        """Rename step folder `path` to `path.why` (`corrupt`, `diverged`; an earlier folder of that
        name is replaced): kept for inspection, neither resumed nor pruned. Rank 0 only;
        OSError if it cannot be renamed. Returns the new path."""
        aside = path.with_name(f"{path.name}.{why}")
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(path, aside)
        return aside

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
                    try:
                        self.set_aside(path, "corrupt")
                    except OSError as err:
                        error = f"cannot move checkpoint {path} aside: {err}"
                agree(error)
        if done:
            raise CheckpointError(f"cannot resume: no checkpoint in {self.folder} verifies (all moved aside)")
        return None

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
        """Write checkpoint `step` atomically (temp dir, checksums, then rename) and prune old ones;
        the manifest records the seconds the save took up to it (`save_s`, see `save_seconds`).

        train_state: the trainer's own state (step, scheduler, sampler), stored as JSON: plain
        dicts, lists, str, int, finite floats, bools and None only. CheckpointError naming the step
        and the file on any failure (on every rank)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemWriter
        from torch.distributed.checkpoint.api import CheckpointException

        t0 = time.perf_counter()
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
        agree(error)
        state = self._state(model, optimizer)
        with warnings.catch_warnings(), _writer_thread_errors() as failed:
            warnings.filterwarnings(
                "ignore", message=".*assuming the intent is to save in a single process.*"
            )
            try:
                # a file per thread (DCP's one writer thread saves ~3.5x slower, docs/training.md)
                dcp.save(state, storage_writer=FileSystemWriter(str(tmp), thread_count=self.threads))
            except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
                raise CheckpointError(f"{where}: {'; '.join(describe(x) for x in [e, *failed])}") from None
        agree(f"{where}: {'; '.join(describe(x) for x in failed)}" if failed else None)
        error = None
        if self.rank == 0:
            try:
                write_atomic(tmp / TRAIN_STATE, train_json)
            except OSError as e:
                error = f"{where}: {e}"
        agree(error)
        # rank 0's listing, hashed by every rank: a file some rank cannot see is reported here
        names = broadcast(sorted(p.name for p in tmp.iterdir()) if self.rank == 0 else None)
        files = mf.hash_files(tmp, names, self.rank, self.world, self.threads)
        error = None
        unseen = sorted(n for n, v in files.items() if v["size"] < 0)
        ranks = {int(m.group(1)) for n in names if (m := SHARD.match(n))}
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
                    "save_s": round(time.perf_counter() - t0, 3),  # what a stop at a deadline must allow
                    "world": self.world,
                    "run": self.run,
                    "precision": self.precision,
                    "files": files,
                }
                write_atomic(tmp / MANIFEST, json.dumps(manifest, indent=1))
                if final.exists():
                    shutil.rmtree(final)
                os.replace(tmp, final)
                fsync_dir(self.folder)
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
        agree(error)
        return final

    def _before_load(self, path: Path) -> tuple[dict, dict]:
        """The run shape and precision checked; (DCP's state_dict_metadata, the trainer state)."""
        manifest_file = path / MANIFEST
        if manifest_file.is_file():
            try:
                manifest = json.loads(manifest_file.read_text())
                saved_run = manifest.get("run", {})
            except (ValueError, AttributeError) as e:
                raise CheckpointError(f"{manifest_file} is not a valid manifest ({e})") from None
            mf.check_run(path, self.run, saved_run)
            if self.precision is not None:
                saved = manifest.get("precision")
                mf.check_precision(path, self.precision, saved, self.allow_precision_change, self.rank == 0)
        return read_metadata(path / ".metadata").state_dict_metadata, mf.read_train_state(path)

    def load(self, path: Path, model, optimizer, train_state: dict) -> dict:
        """Load `path` (verified by `resume_path` or `verify`) into model and optimizer, restore this
        rank's RNG; returns the saved train state (the JSON `train_state` of the saving `save`;
        the `train_state` argument is not read).
        CheckpointError if the checkpoint's run shape differs from this run's, or it does not load
        (naming the step and the file)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        reader, planner = checked_reader_and_planner()
        saved, train = run_local(self._before_load, path)
        step = STEP_DIR.match(path.name)
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
                raise CheckpointError(f"{where} does not load into this model: {describe(e)}") from None
        self._unwrap(state)
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, optimizer, state["optim"])
        if rng:
            set_rng_state(rng)
        return train


def save_seconds(folder: str | Path) -> float | None:
    """The longest save recorded (`save_s`) in the manifests of `folder`'s step folders, or None if
    none records one: what a run stopped at a deadline must leave its save (`mxmoe compare`'s grace)."""
    longest = None
    for _, path in step_folders(Path(folder)):
        try:
            v = json.loads((path / MANIFEST).read_text()).get("save_s")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(v, (int, float)) and v >= 0:
            longest = v if longest is None else max(longest, v)
    return longest
