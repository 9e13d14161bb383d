"""Reading what a checkpoint holds without running code from it: DCP's `.metadata` through an
allow-list unpickler, DCP's byte items through `torch.load(weights_only=True)`, and only those this
run's own state has.

torch.distributed.checkpoint (DCP, and DTensor with it) is imported where a checkpoint is saved or
read, never at import: it costs every process ~1.2 s, and most runs (no checkpoint.folder, a
benchmark, `--help`) never touch a checkpoint.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import io
import pickle
import sys
from pathlib import Path

import torch

from mxmoe.train.checkpoint.common import CheckpointError

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
def checked_reader_and_planner() -> tuple[type, type]:
    """DCP's file reader and load planner, restricted (classes built on first use, DCP imported)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, StorageMeta, TensorStorageMetadata

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
        each through `torch.load(weights_only=True)` before DCP's own `torch.load` sees the same bytes,
        and only tensors of this run's dtypes (DCP would cast a float64 or int64 tensor silently)."""

        def set_up_planner(self, *args, **kwargs) -> None:
            super().set_up_planner(*args, **kwargs)
            mismatched = sorted(
                f"{k!r} is {v.properties.dtype} in the checkpoint, {self.state_dict[k].dtype} in this run"
                for k, v in self.metadata.state_dict_metadata.items()
                if isinstance(v, TensorStorageMetadata)
                and isinstance(self.state_dict.get(k), torch.Tensor)
                and v.properties.dtype != self.state_dict[k].dtype
            )
            if mismatched:
                more = f" (and {len(mismatched) - 1} more)" if len(mismatched) > 1 else ""
                raise CheckpointError(
                    f"tensor {mismatched[0]}{more}: refused, a checkpoint's tensors are never cast"
                )
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
