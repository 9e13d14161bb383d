"""tests/triton_sm90.py ran every check it has, and each check is asserted by a test."""

import json
import re
from pathlib import Path

from conftest import JobResult


def test_every_check_ran_and_has_a_test(triton_sm90: JobResult):
    from triton_sm90 import CHECKS

    assert triton_sm90.returncode == 0, triton_sm90.stderr[-4000:]
    assert set(json.loads((triton_sm90.folder / "results.json").read_text())) == set(CHECKS)
    asserted = set()
    for path in Path(__file__).parent.rglob("test_*.py"):
        for call in re.findall(r"assert_sm90_check\(triton_sm90, ([^)]*)\)", path.read_text()):
            asserted.update(re.findall(r'"(\w+)"', call))
    assert asserted == set(CHECKS)
