"""The torchtitan 0.2 adapter's tests inside the suite: tests/integrations/test_torchtitan_v0_2.py
needs torchtitan 0.2.x, which cannot share a process (nor a venv) with the 0.3 the suite imports, so
with `--torchtitan02 DIR` (what `make test` passes) it runs in a pytest process of its own with DIR
first on PYTHONPATH, while the rest of the suite runs beside it. Skipped without the option."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
V0_2_TESTS = Path(__file__).with_name("test_torchtitan_v0_2.py")


@pytest.mark.slow
def test_torchtitan_v0_2_adapter_tests_pass(request, tmp_path):
    folder = request.config.getoption("--torchtitan02")
    if folder is None:
        pytest.skip("no --torchtitan02 DIR given (make test gives it the folder holding torchtitan 0.2.2)")
    folder = Path(folder).resolve()
    assert (folder / "torchtitan").is_dir(), f"--torchtitan02={folder}: expected a folder holding torchtitan"
    # the inner run is a plain pytest run: none of this (xdist worker) process's pytest variables
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["PYTHONPATH"] = os.pathsep.join([str(folder), str(ROOT)])
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
           f"--basetemp={tmp_path / 'run'}", "-rs", str(V0_2_TESTS)]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=590)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-8000:]
    # every test ran (none skipped: a skip would mean the file did not see torchtitan 0.2)
    summary = out.strip().splitlines()[-1]
    assert re.search(r"\d+ passed", summary) and "skipped" not in summary, out[-4000:]
