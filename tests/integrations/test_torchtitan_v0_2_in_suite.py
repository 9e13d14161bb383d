"""The torchtitan 0.2 adapter's tests inside the suite: tests/integrations/test_torchtitan_v0_2.py
needs torchtitan 0.2.x, which cannot share a process (nor a venv) with the 0.3 the suite imports, so
with `--torchtitan02 DIR` (what `make test` passes) it runs in a pytest process of its own with DIR
first on PYTHONPATH, while the rest of the suite runs beside it (started when the session starts: a
subprocess job of tests/conftest.py). Skipped without the option."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest
from conftest import Job, JobResult, subprocess_job

ROOT = Path(__file__).resolve().parents[2]
V0_2_TESTS = Path(__file__).with_name("test_torchtitan_v0_2.py")


def _v0_2_run(config: pytest.Config, folder: Path) -> Job | str:
    """The inner pytest run of the 0.2 adapter's tests (a subprocess job: it starts with the session)."""
    tt02 = config.getoption("--torchtitan02")
    if tt02 is None:
        return "no --torchtitan02 DIR given (make test gives it the folder holding torchtitan 0.2.2)"
    tt02 = Path(tt02).resolve()
    assert (tt02 / "torchtitan").is_dir(), f"--torchtitan02={tt02}: expected a folder holding torchtitan"
    # the inner run is a plain pytest run: none of this (xdist worker) process's pytest variables
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["PYTHONPATH"] = os.pathsep.join([str(tt02), str(ROOT)])
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
           f"--basetemp={folder / 'run'}", "-rs", str(V0_2_TESTS)]
    return Job(cmd, timeout_s=1200, cwd=str(ROOT), env=env)  # ~260 s alone, ~2x beside the suite


torchtitan_v0_2_run = subprocess_job("torchtitan_v0_2_run", _v0_2_run)


@pytest.mark.slow
def test_torchtitan_v0_2_adapter_tests_pass(torchtitan_v0_2_run: JobResult):
    p = torchtitan_v0_2_run
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-8000:]
    # every test ran (none skipped: a skip would mean the file did not see torchtitan 0.2)
    summary = out.strip().splitlines()[-1]
    assert re.search(r"\d+ passed", summary) and "skipped" not in summary, out[-4000:]
