"""scripts/gpu/ab_train.sh: each row runs the tree it names. A `python -m` started in the checkout
imports the checkout's mxmoe ahead of PYTHONPATH's, so the "before" rows once ran this tree."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import mxmoe

REPO = Path(__file__).parents[2]
PKG = Path(mxmoe.__file__).resolve().parent


@pytest.mark.slow
def test_before_and_after_rows_run_their_own_trees(tmp_path):
    before = tmp_path / "before"
    shutil.copytree(PKG, before / "mxmoe", ignore=shutil.ignore_patterns("__pycache__"))
    env = dict(os.environ, KINDS="before,after", STEPS="1", WARMUP="1",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    env.pop("PYTHONPATH", None)
    out = tmp_path / "ab"
    cmd = ["bash", str(REPO / "scripts/gpu/ab_train.sh"), str(out), str(before), "debug_moe", "eager", "1",
           "--training.device=cpu"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    for kind, tree in (("before", before / "mxmoe"), ("after", PKG)):
        doc = json.loads((out / f"eager_{kind}_1.json").read_text())
        assert doc["environment"]["mxmoe"] == str(tree.resolve()), kind
        assert [r["mxmoe"] for r in doc["rows"]] == [str(tree.resolve())], kind
    assert "| eager | before | 1 |" in (out / "summary.md").read_text()


def test_a_before_folder_without_mxmoe_is_refused(tmp_path):
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    env.pop("PYTHONPATH", None)
    script = str(REPO / "scripts/gpu/ab_train.sh")
    cmd = ["bash", script, str(tmp_path / "ab"), str(tmp_path), "debug_moe", "eager"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert f"PYTHONPATH={tmp_path} imports mxmoe from" in proc.stderr


def _stub_tree(root: Path) -> Path:
    """A BEFORE tree whose `python -m mxmoe bench train ... --json PATH` writes one row of STUB_TPS
    tokens/s, or exits 1 without a file when STUB_TPS is unset (a row that failed)."""
    (root / "mxmoe").mkdir(parents=True)
    (root / "mxmoe" / "__init__.py").write_text("")
    (root / "mxmoe" / "__main__.py").write_text(
        "import json, os, sys\n"
        "tps = os.environ.get('STUB_TPS')\n"
        "if not tps:\n"
        "    sys.exit(1)\n"
        "row = {'tokens_per_s': float(tps), 'step_ms': 1.0, 'host_ms': 1.0, 'peak_mem_gib': 1.0,\n"
        "       'loss': 1.0}\n"
        "json.dump({'rows': [row]}, open(sys.argv[sys.argv.index('--json') + 1], 'w'))\n"
    )
    return root


@pytest.mark.parametrize("tps", ["100", ""])
def test_summary_reads_only_this_calls_rows(tmp_path, tps):
    """Files of an earlier call in OUT (a row of a repeat not run now, this row's file when it wrote
    none now) are not this call's rows: they once went into the summary's medians."""
    before = _stub_tree(tmp_path / "before")
    out = tmp_path / "ab"
    out.mkdir()
    old = {"tokens_per_s": 999.0, "step_ms": 9.0, "host_ms": 9.0, "peak_mem_gib": 9.0, "loss": 9.0}
    stale = {"rows": [old]}
    for i in (1, 2):  # an earlier call's REPEATS=2
        (out / f"eager_before_{i}.json").write_text(json.dumps(stale))
    env = dict(os.environ, KINDS="before", STUB_TPS=tps,
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    env.pop("PYTHONPATH", None)
    cmd = ["bash", str(REPO / "scripts/gpu/ab_train.sh"), str(out), str(before), "debug_moe", "eager", "1"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    # a failed row fails the call (it exited 0, as if the A/B were whole), after the summary
    assert proc.returncode == (0 if tps else 1), proc.stdout[-2000:] + proc.stderr[-2000:]
    summary = (out / "summary.md").read_text()
    assert "999" not in summary
    if tps:
        assert "| eager | before | 1 | 100 |" in summary
        assert "eager before 1: rc=0 " in proc.stdout
    else:  # the row failed (its exit code printed): no row, and not the earlier call's file of it
        assert "eager before 1: rc=1 " in proc.stdout
        assert "| eager | before |" not in summary
        assert not (out / "eager_before_1.json").exists()
        assert "1 row(s) failed, left out of the summary" in proc.stderr
        assert "eager before 1 (rc=1, " in proc.stderr


@pytest.mark.slow
def test_every_other_round_runs_the_kinds_in_reverse(tmp_path):
    """Rounds alternate the kinds' order (before, bf16; bf16, before): a kind that always ran right
    after the same other one would carry an order effect into its ratio."""
    before = _stub_tree(tmp_path / "before")
    env = dict(os.environ, KINDS="before,bf16", STUB_TPS="100", STEPS="1", WARMUP="1",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    env.pop("PYTHONPATH", None)
    cmd = ["bash", str(REPO / "scripts/gpu/ab_train.sh"), str(tmp_path / "ab"), str(before), "debug_moe",
           "eager", "2", "--training.device=cpu"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    order = [line.split(":")[0] for line in proc.stdout.splitlines() if line.startswith("eager ")]
    assert order == ["eager before 1", "eager bf16 1", "eager bf16 2", "eager before 2"]


@pytest.mark.parametrize(
    "args, env, message",
    [
        (["debug_moe"], {}, "usage: ab_train.sh OUT BEFORE CONFIG MODES"),
        (["debug_moe", "eager", "abc"], {}, "REPEATS=abc: expected a number of rounds >= 1"),
        (["debug_moe", "eager", "0"], {}, "REPEATS=0: expected a number of rounds >= 1"),
        (["debug_moe", "eager"], {"KINDS": "bf16,mx"}, "KINDS: 'mx' is not a row kind"),
        (["debug_moe", "eager"], {"LIMIT": "4m"}, "LIMIT=4m: expected seconds per row >= 1"),
        (["debug_moe", ","], {}, "MODES=',': expected a comma list of bench train modes"),
        (["debug_moe", "eager"], {"BEFORE": "missing"}, "no such folder; expected one holding an mxmoe"),
        (["debug_moe", "eager"], {"OUT": "/proc/ab"}, "OUT=/proc/ab: cannot create or write in the folder"),
    ],
)
def test_bad_arguments_stop_the_call_before_any_row(tmp_path, args, env, message):
    """They ran every row into its error and exited 0 (REPEATS=abc or 0: no row at all; LIMIT: every
    row's `timeout` refused it); a missing BEFORE folder dropped the before rows with a `cd` error,
    and an OUT that cannot be created wrote the rows' files under /."""
    out = env.pop("OUT", str(tmp_path / "ab"))
    before = str(tmp_path / env.pop("BEFORE")) if "BEFORE" in env else ""
    run_env = dict(os.environ, **env, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    cmd = ["bash", str(REPO / "scripts/gpu/ab_train.sh"), out, before, *args]
    proc = subprocess.run(cmd, cwd=REPO, env=run_env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert message in proc.stderr
    assert not (tmp_path / "ab").exists()  # refused before OUT was made
