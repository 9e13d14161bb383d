"""scripts/torchtitan_h200.sh's argument checks (no GPU, no torchtitan): a bad argument stops the
call before anything is installed, built or run."""

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "args, env, message",
    [
        ([], {}, "usage: scripts/torchtitan_h200.sh OUT_DIR"),
        (["OUT", "abc"], {}, "STEPS=abc: expected a number of training steps >= 1"),
        (["OUT", "10", "2m"], {}, "RUN_TIMEOUT_S=2m: expected seconds per run >= 1"),
        (["OUT", "10", "30", "0,x"], {}, "SEEDS: 'x' is not a seed"),
        (["OUT", "10", "30", "0", "bf16"], {"BEFORE": "/no/tree"}, "BEFORE=/no/tree: no such folder"),
        (["/proc/tt", "10", "30", "0", "bf16"], {}, "OUT_DIR=/proc/tt: cannot create or write in the folder"),
    ],
)
def test_bad_arguments_stop_the_call_before_any_run(tmp_path, args, env, message):
    """STEPS, RUN_TIMEOUT_S and SEEDS went to every run unchecked: each failed in torchtitan or
    `timeout` after the data and the CUDA extension were built, and the call exited 0; a missing
    BEFORE was a `cd` error (exit 1)."""
    args = [str(tmp_path / "out") if a == "OUT" else a for a in args]
    proc = subprocess.run(
        ["bash", str(REPO / "scripts/torchtitan_h200.sh"), *args],
        cwd=REPO,
        env=dict(os.environ, **env),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert message in proc.stderr
    assert not (tmp_path / "out").exists()


def _fake_nvidia_smi(folder: Path, mib: int) -> dict:
    """A PATH whose nvidia-smi reports a GPU of `mib` MiB."""
    folder.mkdir()
    tool = folder / "nvidia-smi"
    tool.write_text(f"#!/bin/sh\necho {mib}\n")
    tool.chmod(0o755)
    return {"PATH": f"{folder}:{os.environ['PATH']}"}


@pytest.mark.parametrize(
    "parallel, variants, mib, message",
    [
        # the loss study's nine runs at once on an H100 (80 GiB): seven of them died out of memory
        ("9", "bf16,mxmoe,torchao", 81559, "PARALLEL=9: that many of these runs at once need up to ~213 GiB"),
        ("3", "bf16,mxmoe,torchao", 81559, "at most 2 at once fit"),
        # deterministic mxmoe runs hold 26.3 GiB, bf16 ones at least 13.2 (H200, 2026-12-07)
        ("6", "bf16,mxmoe", 81559, "need up to ~129 GiB (deterministic: 15 a bf16 run, 28 an mxmoe"),
        ("6", "bf16,mxmoe", 65536, "and the GPU has 64 GiB; at most 2 at once fit"),
    ],
)
def test_parallel_runs_must_fit_the_gpus_memory(tmp_path, parallel, variants, mib, message):
    env = dict(_fake_nvidia_smi(tmp_path / "bin", mib), PARALLEL=parallel)
    proc = subprocess.run(
        ["bash", str(REPO / "scripts/torchtitan_h200.sh"), str(tmp_path / "out"), "10", "30", "0,1,2",
         variants],
        cwd=REPO, env=dict(os.environ, **env), capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert message in proc.stderr
    assert not (tmp_path / "out").exists()


def test_runs_without_deterministic_mode_are_counted_smaller(tmp_path):
    """Without torchtitan's deterministic mode a bf16 or mxmoe run holds ~6 GiB (5.6 / 5.2 reserved on
    an H200): 7 each is counted, so four fit in 32 GiB where deterministic ones would not fit two."""
    env = dict(_fake_nvidia_smi(tmp_path / "bin", 32768), PARALLEL="6", DETERMINISTIC="0")
    proc = subprocess.run(
        ["bash", str(REPO / "scripts/torchtitan_h200.sh"), str(tmp_path / "out"), "10", "30", "0,1,2",
         "bf16,mxmoe"],
        cwd=REPO, env=dict(os.environ, **env), capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "need up to ~42 GiB" in proc.stderr and "at most 4 at once fit" in proc.stderr
    assert not (tmp_path / "out").exists()
