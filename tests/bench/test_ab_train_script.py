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
