"""scripts/gpu/suite.sh refuses a machine where torch sees no GPU: there every CUDA case skipped and
each part passed, a green run that had tested no kernel."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).parents[2]


def test_suite_refuses_without_a_gpu(tmp_path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OUT=str(tmp_path / "out"),
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    proc = subprocess.run(["bash", str(REPO / "scripts/gpu/suite.sh"), "tests/test_recipe.py"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "torch sees no GPU here (CUDA_VISIBLE_DEVICES=)" in proc.stderr
    assert not (tmp_path / "out" / "tests_test_recipe.py.log").exists()  # no part ran
