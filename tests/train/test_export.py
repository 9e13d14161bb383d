"""`mxmoe export`: a checkpoint's model weights as one .pt or .safetensors file that loads into
`mxmoe.models.Transformer` without the trainer, in the dtype asked; bad arguments and damaged
checkpoints are one-line errors."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_trainer import MX, TINY

from mxmoe.cli import main as cli
from mxmoe.models import ModelArgs, Transformer
from mxmoe.train import trainer

REPO = Path(__file__).parents[2]
TOKENS = torch.arange(2 * 16).reshape(2, 16) % 256

LOAD = """
import json, sys
import torch
from mxmoe.models import ModelArgs, Transformer
path, out = sys.argv[1], sys.argv[2]
args = ModelArgs(**json.load(open(path + ".json"))["model_args"])
if path.endswith(".safetensors"):
    from safetensors.torch import load_file
    state = load_file(path)
else:
    state = torch.load(path, weights_only=True)
model = Transformer(args)
model.load_state_dict(state)  # strict: every key of the model, no other
assert not any(m.startswith("mxmoe.train") for m in sys.modules), "the trainer was imported"
tokens = torch.arange(2 * 16).reshape(2, 16) % 256
with torch.no_grad():
    logits, _ = model.to(torch.float32)(tokens)
torch.save({"logits": logits, "dtypes": sorted({str(v.dtype) for v in state.values()})}, out)
"""


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    """A checkpoint folder of a 2-step MX run (steps 1 and 2 saved)."""
    tmp = tmp_path_factory.mktemp("export")
    argv = TINY + MX + ["--training.steps=2", "--checkpoint.interval=1", "--checkpoint.keep_latest_k=0"]
    assert trainer.main(argv + [f"--job.dump_folder={tmp}/run", f"--checkpoint.folder={tmp}/ckpt"]) == 0
    return tmp / "ckpt"


def _reference(step_dir: Path, tmp_path: Path) -> tuple[dict, torch.Tensor]:
    """The model state in `step_dir` as torch's own converter reads it (`dcp_to_torch_save`, the
    checkpoint's every item), and the logits of a Transformer holding it."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(step_dir, tmp_path / "ref.pt")
    state = torch.load(tmp_path / "ref.pt", weights_only=False)["model"]  # our own test checkpoint
    args = ModelArgs(**json.loads((step_dir / "manifest.json").read_text())["run"]["model"])
    model = Transformer(args)
    model.load_state_dict(state)
    with torch.no_grad():
        return state, model(TOKENS)[0]


def _load_elsewhere(path: Path, tmp_path: Path) -> dict:
    """Load `path` into a Transformer in a fresh process that imports no trainer; its logits."""
    out = tmp_path / "loaded.pt"
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
    subprocess.run([sys.executable, "-c", LOAD, str(path), str(out)], check=True, env=env, cwd=tmp_path)
    return torch.load(out, weights_only=True)


def test_export_pt_float32_is_the_checkpoint_model_and_loads_without_the_trainer(ckpt, tmp_path):
    out = tmp_path / "model.pt"
    assert cli(["export", str(ckpt), str(out)]) == 0  # the folder: its newest step
    ref_state, ref_logits = _reference(ckpt / "step-00000002", tmp_path)
    state = torch.load(out, weights_only=True)
    assert state.keys() == ref_state.keys()
    for k, v in ref_state.items():
        assert torch.equal(state[k], v), k
    info = json.loads(out.with_name("model.pt.json").read_text())
    assert (info["dtype"], info["step"]) == ("float32", 2)
    loaded = _load_elsewhere(out, tmp_path)
    assert loaded["dtypes"] == ["torch.float32"]
    assert torch.equal(loaded["logits"], ref_logits)


def test_export_safetensors_bfloat16_of_a_step_folder(ckpt, tmp_path):
    pytest.importorskip("safetensors")
    from safetensors.torch import load_file

    step = ckpt / "step-00000001"
    out = tmp_path / "m.safetensors"
    assert cli(["export", str(step), str(out), "--dtype", "bf16"]) == 0
    ref_state, _ = _reference(step, tmp_path)
    state = load_file(out)
    assert {k: v.dtype for k, v in state.items()} == {k: torch.bfloat16 for k in ref_state}
    for k, v in ref_state.items():
        assert torch.equal(state[k], v.to(torch.bfloat16)), k
    assert json.loads(out.with_name("m.safetensors.json").read_text())["step"] == 1
    loaded = _load_elsewhere(out, tmp_path)
    assert loaded["dtypes"] == ["torch.bfloat16"] and torch.isfinite(loaded["logits"]).all()


@pytest.mark.parametrize(
    "args, message",
    [
        (["{ckpt}", "{tmp}/m.bin"], "output='{tmp}/m.bin': expected a file name ending in one of"),
        (["{ckpt}", "{tmp}/m.pt", "--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
        (["{tmp}", "{tmp}/m.pt"], "checkpoint '{tmp}' holds no step folder"),
        (["{tmp}/none", "{tmp}/m.pt"], "checkpoint '{tmp}/none': not a folder"),
        (["{ckpt}", "{tmp}/no/m.pt"], "folder '{tmp}/no' does not exist"),
        (["{ckpt}", "/proc/m.pt"], "output '/proc/m.pt': cannot write in '/proc'"),
        (["{ckpt}", "{tmp}/d.pt"], "'{tmp}/d.pt.json', where its architecture goes, is a folder"),
    ],
)
def test_bad_arguments_are_one_line_errors_naming_them(ckpt, tmp_path, capsys, args, message):
    fill = {"ckpt": str(ckpt), "tmp": str(tmp_path)}
    (tmp_path / "d.pt.json").mkdir()
    with pytest.raises(SystemExit) if "--dtype" in args else _no_raise():
        assert cli(["export", *(a.format(**fill) for a in args)]) == 2
    err = capsys.readouterr().err
    assert message.format(**fill) in err and "Traceback" not in err
    assert not (tmp_path / "m.pt").exists()


def test_a_damaged_checkpoint_is_refused_naming_the_file(ckpt, tmp_path, capsys):
    import shutil

    step = tmp_path / "ckpt" / "step-00000002"
    shutil.copytree(ckpt / "step-00000002", step)
    shard = step / "__0_0.distcp"  # rank 0's first file (one a writer thread)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert cli(["export", str(step), str(tmp_path / "m.pt")]) == 2
    err = capsys.readouterr().err
    assert f"checkpoint file {shard} does not match its SHA-256" in err
    assert not (tmp_path / "m.pt").exists()


class _no_raise:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.slow
def test_export_of_an_expert_parallel_checkpoint_holds_every_expert(tmp_path):
    """2 CPU processes, experts over ep=2 (each rank holds 2 of the 4): the export holds all 4,
    equal to what torch's converter reads, and loads into the unsharded model."""
    argv = TINY + MX + ["--training.steps=2", "--parallelism.expert_parallel_degree=2"]
    argv += [f"--job.dump_folder={tmp_path}/run", f"--checkpoint.folder={tmp_path}/ckpt"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    cmd = [*run, "-m", "mxmoe", "train", *argv]
    subprocess.run(cmd, check=True, env=env, cwd=tmp_path, timeout=600, capture_output=True)
    out = tmp_path / "m.pt"
    assert cli(["export", str(tmp_path / "ckpt"), str(out)]) == 0
    state = torch.load(out, weights_only=True)
    assert state["layers.0.moe.experts.w1"].shape[0] == 4
    ref_state, ref_logits = _reference(tmp_path / "ckpt" / "step-00000002", tmp_path)
    assert state.keys() == ref_state.keys() and all(torch.equal(state[k], v) for k, v in ref_state.items())
    assert torch.equal(_load_elsewhere(out, tmp_path)["logits"], ref_logits)


def test_the_exported_architecture_runs_the_trained_sequence_length(tmp_path):
    """A run with training.seq_len above ModelArgs' default max_seq_len (256) exports
    max_seq_len = seq_len: the loaded model runs sequences of the length it was trained on."""
    argv = TINY + ["--training.seq_len=300", "--training.local_batch_size=1", "--training.steps=1"]
    argv += [f"--job.dump_folder={tmp_path}/run", f"--checkpoint.folder={tmp_path}/ckpt"]
    assert trainer.main(argv) == 0
    out = tmp_path / "m.pt"
    assert cli(["export", str(tmp_path / "ckpt"), str(out)]) == 0
    args = ModelArgs(**json.loads(out.with_name("m.pt.json").read_text())["model_args"])
    assert args.max_seq_len == 300
    model = Transformer(args)
    model.load_state_dict(torch.load(out, weights_only=True))
    with torch.no_grad():
        logits, _ = model(torch.zeros(1, 300, dtype=torch.long))
    assert logits.shape == (1, 300, 256) and torch.isfinite(logits).all()
