"""Checkpoints with torch.distributed.checkpoint (DCP): model, optimizer, lr scheduler, data
sampler position, step and every rank's RNG state.

Layout: `folder/step-00000100/` (DCP files + `.metadata`). A save writes `step-XXXXXXXX.tmp/` and
renames it once every rank has finished, so an interrupted save (SIGTERM, SIGKILL, a crash) never
leaves a half-written directory under a final name; `latest()` only returns complete ones.

Expert-parallel experts are plain local tensors holding E / ep experts each; for saving they are
wrapped as DTensors on the (edp, ep) mesh (Shard(0) over ep, replicated over edp), so DCP stores
the full expert weights once and reloads each rank's slice.
"""

from __future__ import annotations

import os
import re
import shutil
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

_STEP_DIR = re.compile(r"^step-(\d{8})$")


def _dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def _barrier() -> None:
    if _dist():
        dist.barrier()


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

    def __init__(self, folder: str, keep_latest: int = 2, expert_mesh=None):
        self.folder = Path(folder)
        self.keep_latest = keep_latest
        self.expert_mesh = expert_mesh
        self.rank = dist.get_rank() if _dist() else 0

    # -- discovery ---------------------------------------------------------------------------
    def complete(self) -> list[tuple[int, Path]]:
        """(step, path) of complete checkpoints, oldest first."""
        if not self.folder.is_dir():
            return []
        out = []
        for p in self.folder.iterdir():
            m = _STEP_DIR.match(p.name)
            if m and p.is_dir() and (p / ".metadata").is_file():
                out.append((int(m.group(1)), p))
        return sorted(out)

    def latest(self) -> Path | None:
        done = self.complete()
        return done[-1][1] if done else None

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
        """Write checkpoint `step` atomically (temp dir, then rename) and prune old ones."""
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
        if self.rank == 0:
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            fd = os.open(self.folder, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            if self.keep_latest > 0:
                for _, old in self.complete()[: -self.keep_latest]:
                    shutil.rmtree(old, ignore_errors=True)
        _barrier()
        return final

    def load(self, path: Path, model, optimizer, train_state: dict) -> dict:
        """Load `path` into model and optimizer, restore this rank's RNG; returns the train state
        (a dict shaped like `train_state`, with the saved values)."""
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
            dcp.load(state, checkpoint_id=str(path))
        self._unwrap(state)
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, optimizer, state["optim"])
        if rng:
            set_rng_state(rng)
        return state["train"]
