"""`mxmoe export`: a training checkpoint's model weights as one file, for use without the trainer.

    mxmoe export CHECKPOINT OUTPUT [--dtype bfloat16|float16|float32]

CHECKPOINT is a step folder (`ckpt/step-00000100`) or a checkpoint folder (its newest step folder).
It is verified as a resume would verify it (manifest sizes and SHA-256, DCP metadata read without
running code); only the model's tensors are read: no optimizer, no trainer state. OUTPUT's suffix
picks the format: `.pt` / `.pth` (`torch.save` of a plain state dict) or `.safetensors` (the
`safetensors` package: `pip install 'mxmoe[safetensors]'`). Floating-point tensors are cast to
`--dtype` (torchtitan's `checkpoint.export_dtype`; default float32, the trainer's master weights).

Beside OUTPUT, `OUTPUT.json` (e.g. `model.pt.json`) holds the architecture (`mxmoe.models.ModelArgs`
fields; `max_seq_len` is the run's `training.seq_len`), the dtype and the step. The weights are the
model's own: an MX-trained model stores its high-precision weights (MX only rounds inside the
GEMMs), with the state-dict keys of `mxmoe.models.Transformer`:

    args = ModelArgs(**json.load(open("model.pt.json"))["model_args"])
    model = Transformer(args)
    model.load_state_dict(torch.load("model.pt", weights_only=True))
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

import torch

from mxmoe.train.checkpoint.common import MANIFEST, CheckpointError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""--dtype -> the exported floating-point dtype (torchtitan's export_dtype spellings)."""
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
"""Short spellings accepted for --dtype (training.mixed_precision's)."""
FORMATS = {".pt": "torch", ".pth": "torch", ".safetensors": "safetensors"}
"""OUTPUT suffix -> file format."""


class ExportError(ValueError):
    """A checkpoint that cannot be exported, or an output that cannot be written; the message
    names the argument and the value."""


def step_folder(checkpoint: str | Path) -> Path:
    """The step folder `checkpoint` names: itself when it holds a manifest, else the newest step
    folder of the checkpoint folder it is. ExportError naming what was found otherwise."""
    from mxmoe.train.checkpoint.folders import step_folders

    path = Path(checkpoint)
    if not path.is_dir():
        raise ExportError(
            f"checkpoint {str(path)!r}: not a folder; expected a checkpoint folder or a step folder"
        )
    if (path / MANIFEST).is_file():
        return path
    steps = step_folders(path)
    if not steps:
        raise ExportError(
            f"checkpoint {str(path)!r} holds no step folder (step-XXXXXXXX/ with {MANIFEST}); expected a "
            "--checkpoint.folder of `mxmoe train` or one of its step folders"
        )
    return steps[-1][1]


def read_model_state(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """(the model's state dict as saved (plain CPU tensors, the checkpoint's dtypes), the manifest)
    of the verified step folder `path`; CheckpointError naming the file for a damaged one."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from mxmoe.train.checkpoint import manifest as mf
    from mxmoe.train.checkpoint.common import describe
    from mxmoe.train.checkpoint.safe_load import checked_reader_and_planner, read_metadata

    manifest = mf.verify(path, 0, 1)
    meta = read_metadata(path / ".metadata").state_dict_metadata
    model = {
        k.removeprefix("model."): torch.empty(v.size, dtype=v.properties.dtype)
        for k, v in meta.items()
        if k.startswith("model.") and isinstance(v, TensorStorageMetadata)
    }
    if not model:
        raise CheckpointError(f"checkpoint {path} holds no model tensors (no 'model.*' items)")
    # the metadata through the allow-list unpickler; only tensors requested (of the saved dtypes) are
    # read, the optimizer's byte items never
    reader, _ = checked_reader_and_planner()
    state = {"model": model}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
        try:
            dcp.load(state, storage_reader=reader(str(path)), planner=DefaultLoadPlanner())
        except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
            raise CheckpointError(f"checkpoint {path}: the model does not load: {describe(e)}") from None
    return state["model"], manifest


def export(checkpoint: str | Path, output: str | Path, dtype: str = "float32") -> Path:
    """Write the model weights of `checkpoint` (a step folder or a checkpoint folder: its newest
    step) to `output` (.pt / .pth / .safetensors) with floating-point tensors in `dtype` (a DTYPES
    key or alias), and `output`.json beside it (model_args, dtype, step). Returns the step folder read.
    ExportError naming the argument for a bad output, dtype or checkpoint; CheckpointError for a
    damaged checkpoint."""
    name = DTYPE_ALIASES.get(dtype, dtype)
    if name not in DTYPES:
        raise ExportError(f"dtype={dtype!r}: expected one of {list(DTYPES)} (or {list(DTYPE_ALIASES)})")
    out = Path(output)
    fmt = FORMATS.get(out.suffix)
    if fmt is None:
        raise ExportError(f"output={str(out)!r}: expected a file name ending in one of {list(FORMATS)}")
    if fmt == "safetensors":
        try:
            from safetensors.torch import save_file
        except ImportError:
            raise ExportError(
                f"output={str(out)!r}: writing safetensors needs the safetensors package: pip install "
                "'mxmoe[safetensors]' (or export to a .pt file)"
            ) from None
    if out.is_dir():
        raise ExportError(f"output={str(out)!r} is a folder; expected a file name")
    if not out.parent.is_dir():
        raise ExportError(f"output={str(out)!r}: folder {str(out.parent)!r} does not exist")
    sidecar = out.with_name(out.name + ".json")
    if sidecar.is_dir():
        raise ExportError(f"output={str(out)!r}: {str(sidecar)!r}, where its architecture goes, is a folder")
    from mxmoe.cli import check_out_file
    from mxmoe.train.checkpoint.folders import enclosing_step_folder

    inside = enclosing_step_folder(out.parent)
    if inside is not None:  # a file there is unlisted in its manifest: resume and export refuse it
        raise ExportError(
            f"output={str(out)!r} lies in the checkpoint step folder {str(inside)!r}: a file its "
            f"{MANIFEST} does not list spoils that checkpoint (resuming and exporting refuse it); write "
            "the output outside the step folders"
        )
    try:  # before the checkpoint is read: not a traceback from torch.save at the end
        check_out_file(str(out), "output", "model.pt")
    except ValueError as e:
        raise ExportError(str(e)) from None
    path = step_folder(checkpoint)
    state, manifest = read_model_state(path)
    run = manifest.get("run") or {}
    model_args = run.get("model")
    if not isinstance(model_args, dict):
        raise ExportError(f"checkpoint {str(path)!r}: its {MANIFEST} records no model arguments (run.model)")
    if type(run.get("seq_len")) is int:  # the rotary cache's length: the trainer's is training.seq_len
        model_args = {**model_args, "max_seq_len": run["seq_len"]}
    target = DTYPES[name]
    state = {k: (v.to(target) if v.is_floating_point() else v).contiguous() for k, v in state.items()}
    info = {"model_args": model_args, "dtype": name, "step": manifest.get("step"), "checkpoint": str(path)}
    if fmt == "safetensors":
        save_file(state, str(out), metadata={"format": "pt", "mxmoe": json.dumps(info)})
    else:
        torch.save(state, out)
    sidecar.write_text(json.dumps(info, indent=1) + "\n")
    return path


def build_parser() -> argparse.ArgumentParser:
    from mxmoe.cli import ArgumentParser

    p = ArgumentParser(
        prog="mxmoe export",
        description="Write a training checkpoint's model weights to one .pt or .safetensors file, with "
        "OUTPUT.json (the architecture) beside it; load them into mxmoe.models.Transformer without "
        "the trainer.",
    )
    p.add_argument(
        "checkpoint", help="a --checkpoint.folder of `mxmoe train` (its newest step) or a step folder"
    )
    p.add_argument("output", help="the file to write: .pt, .pth or .safetensors")
    p.add_argument(
        "--dtype",
        default="float32",
        choices=[*DTYPES, *DTYPE_ALIASES],
        help="dtype of the floating-point tensors (default float32)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        path = export(args.checkpoint, args.output, args.dtype)
    except (ExportError, CheckpointError) as e:
        print(f"mxmoe export: {e}", file=sys.stderr)
        return 2
    dtype = DTYPE_ALIASES.get(args.dtype, args.dtype)
    print(f"wrote {args.output} and {args.output}.json ({dtype}) from {path}")
    return 0
