"""scripts/gpu/numerics_study.sh's final status: the runs of this call's variants and seeds decide it,
not other runs an earlier study left in the same state folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).parents[2]


def _study(tmp_path: Path, runs: dict[str, int], compare_rc: int = 0,
           options: tuple[str, ...] = ("variants=bf16,mx",)) -> subprocess.CompletedProcess:
    """The script with `mxmoe compare` stood in for (exit `compare_rc`, runs nothing) over a state
    folder holding `runs` (VARIANT/seedS -> the run's return code in its command.json)."""
    state = tmp_path / "state"
    for run, rc in runs.items():
        (state / "runs" / run).mkdir(parents=True)
        (state / "runs" / run / "command.json").write_text(json.dumps({"returncode": rc, "seconds": 1}))
    py = tmp_path / "py"
    py.write_text(f'#!/usr/bin/env bash\n[ "$1" = -m ] && exit {compare_rc}\nexec {sys.executable} "$@"\n')
    py.chmod(0o755)
    cmd = ["bash", str(REPO / "scripts/gpu/numerics_study.sh"), str(state), "debug_moe", "2", "60", "0",
           *options, "parallel=1", f"ckpt={tmp_path / 'ckpt'}"]
    return subprocess.run(cmd, cwd=REPO, env=dict(os.environ, PY=str(py)), capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("mx_rc, status", [(0, 0), (1, 1)])
def test_status_is_this_calls_runs(tmp_path, mx_rc, status):
    proc = _study(tmp_path, {"bf16/seed0": 0, "mx/seed0": mx_rc, "mx_floor/seed0": 1, "bf16/seed7": 1})
    assert proc.returncode == status, proc.stdout + proc.stderr
    assert "mx_floor" not in proc.stdout and "seed7" not in proc.stdout  # another study's runs
    assert ("FAILED" in proc.stdout) == bool(mx_rc)


def test_a_refused_call_fails_beside_earlier_finished_runs(tmp_path):
    """compare refusing its arguments (status 2, no run started) over a state folder whose runs an
    earlier call finished: the call fails (it exited 0, the earlier runs passing for its own)."""
    proc = _study(tmp_path, {"bf16/seed0": 0, "mx/seed0": 0}, compare_rc=2)
    assert proc.returncode == 2, proc.stdout + proc.stderr


@pytest.mark.parametrize("variants, message", [("", "variants='': expected a comma list"),
                                               ("bf16,,mx", "variant '': expected one of")])
def test_an_empty_variant_is_refused(tmp_path, variants, message):
    proc = _study(tmp_path, {}, options=(f"variants={variants}",))
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert "unbound variable" not in proc.stderr and "bad array subscript" not in proc.stderr


def test_missing_dependencies_stop_the_study_before_any_run(tmp_path):
    """A Python without mxmoe's run-time dependencies (here: site-packages hidden, -I -S) stops the
    script at scripts/gpu/deps.sh with exit 2, naming them, before `mxmoe compare` starts a run
    (each run failed on `import tyro` on its own before)."""
    py = tmp_path / "py"
    log = tmp_path / "compare_called"
    py.write_text(f'#!/usr/bin/env bash\n[ "$1 $2" = "-m mxmoe" ] && touch {log} && exit 0\n'
                  f'exec {sys.executable} -I -S "$@"\n')
    py.chmod(0o755)
    cmd = ["bash", str(REPO / "scripts/gpu/numerics_study.sh"), str(tmp_path / "state"), "debug_moe",
           "2", "60", "0", "parallel=1", f"ckpt={tmp_path / 'ckpt'}"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(cmd, cwd=REPO, env=dict(env, PY=str(py)), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "tyro" in proc.stderr and "pyproject.toml" in proc.stderr
    assert not log.exists()


@pytest.mark.parametrize("args", [[], ["state", "debug_moe"], ["state", "", "2"]])
def test_missing_arguments_are_a_usage_error(args):
    """`${1:?usage}` exited 1 (bash's status for it), beside every other refusal's 2."""
    cmd = ["bash", str(REPO / "scripts/gpu/numerics_study.sh"), *args]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "usage: numerics_study.sh STATE_DIR PRESET STEPS" in proc.stderr


def _space(tmp_path: Path, preset: str, parallel: str, runs: dict[str, int] | None = None):
    """The script up to `mxmoe compare` (stood in for: it records its arguments and runs nothing)."""
    state = tmp_path / "state"
    for run, rc in (runs or {}).items():
        (state / "runs" / run).mkdir(parents=True)
        (state / "runs" / run / "command.json").write_text(json.dumps({"returncode": rc, "seconds": 1}))
    args = tmp_path / "compare_args"
    py = tmp_path / "py"
    py.write_text(f'#!/usr/bin/env bash\n[ "$1 $2" = "-m mxmoe" ] && echo "$@" > {args} && exit 0\n'
                  f'exec {sys.executable} "$@"\n')
    py.chmod(0o755)
    cmd = ["bash", str(REPO / "scripts/gpu/numerics_study.sh"), str(state), preset, "2", "60", "0,1",
           f"parallel={parallel}", f"ckpt={tmp_path / 'ckpt'}"]
    proc = subprocess.run(cmd, cwd=REPO, env=dict(os.environ, PY=str(py)), capture_output=True, text=True,
                          timeout=120)
    return proc, (args.read_text() if args.exists() else None)


def test_checkpoints_that_cannot_fit_are_named_before_any_run(tmp_path):
    """Runs at once whose checkpoints (12 bytes a parameter, saved when the call stops them) do not fit
    the checkpoint folder's free disk get a warning before any run, naming the sizes and what fits
    (their saves fail at the stop, losing the call's steps; runs that finish before it save nothing)."""
    import shutil

    from mxmoe.models.moe import model_args

    free = shutil.disk_usage(tmp_path).free
    layers = model_args("moe_2b").n_layers
    per_layer = model_args("moe_2b").num_params()[0] // layers
    n = int(free / 12 / per_layer / 1.5) + 2  # one run's checkpoint ~ 2/3 of the free space: one fits
    big = tmp_path / "big.toml"
    big.write_text(f'[model]\nname = "moe_2b"\nn_layers = {n}\n')
    proc, args = _space(tmp_path, str(big), "2")
    assert proc.returncode == 0 and "--parallel 2" in args, proc.stdout + proc.stderr
    assert "WARNING parallel=2: 2 run(s) at once would each save a" in proc.stderr
    assert "at most 1 fit" in proc.stderr
    # one at once fits; and with three of the four runs finished only one is left to run at once
    proc, args = _space(tmp_path, str(big), "1")
    assert proc.returncode == 0 and "--parallel 1" in args and "WARNING" not in proc.stderr
    proc, args = _space(tmp_path, str(big), "2", {"bf16/seed0": 0, "bf16/seed1": 0, "mx/seed0": 0})
    assert proc.returncode == 0 and "--parallel 2" in args and "WARNING" not in proc.stderr


def test_small_checkpoints_leave_parallel_as_given(tmp_path):
    proc, args = _space(tmp_path, "debug_moe", "4")
    assert proc.returncode == 0 and "--parallel 4" in args and "WARNING" not in proc.stderr


def test_auto_parallel_is_lowered_to_the_checkpoints_that_fit(tmp_path, monkeypatch):
    """parallel=auto (from the GPU's free memory: here a stand-in nvidia-smi with 97 GiB free and a
    recorded 1 GiB peak, 30 at once) is lowered to the runs whose checkpoints fit, and says so."""
    import shutil

    from mxmoe.models.moe import model_args

    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "nvidia-smi").write_text('#!/usr/bin/env bash\necho "0, 99328"\n')
    (bin_ / "nvidia-smi").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_}:{os.environ['PATH']}")
    rec = tmp_path / "state" / "runs" / "bf16" / "seed9"
    rec.mkdir(parents=True)
    (rec / "metrics.jsonl").write_text(json.dumps({"step": 1, "memory_gib": 1.0}) + "\n")
    free = shutil.disk_usage(tmp_path).free
    per_layer = model_args("moe_2b").num_params()[0] // model_args("moe_2b").n_layers
    n = int(free / 12 / per_layer / 1.5) + 2
    big = tmp_path / "big.toml"
    big.write_text(f'[model]\nname = "moe_2b"\nn_layers = {n}\n')
    proc, args = _space(tmp_path, str(big), "auto")
    assert proc.returncode == 0 and "--parallel 1" in args, proc.stdout + proc.stderr
    assert "parallel=auto: 30 run(s)" in proc.stdout and "parallel=auto lowered to 1" in proc.stderr
