"""scripts/memory_snapshot_peak.py: the peak of a recorded trace and who allocated what is live there."""

import pickle
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import memory_snapshot_peak as msp  # noqa: E402

MIB = 2**20


def frame(file, line, name):
    return {"filename": file, "line": line, "name": name}


TORCH = frame("/usr/lib/python3/site-packages/torch/nn/modules/linear.py", 125, "forward")
MODEL = frame("/repo/torchtitan/models/moe/moe.py", 408, "forward")
CAST = frame("/repo/mxmoe/quant/cast.py", 77, "to_mx")


def snap():
    ev = [
        {"action": "alloc", "addr": 1, "size": 64 * MIB, "frames": [TORCH, MODEL]},
        {"action": "alloc", "addr": 2, "size": 16 * MIB, "frames": [CAST, MODEL]},
        {"action": "free_requested", "addr": 2, "size": 16 * MIB},
        {"action": "free_completed", "addr": 2, "size": 16 * MIB},
        {"action": "alloc", "addr": 3, "size": 16 * MIB, "frames": [CAST]},
        {"action": "alloc", "addr": 4, "size": 16 * MIB, "frames": [TORCH, CAST]},  # peak: 96 MiB
        {"action": "free_requested", "addr": 1, "size": 64 * MIB},
        {"action": "alloc", "addr": 5, "size": 8 * MIB, "frames": [MODEL]},
    ]
    segments = [{"total_size": 256 * MIB, "blocks": [
        {"address": 3, "size": 16 * MIB, "state": "active_allocated"},
        {"address": 4, "size": 16 * MIB, "state": "active_allocated"},
        {"address": 5, "size": 8 * MIB, "state": "active_allocated"},
        {"address": 9, "size": 100 * MIB, "state": "active_allocated"},  # before recording
        {"address": 10, "size": 50 * MIB, "state": "inactive"},
    ]}]
    return {"segments": segments, "device_traces": [ev]}


def test_peak_and_owners():
    r = msp.peak_report(snap())
    assert "peak of what it allocated: 0.09 GiB at event 5" in r  # 64 + 16 + 16 MiB
    assert "allocated before recording began (still live at the snapshot): 0.10 GiB" in r  # 100 MiB
    assert "reserved at the snapshot: 0.25 GiB; allocated: 0.14 GiB" in r
    rows = [line for line in r.splitlines() if line.startswith("| `")]
    # grouped by the first frame outside torch, largest first; the freed block is not live at the peak
    assert rows[0].startswith("| `torchtitan/models/moe/moe.py:408 forward` | 0.062 | 1 |")
    assert rows[1].startswith("| `repo/mxmoe/quant/cast.py:77 to_mx` | 0.031 | 2 |")
    assert len(rows) == 2


def test_top_folds_the_rest():
    r = msp.peak_report(snap(), top=1)
    assert "| 1 other lines | 0.031 | 2 |" in r


def test_bad_snapshot_is_named(tmp_path):
    with pytest.raises(ValueError, match="segments"):
        msp.peak_report([1, 2])
    with pytest.raises(ValueError, match="_record_memory_history"):
        msp.peak_report({"segments": [], "device_traces": [[]]})
    bad = tmp_path / "x.pickle"
    bad.write_bytes(b"not a pickle")
    p = subprocess.run([sys.executable, str(ROOT / "scripts/memory_snapshot_peak.py"), str(bad)],
                       capture_output=True, text=True)
    assert p.returncode == 1 and "cannot read a pickled memory snapshot" in p.stderr
    good = tmp_path / "s.pickle"
    good.write_bytes(pickle.dumps(snap()))
    script = str(ROOT / "scripts/memory_snapshot_peak.py")
    p = subprocess.run([sys.executable, script, str(good), "--top", "0"], capture_output=True, text=True)
    assert p.returncode == 2 and "--top 0" in p.stderr
    p = subprocess.run([sys.executable, str(ROOT / "scripts/memory_snapshot_peak.py"), str(good)],
                       capture_output=True, text=True)
    assert p.returncode == 0 and "| `repo/mxmoe/quant/cast.py:77 to_mx` |" in p.stdout
