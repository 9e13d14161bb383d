"""Checkpoints with torch.distributed.checkpoint (DCP): model, optimizer, lr scheduler, data
sampler position, step and every rank's RNG state.

Layout: `folder/step-00000100/`: DCP's files (`.metadata` and rank R's `__R_0.distcp`, `__R_1.distcp`,
...: one a writer thread), `trainer_state.json` (step, scheduler, sampler: JSON, no pickle) and
`manifest.json`. A save writes
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

The package: `common` (the error, the file names, the collectives every rank agrees through),
`safe_load` (DCP's metadata and byte items read without running code), `manifest` (checksums and
what a step folder must hold), `folders` (the folder's lock, leftovers and step folders),
`checkpointer` (`Checkpointer`: save, find, verify, load).
"""

from mxmoe.train.checkpoint.checkpointer import Checkpointer, rng_state, save_seconds, set_rng_state
from mxmoe.train.checkpoint.common import FORMAT, MANIFEST, TRAIN_STATE, CheckpointError
from mxmoe.train.checkpoint.folders import claim_folder
from mxmoe.train.checkpoint.safe_load import read_metadata

__all__ = [
    "FORMAT",
    "MANIFEST",
    "TRAIN_STATE",
    "CheckpointError",
    "Checkpointer",
    "claim_folder",
    "read_metadata",
    "rng_state",
    "save_seconds",
    "set_rng_state",
]
