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
